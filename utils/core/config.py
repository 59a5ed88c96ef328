"""Command line + YAML recipes for the train scripts.

Each script declares its hyper-parameters in one dataclass at the top (cleanRL style, TRL names) and calls
``parse_config(Config)``. A recipe YAML (``--config recipe.yaml``) sets the same keys; flags on the command line
override it (a script may name a recipe read when no ``--config`` is given: ``default_recipe``). Field metadata may
declare ``help`` and ``choices``; ``Literal[...]`` annotations act as choices too. Flag groups, comments as help and
the description come from the class's source (utils.core.config_notes). A config's ``TRL_FLAGS`` table adds TRL's
flags that have no field of their own (utils.core.trl_flags).

Value syntax (command line):
  bool          ``--flag`` | ``--flag true`` | ``--flag false`` (also yes/no, 1/0, on/off)
  list[X]       ``--reward_funcs accuracy format`` or ``--reward_funcs accuracy,format``
  Optional[X]   ``--epsilon_high none`` (or ``null``)
  dict          ``--model_init_kwargs '{"torch_dtype": "bfloat16"}'`` (JSON)
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from utils.core.config_notes import description, flag_groups, group_topics, source_notes
from utils.core.secrets import recipe_without_secrets, redact
from utils.core.trl_flags import add_foreign_flags, comma_list, foreign_reference, take_foreign

_NONE_WORDS = {"none", "null"}
_TRUE_WORDS = {"true", "yes", "1", "on", "y", "t"}
_FALSE_WORDS = {"false", "no", "0", "off", "n", "f"}


class ConfigError(SystemExit, ValueError):
    """Bad recipe or flag. A SystemExit so a script exits with the message and no traceback; a ValueError so
    library callers and tests can catch it like any other bad-input error."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    """What we need to parse one dataclass field, derived once from its annotation."""

    name: str
    base: Any  # bool | int | float | str | dict | Path (the scalar or item type)
    is_list: bool
    is_tuple: bool
    optional: bool
    choices: tuple | None
    help: str


def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != len(typing.get_args(tp)):
            if len(args) != 1:
                raise TypeError(f"unsupported union type {tp}")
            return args[0], True
        raise TypeError(f"unsupported union type {tp}")
    return tp, False


def _field_spec(f: dataclasses.Field, tp) -> _FieldSpec:
    tp, optional = _unwrap_optional(tp)
    if f.default is None:
        optional = True
    is_list = False
    origin = typing.get_origin(tp)
    is_tuple = origin is tuple or tp is tuple
    if origin in (list, tuple) or tp in (list, tuple):
        is_list = True
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        tp = args[0] if args else str
        tp, _ = _unwrap_optional(tp)
    choices = f.metadata.get("choices")
    if typing.get_origin(tp) is typing.Literal:
        literal_values = typing.get_args(tp)
        choices = choices or literal_values
        tp = type(literal_values[0])
    if typing.get_origin(tp) is dict or tp is dict:
        tp = dict
    if tp not in (bool, int, float, str, dict, Path):
        raise TypeError(f"field {f.name!r}: unsupported type {tp!r} (use bool/int/float/str/Path/dict, a list or "
                        f"Optional of them, or Literal)")
    return _FieldSpec(name=f.name, base=tp, is_list=is_list, is_tuple=is_tuple, optional=optional,
                      choices=tuple(choices) if choices is not None else None, help=f.metadata.get("help", ""))


def _specs(config_cls) -> dict[str, _FieldSpec]:
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"{config_cls!r} is not a dataclass")
    hints = typing.get_type_hints(config_cls)
    specs = {f.name: _field_spec(f, hints[f.name]) for f in dataclasses.fields(config_cls) if f.init}
    _, comments = source_notes(config_cls)
    specs = {name: spec if spec.help or name not in comments else dataclasses.replace(spec, help=comments[name])
             for name, spec in specs.items()}
    if "config" in specs:
        raise TypeError("a config dataclass may not define a field named 'config' (reserved for --config)")
    return specs


def _convert_scalar(spec: _FieldSpec, value: Any, where: str):
    """Convert one scalar (a CLI token or a YAML value) to the field's type; `where` names the flag or key."""
    base = spec.base
    if isinstance(value, str) and value.strip().lower() in _NONE_WORDS:
        if spec.optional:
            return None
        if base is str:  # a plain string field keeps the word: `--report_to none` means no tracker
            return value
        raise ConfigError(f"{where}: None is not allowed here (the field is not Optional)")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
                return value.strip().lower() in _TRUE_WORDS
            raise ValueError(f"expected true/false, got {value!r}")
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            if isinstance(value, str):
                text = value.strip()
                # "1e3" or "1_000" are fine for integers as long as they are whole numbers
                number = float(text.replace("_", "")) if any(c in text for c in ".eE") else int(text, 10)
                if isinstance(number, float) and not number.is_integer():
                    raise ValueError(f"expected an integer, got {value!r}")
                return int(number)
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            # PyYAML reads "1e-5" (no dot) as a string, so strings are parsed here as well
            return float(value)
        if base is dict:
            if isinstance(value, dict):
                return value
            parsed = json.loads(value) if isinstance(value, str) else value
            if not isinstance(parsed, dict):
                raise ValueError(f"expected a mapping (JSON object), got {value!r}")
            return parsed
        if base is Path:
            return Path(value)
        value = comma_list(value)  # a list as TRL writes one (report_to): "a,b", or "none" when empty
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected a string, got {value!r}")
        return str(value)
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: invalid value {value!r}: {exc}") from None


