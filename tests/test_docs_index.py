"""The docs index lists every dated results page, and the README's layout names every script."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def test_every_results_page_is_indexed_with_a_finding():
    index = read("docs/README.md")
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| \[[^]]+\]\((results/[^)]+\.md)\) \|(.+)\|$",
                                                                 index, flags=re.M)}
    pages = sorted(os.path.relpath(p, os.path.join(REPO, "docs")) for p in glob.glob(f"{REPO}/docs/results/*.md"))
    assert pages, "no results pages found"
    missing = [page for page in pages if page not in rows]
    assert not missing, f"docs/README.md does not index {missing}: add a row with the page's one-line finding"
    assert all(len(finding) > 20 for finding in rows.values()), rows


def test_superseded_pages_name_their_successor():
    for line in read("docs/README.md").splitlines():
        if line.startswith("|") and "**superseded**" in line:
            links = re.findall(r"\]\((results/[^)]+\.md)\)", line)
            assert len(links) >= 2, f"a superseded row names no page that replaces it: {line}"


def test_readme_layout_names_every_script():
    readme = read("README.md")
    layout = readme[readme.index("## Layout"):]
    scripts = sorted(os.path.basename(p) for p in glob.glob(f"{REPO}/*.py"))
    assert scripts, "no top-level scripts found"
    missing = [s for s in scripts if not re.search(rf"^\s+{re.escape(s)}\s", layout, flags=re.M)]
    assert not missing, f"README.md's layout does not list {missing}"
