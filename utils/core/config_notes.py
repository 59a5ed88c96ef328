"""What a config dataclass's source says beyond its fields, read for the command line and the flag reference
(utils.core.config): the `# heading` comment above each field (its flag group), its trailing `# comment` (the help
of a field without one in its metadata), and the class docstring (`--help`'s description); `flag_groups` puts the
fields in their groups (GROUPS, then a script's own). A config that includes shared flag groups (utils.core.flags,
as bases) is read with its bases."""

import dataclasses
import inspect


def description(config_cls) -> str | None:
    """The class docstring written for it (not the signature dataclasses puts there when there is none)."""
    doc = (config_cls.__doc__ or "").strip()
    return None if not doc or doc.startswith(f"{config_cls.__name__}(") else doc


# The groups `--help` and docs/flags.md show, in this order; a heading `group: topic` puts its fields in `group` (the
# topic is told in the group's description), any other heading is a group of its own, after these.
GROUPS = ("model", "data", "generation", "GRPO loss", "rewards", "training", "logging", "hub", "distributed")


def group_of(heading: str) -> tuple[str, str]:
    """A field heading's (group, topic): "generation: tools (docs/tools.md)" -> ("generation", "tools
    (docs/tools.md)"), "GRPO loss" -> ("GRPO loss", ""); a heading not under one of GROUPS is its own group."""
    group, _, topic = heading.partition(": ")
    return (group, topic) if group in GROUPS else (heading, "")


def flag_groups(config_cls) -> list[tuple[str, list[str]]]:
    """The fields of a config in groups: (group, field names), GROUPS first in their order, then the other headings
    in the order they come in the class bodies. In a group the class's own fields come first, then those of the
    classes it includes (a base dataclass: flags several scripts share), each part in field order. Fields above the
    first heading are in the group "" (argparse's "options")."""
    names, (sections, _) = [f.name for f in dataclasses.fields(config_cls) if f.init], source_notes(config_cls)
    own = set(own_fields(config_cls))
    groups: dict[str, list[str]] = {}
    for name in sorted(names, key=lambda n: n not in own):  # stable: own fields first, each part in field order
        groups.setdefault(group_of(sections.get(name, ""))[0], []).append(name)
    rank = {group: i for i, group in enumerate(GROUPS)}
    return sorted(groups.items(), key=lambda item: rank.get(item[0], len(GROUPS)))


def group_topics(config_cls) -> dict[str, str]:
    """Each group's description: the topics of its headings ("includes: data set on the hub (TRL's names); image and
    video inputs"), in `flag_groups`' order of their fields."""
    sections, _ = source_notes(config_cls)
    topics: dict[str, list[str]] = {}
    for group, names in flag_groups(config_cls):
        for name in names:
            topic = group_of(sections.get(name, ""))[1]
            if topic and topic not in topics.setdefault(group, []):
                topics[group].append(topic)
    return {group: "includes: " + "; ".join(t) for group, t in topics.items() if t}


def own_fields(config_cls) -> list[str]:
    """The fields a class's own body declares (not those it inherits)."""
    return [name for name in config_cls.__dict__.get("__annotations__", {})]


def source_notes(config_cls) -> tuple[dict[str, str], dict[str, str]]:
    """From the class bodies (the class's and its dataclass bases'): field name -> the `# heading` comment above it
    ("" before the first), and field name -> its trailing `# comment` (the help text of fields without a `help` in
    their metadata)."""
    sections, comments = {}, {}
    for cls in reversed([c for c in config_cls.__mro__ if dataclasses.is_dataclass(c)]):  # a subclass's own win
        own_sections, own_comments = class_notes(cls)
        sections.update(own_sections)
        comments.update(own_comments)
    return sections, comments


def class_notes(cls) -> tuple[dict[str, str], dict[str, str]]:
    """`source_notes` of one class body, its own fields only."""
    try:
        source = inspect.getsource(cls).splitlines()[1:]
    except (OSError, TypeError):  # defined in a REPL or an exec'd string
        return {}, {}
    heading, sections, comments, in_doc = "", {}, {}, False
    for line in source:
        stripped = line.strip()
        if in_doc or stripped.startswith('"""'):  # the docstring: an odd count of quotes opens or closes it
            in_doc = (stripped.count('"""') % 2 == 1) != in_doc
            continue
        if stripped.startswith("#"):
            heading = stripped.lstrip("# ").strip()
            continue
        name = stripped.split(":", 1)[0].strip()
        if not name.isidentifier():
            continue
        sections.setdefault(name, heading)
        code, hash_, comment = stripped.partition("  # ")
        if hash_ and code.count('"') % 2 == 0:
            comments.setdefault(name, comment.strip())
    return sections, comments