def _check_choice(spec: _FieldSpec, value: Any, where: str):
    if spec.choices is None or value is None:
        return
    for item in value if spec.is_list else [value]:
        if item not in spec.choices:
            hint = difflib.get_close_matches(str(item), [str(c) for c in spec.choices], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                f"{where}: invalid choice {item!r}; choose from {', '.join(map(repr, spec.choices))}{extra}"
            )


def _convert(spec: _FieldSpec, value: Any, where: str):
    """Convert a whole field value (a list of CLI tokens, or any YAML value)."""
    if spec.is_list:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]  # a single CLI token may be "none" or "a,b,c"
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
            if spec.optional:
                return None
            raise ConfigError(f"{where}: None is not allowed here (the field is not Optional)")
        items = value if isinstance(value, (list, tuple)) else [value]
        tokens = []
        for item in items:
            if isinstance(item, str):
                tokens.extend(part.strip() for part in item.split(",") if part.strip())
            else:
                tokens.append(item)
        result = [_convert_scalar(dataclasses.replace(spec, optional=False), t, where) for t in tokens]
        if spec.is_tuple:
            result = tuple(result)
    else:
        if isinstance(value, list):
            if len(value) != 1:
                raise ConfigError(f"{where}: expected a single value, got {value!r}")
            value = value[0]
        if value is None:
            if not spec.optional:
                raise ConfigError(f"{where}: None is not allowed here (the field is not Optional)")
            result = None
        else:
            result = _convert_scalar(spec, value, where)
    _check_choice(spec, result, where)
    return result


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print + exit(2); we raise one catchable error instead
        if message.startswith("unrecognized arguments:"):
            known = [s for action in self._actions for s in action.option_strings]
            for token in message.split(":", 1)[1].split():
                hint = difflib.get_close_matches(token.split("=")[0], known, n=1) if token.startswith("--") else []
                if hint:
                    message += f" (did you mean {hint[0]}?)"
                    break
        self.print_usage(sys.stderr)
        raise ConfigError(f"{self.prog}: error: {message}")


def _fmt_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "required"


