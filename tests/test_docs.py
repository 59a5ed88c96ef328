"""The project's own docs stay true to the code: the generated flag reference is fresh, links resolve,
nothing points outside the repository, and every shared module says what its one job is."""

import ast
import os
import re
import subprocess

import pytest

from utils.core.config import flags_markdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODULE_LINES = 400


def tracked(*patterns):
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return [p for p in out if os.path.exists(os.path.join(REPO, p))]


def flag_sources():
    with open(os.path.join(REPO, "Makefile")) as f:
        line = next(line for line in f if line.startswith("FLAG_SOURCES"))
    return line.split(":=", 1)[1].split()


def test_flag_reference_is_fresh():
    with open(os.path.join(REPO, "docs", "flags.md"), encoding="utf-8") as f:
        written = f.read()
    assert written == flags_markdown(flag_sources()), "docs/flags.md is stale: run `make docs`"


def test_every_flag_has_a_meaning():
    rows = [line for line in flags_markdown(flag_sources()).splitlines() if line.startswith("| `--")]
    assert rows and all(not line.rstrip().endswith("|  |") for line in rows), [r for r in rows if r.endswith("|  |")]


# Paths outside the repository that a file must not point to, spelled in pieces so this file passes itself.
OUTSIDE = ("DESIGN" + ".md", ".." + "/shared")


def test_nothing_points_outside_the_repository():
    offenders = []
    for path in tracked():
        if path.endswith((".png", ".jpg", ".safetensors")):
            continue
        with open(os.path.join(REPO, path), encoding="utf-8", errors="ignore") as f:
            text = f.read()
        if any(target in text for target in OUTSIDE):
            offenders.append(path)
    assert not offenders


@pytest.mark.parametrize("page", ["README.md"] + tracked("docs/*.md", "docs/**/*.md"))
def test_relative_links_resolve(page):
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        text = f.read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = os.path.normpath(os.path.join(REPO, os.path.dirname(page), target))
        assert os.path.exists(resolved), f"{page}: link to {target} does not resolve"


def test_readme_fits_on_two_screens():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 220


# git pathspecs match across folders: "utils/*.py" takes utils/t2i/*.py too.
LIBRARY_MODULES = tracked("utils/*.py", "tiny/*.py", "rewards/*.py", "kernels/*.py")
# A module over MAX_MODULE_LINES says why in a paragraph of its docstring that starts with these words.
SAYS_WHY_LONG = re.compile(rf"^Over {MAX_MODULE_LINES} lines on purpose: \S+( \S+){{4,}}", re.M)


@pytest.mark.parametrize("module", LIBRARY_MODULES)
def test_every_module_names_its_job(module):
    with open(os.path.join(REPO, module), encoding="utf-8") as f:
        source = f.read()
    if module.endswith("__init__.py") and not source.strip():
        return
    doc = ast.get_docstring(ast.parse(source))
    assert doc, f"{module} has no opening docstring"
    if len(source.splitlines()) > MAX_MODULE_LINES:
        assert SAYS_WHY_LONG.search(doc), (
            f"{module} is {len(source.splitlines())} lines, over {MAX_MODULE_LINES}: split it by noun, or start a "
            f"paragraph of its docstring with 'Over {MAX_MODULE_LINES} lines on purpose: <why>'")


def test_the_length_rule_reads_a_reason_and_covers_subpackages():
    assert SAYS_WHY_LONG.search("Kernels.\n\nOver 400 lines on purpose: the Triton kernels sit beside the torch path.")
    assert not SAYS_WHY_LONG.search("Kernels.\n\nOver 400 lines on purpose:")  # no reason given
    assert not SAYS_WHY_LONG.search("Kernels, long on purpose: the Triton kernels sit beside the torch path.")
    assert "utils/t2i/adapters.py" in LIBRARY_MODULES
