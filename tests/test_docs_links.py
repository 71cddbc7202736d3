"""Every relative link of the project's pages lands on a file that exists, and benchmarks/README.md stays a short
page of current results (the dated runs live in benchmarks/results/). Headings are not checked here: pages move
under their links more often than files do, and tests/test_readme.py checks the headings of its own pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_readme import LINK, words  # one definition of a link and of a word for every page test

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
MAX_BENCHMARKS_WORDS = 1500
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        BENCHMARKS_README,
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "benchmarks" / "results").glob("*.md"),
    ]
)


def broken_links(page: Path) -> list[str]:
    """The relative link targets of `page` (anchors dropped) that name no existing file or folder."""
    broken = []
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        prose = "" if in_code else re.sub(r"`[^`]*`", "", line)  # a regex in a code span is no link
        for _, target in LINK.findall(prose):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s), mailto: not checked offline; same-page anchors
            file_part = target.partition("#")[0]
            if not (page.parent / file_part).exists():
                broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_existing_files(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: links to missing files {broken_links(page)}"


def test_a_missing_file_is_reported(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text(
        "[ok](there.md#part) [gone](results/gone.md) [web](https://example.com) [top](#top)\n"
        "```\n[in code](not/checked.md)\n```\n`[a-z]([-a-z]*)?` is a pattern\n"
    )
    assert broken_links(page) == ["results/gone.md"]


def test_the_pages_include_the_benchmarks_readme_and_every_doc():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "benchmarks/README.md", "docs/status.md"} <= names


def test_the_benchmarks_readme_stays_a_short_page():
    count = words(BENCHMARKS_README.read_text())
    assert count <= MAX_BENCHMARKS_WORDS, (
        f"benchmarks/README.md has {count} words (at most {MAX_BENCHMARKS_WORDS}): move dated runs to "
        "benchmarks/results/YYYY-MM-DD-<topic>.md and keep only the current headline here"
    )


def test_every_headline_row_links_to_a_dated_report():
    """Each row of the current-results tables names a date and links to a report in benchmarks/results/."""
    rows = [
        line
        for line in BENCHMARKS_README.read_text().splitlines()
        if line.startswith("| ") and re.search(r"\| 20\d\d-\d\d-\d\d \|", line)
    ]
    assert len(rows) >= 10, rows
    unlinked = [row for row in rows if not re.search(r"\]\(results/[^)]+\.md\)", row)]
    assert not unlinked, f"headline rows without a dated report: {unlinked}"
