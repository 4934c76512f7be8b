"""The documentation's links: every relative link in README.md, BENCHMARKS.md and docs/ points
at a file that exists, and an anchor at a heading of that page; every test file (and test) the
pages name is there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_every_relative_link_resolves():
    bad, seen = [], 0
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            seen += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where} (no such heading)")
    assert seen > 50 and not bad, bad


def test_every_test_the_pages_name_exists():
    """``tests/.../test_x.py`` and ``tests/.../test_x.py::test_y`` in the pages: the file exists
    (the tests move with the package's folders) and defines the test."""
    bad, seen = [], 0
    for page in PAGES:
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", page.read_text()):
            seen += 1
            where = f"{page.relative_to(ROOT)}: {path}"
            if not (ROOT / path).is_file():
                bad.append(f"{where} (no such file)")
            elif name and f"def {name}(" not in (ROOT / path).read_text():
                bad.append(f"{where}::{name} (no such test)")
    assert seen > 20 and not bad, bad
