"""Every relative link of the Markdown pages resolves: README.md, CONTRIBUTING.md, CHANGELOG.md
and docs/*.md link to files that exist, and a ``#anchor`` names a heading of the page it points
to (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, ``-1``... for repeats).
Code blocks are not read (a link there is code, not a link)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md")]
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of ``text`` (and explicit ``<a id=...>``)."""
    out: set[str] = set()
    for line in _prose(text):
        if not line.startswith("#"):
            continue
        base = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out | set(re.findall(r'<a (?:name|id)="([^"]+)"', text))


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file is missing or whose anchor is not on that page."""
    broken = []
    for line in _prose(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{target} (no such heading)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(ROOT)} has broken links"


def test_the_checker_finds_missing_files_and_headings(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# The `queue` rule, briefly\n## Repeat\n## Repeat\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n[a](other.md#the-queue-rule-briefly) [b](other.md#repeat-1) [c](#top)\n"
        "[d](missing.md) [e](other.md#nope) [f](#nor-here) [g](https://example.com/x.md)\n"
        "```\n[h](inside-a-block.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md (no such file)",
        "other.md#nope (no such heading)",
        "#nor-here (no such heading)",
    ]