def build_parser(config_cls, prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field, in the groups of the class's headings (`flag_groups`). Defaults
    are SUPPRESSed so only flags actually given appear in the namespace: that is how the command line overrides
    the YAML and not the other way round."""
    specs = _specs(config_cls)
    parser = _Parser(prog=prog, usage="%(prog)s [-h] [--config RECIPE.yaml] [--FLAG VALUE ...]",
                     description=description(config_cls), argument_default=argparse.SUPPRESS, allow_abbrev=False)
    parser.add_argument("--config", metavar="RECIPE.yaml", help="YAML recipe; command line flags override it")
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    topics = group_topics(config_cls)
    for heading, names in flag_groups(config_cls):
        group = parser.add_argument_group(heading, topics.get(heading)) if heading else parser
        for name in names:
            spec = specs[name]
            flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
            help_text = spec.help
            if spec.choices is not None:
                help_text = f"{help_text} {{{', '.join(map(str, spec.choices))}}}".strip()
            help_text = f"{help_text} (default: {_fmt_default(fields[name])})".strip().replace("%", "%%")
            if spec.base is bool and not spec.is_list:
                group.add_argument(*flags, dest=name, nargs="?", const="true", metavar="true|false", help=help_text)
            elif spec.is_list:
                group.add_argument(*flags, dest=name, nargs="+", metavar=spec.base.__name__.upper(), help=help_text)
            else:
                group.add_argument(*flags, dest=name, metavar=spec.base.__name__.upper(), help=help_text)
    add_foreign_flags(parser, config_cls)  # TRL's flags without a field here: the last group
    return parser


def load_yaml_recipe(config_cls, path: str | Path) -> dict:
    """Read a recipe and convert its values; errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: recipe file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of key: value, got {type(data).__name__}")
    specs = _specs(config_cls)
    values = {}
    values.update(take_foreign(config_cls, specs, data, f"{path}: key", _convert, ConfigError))  # TRL's keys
    for key, value in recipe_without_secrets(data, path, ConfigError).items():  # utils/core/secrets.py
        if key not in specs:
            hint = difflib.get_close_matches(str(key), list(specs), n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{path}: unknown key {key!r}{extra}")
        values[key] = _convert(specs[key], value, f"{path}: key {key!r}")
    return values


def parse_config(config_cls, argv: list[str] | None = None, *, default_recipe=None):
    """Build a `config_cls` instance from defaults <- `--config` YAML <- command line flags.

    `default_recipe`: the recipe read in place of a `--config` the command line does not give, so that each flag
    given changes only itself: a path, or a function of the flags given ({name: value as typed}) that returns a
    path or None (no recipe: the defaults). A config's `RECIPE_FOLLOWERS` ({flag: (flags, ...)}) names the default
    recipe's values that only fit its own value of a flag (the weights of its reward functions): a command line that
    gives the flag and not them gets the defaults for them."""
    parser = build_parser(config_cls)
    namespace = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    given = vars(namespace)
    specs = _specs(config_cls)
    recipe = given.pop("config", None)
    default = recipe is None and default_recipe is not None
    if default:
        recipe = default_recipe(dict(given)) if callable(default_recipe) else default_recipe
    values = load_yaml_recipe(config_cls, recipe) if recipe else {}
    followers = getattr(config_cls, "RECIPE_FOLLOWERS", {}) if default else {}
    for follower in {f for flag, fs in followers.items() if flag in given for f in fs} - set(given):
        values.pop(follower, None)  # a default recipe's value that fits only its value of a flag given: the default
    values.update(take_foreign(config_cls, specs, given, "argument", _convert, ConfigError))
    for name, raw in given.items():
        values[name] = _convert(specs[name], raw, f"argument --{name}")
    missing = [f.name for f in dataclasses.fields(config_cls) if f.init and f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing required value(s): {', '.join('--' + m for m in missing)}")
    try:
        return config_cls(**values)
    except (ValueError, TypeError) as exc:  # __post_init__ validation of the script's own dataclass
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid configuration: {exc}") from None


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_to_dict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def config_to_dict(cfg) -> dict:
    """Plain (YAML/JSON-safe) dict of a config, in field order, for trackers, model cards and save_config (redacted)."""
    return redact({f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})


def save_config(cfg, path: str | Path) -> Path:
    """Write the config as a recipe YAML that `--config` reads back to the same values."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def choice(*options, help=""):
    """A dataclass field with a fixed set of values (the first is the default), enforced on CLI and YAML."""
    return dataclasses.field(default=options[0], metadata={"choices": list(options), "help": help})


# Flag reference: docs/flags.md is generated from the config dataclasses, so it cannot drift from them.


def flag_reference(config_cls, title: str) -> str:
    """A Markdown section listing every flag of a config: name, default, choices and help, in the groups `--help`
    shows (`flag_groups`), after the class's description."""
    specs = _specs(config_cls)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    lines = [f"## {title}", ""] + ([" ".join(description(config_cls).split()), ""] if description(config_cls) else [])
    topics = group_topics(config_cls)
    for heading, names in flag_groups(config_cls):
        lines += [f"**{heading}**" + (f": {topics[heading]}" if heading in topics else ""), ""] if heading else []
        lines += ["| flag | default | meaning |", "|---|---|---|"]
        for name in names:
            spec = specs[name]
            default = json.dumps(_plain(_fmt_default(fields[name])))
            meaning = spec.help + (f" one of {{{', '.join(map(str, spec.choices))}}}" if spec.choices else "")
            lines.append(f"| `--{name}` | `{default}` | {meaning.strip().replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines[:-1]) + "\n"


FLAGS_HEADER = """# Flag reference

Generated from the config dataclasses at the top of each script by `make docs`
(`python -m utils.core.config docs/flags.md ...`); a test fails when this file is stale. Every flag is also a key of
a recipe YAML (`--config recipe.yaml`), and flags given on the command line override the recipe. Without `--config`
the training scripts, iterate.py and distill.py read their tiny recipe under the flags given (each flag changes only
itself), unless a flag names a model (or an endpoint) that is not a tiny one: the defaults below then apply. Booleans
take `--flag`, `--flag true|false`; lists take space- or comma-separated values; `none` sets an optional value to
None; dicts take JSON. `python <script>.py --help` prints the same groups.
"""


def flags_markdown(scripts: list[str]) -> str:
    """The whole docs/flags.md for `module:ConfigClass` entries (e.g. `train_grpo:GRPOConfig`)."""
    import importlib

    parts = [FLAGS_HEADER]
    for entry in scripts:
        module, cls = entry.split(":")
        config_cls = getattr(importlib.import_module(module), cls)
        parts += [flag_reference(config_cls, f"`{module}.py`")] + foreign_reference(config_cls, f"`{module}.py`")
    return "\n".join(parts)


if __name__ == "__main__":  # python -m utils.core.config docs/flags.md train_grpo:GRPOConfig ...
    Path(sys.argv[1]).write_text(flags_markdown(sys.argv[2:]), encoding="utf-8")
