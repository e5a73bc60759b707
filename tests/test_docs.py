"""The documentation as reference: every link lands, and the front page stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 10_000
"""Bytes: what it is, the two commands, one config, where to read on."""
PAGE_LIMIT = 40_000
"""Bytes a page of docs/ may hold: past it, a page is two subjects."""
DOCS_LIMIT = 222_000
"""Bytes docs/ holds in all: reference, not history (that is CHANGELOG.md's)."""


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule, which these links follow)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
    return {_anchor(match.group(1)) for match in re.finditer(r"(?m)^#+ (.*)$", text)}


def _links(page: Path) -> list[tuple[str, str | None]]:
    """Every relative link of ``page``: its target (empty for the page itself) and anchor."""
    found = re.finditer(r"\]\(([^)\s]*?)(?:#([\w\-]+))?\)", page.read_text())
    return [(m.group(1), m.group(2)) for m in found if not m.group(1).startswith(("http:", "https:", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_lands_on_a_file_and_a_heading_there(page: Path) -> None:
    broken = []
    for target, anchor in _links(page):
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor is not None and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}#{anchor}: no such heading")
    assert broken == []


def test_the_readme_is_a_front_page() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= README_LIMIT


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda page: page.name)
def test_a_page_of_docs_is_one_subject(page: Path) -> None:
    assert len(page.read_bytes()) <= PAGE_LIMIT


def test_docs_hold_reference_not_history() -> None:
    assert sum(len(page.read_bytes()) for page in (ROOT / "docs").iterdir()) <= DOCS_LIMIT
