"""The docs index lists every dated results page (superseded ones marked, on the page too), every relative link
and anchor in the docs resolves, and the README's layout names every script and top-level folder."""

import glob
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)\s]*)\)")
INDEX_ROW = re.compile(r"^\| \[[^]]+\]\((results/[^)]+\.md)\) \|(.+)\|$", flags=re.M)


def read(path, root=REPO):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return f.read()


def results_pages():
    return sorted(os.path.relpath(p, os.path.join(REPO, "docs")) for p in glob.glob(f"{REPO}/docs/results/*.md"))


def index_rows(index):
    return {m.group(1): m.group(2).strip() for m in INDEX_ROW.finditer(index)}


def missing_from_index(index):
    rows = index_rows(index)
    return [page for page in results_pages() if page not in rows]


def test_every_results_page_is_indexed_with_a_finding():
    rows = index_rows(read("docs/README.md"))
    assert results_pages(), "no results pages found"
    missing = missing_from_index(read("docs/README.md"))
    assert not missing, f"docs/README.md does not index {missing}: add a row with the page's one-line finding"
    assert all(len(finding) > 20 for finding in rows.values()), rows


def test_the_index_check_notices_a_dropped_row():
    index = read("docs/README.md")
    page = results_pages()[0]
    dropped = "\n".join(line for line in index.splitlines() if f"]({page})" not in line)
    assert missing_from_index(dropped) == [page]


def test_superseded_pages_name_their_successor_in_the_index_and_on_the_page():
    rows = index_rows(read("docs/README.md"))
    for page, finding in rows.items():
        marked = "**superseded**" in finding.lower()
        top = "\n".join(read(os.path.join("docs", page)).splitlines()[:6])
        assert marked == ("**superseded**" in top.lower()), (
            f"{page}: the index and the page's opening lines disagree on whether it is superseded")
        if marked:
            successors = [os.path.basename(p) for p in re.findall(r"\]\((results/[^)]+\.md)\)", finding)]
            assert successors, f"the index row of {page} names no page that replaces it"
            for successor in successors:
                assert f"]({successor})" in top, f"{page} does not name {successor} at its top"


def slug(heading):
    """The anchor a markdown heading gets on the code host: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path, root):
    seen, out = {}, set()
    in_code = False
    for line in read(path, root).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


def broken_links(page, root=REPO):
    broken = []
    for target in LINK.findall(read(page, root)):
        if "://" in target or target.startswith("mailto:") or not target:
            continue
        path, _, fragment = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(root, resolved)):
            broken.append(f"{target} (no such file)")
        elif fragment and resolved.endswith(".md") and fragment not in anchors(resolved, root):
            broken.append(f"{target} (no such heading)")
    return broken


DOC_PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/**/*.md", recursive=True))


@pytest.mark.parametrize("page", DOC_PAGES)
def test_relative_links_and_their_anchors_resolve(page):
    assert not broken_links(page), f"{page}: {broken_links(page)}"


def test_the_link_check_notices_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page (`a.md`)\n\n## Two words\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#two-words) [ok](docs/a.md#a-page-amd) [gone](docs/b.md) "
                                        "[bad](docs/a.md#three-words) [web](https://example.org/x.md)\n")
    assert broken_links("README.md", str(tmp_path)) == ["docs/b.md (no such file)",
                                                        "docs/a.md#three-words (no such heading)"]


def test_readme_layout_names_every_script_and_folder():
    readme = read("README.md")
    layout = readme[readme.index("## Layout"):]
    layout = layout[:layout.index("\n## ", 1)]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    scripts = sorted({p for p in tracked if "/" not in p and p.endswith(".py")})
    folders = sorted({p.split("/")[0] + "/" for p in tracked if "/" in p and not p.startswith(".")})
    assert "train_grpo.py" in scripts and "utils/" in folders
    missing = [name for name in scripts + folders if not re.search(rf"^\s+{re.escape(name)}\s", layout, flags=re.M)]
    assert not missing, f"README.md's layout does not list {missing}"
