"""The README stays a front page: at most 900 words, the two set-up commands on its first screen, a feature table
whose status cells are a few words; the details live in docs/status.md. The links of the README, CONTRIBUTING.md
and docs/status.md resolve, headings included, and every `make` target they name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "docs" / "status.md"]
MAX_WORDS = 900  # `wc -w`: whitespace-separated tokens, code blocks included
MAX_STATUS_WORDS = 12
FIRST_SCREEN_LINES = 25

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def words(markdown: str) -> int:
    """Words as a reader sees them: a link counts as its text."""
    return len(LINK.sub(r"\1", markdown).split())


def feature_rows() -> list[tuple[str, str]]:
    """(feature, status) of each row of the README's table headed `| feature | status |`."""
    lines = README.read_text().splitlines()
    start = lines.index("| feature | status |") + 2  # after the header and its separator
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        # a table cell cannot hold a bare |, so splitting on it is exact here
        feature, status = (cell.strip() for cell in line.strip().strip("|").split("|"))
        rows.append((feature, status))
    return rows


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of a markdown file (outside code blocks; repeats get -1, -2...)."""
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#+ (.+)$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen.setdefault(f"{slug}-{count}", 1)
    return set(seen)


def test_the_readme_is_at_most_900_words():
    count = len(README.read_text().split())
    assert count <= MAX_WORDS, f"README.md has {count} words (at most {MAX_WORDS}): move details to docs/status.md"


def test_the_two_set_up_commands_are_on_the_first_screen():
    first_screen = README.read_text().splitlines()[:FIRST_SCREEN_LINES]
    commands = [line.split("#")[0].strip() for line in first_screen if line.startswith("make ")]
    assert commands == ["make demo", "make test"], first_screen


def test_feature_status_cells_are_at_most_12_words():
    rows = feature_rows()
    assert len(rows) >= 10, rows
    long = {feature: words(status) for feature, status in rows if words(status) > MAX_STATUS_WORDS}
    assert not long, f"status cells over {MAX_STATUS_WORDS} words (details go to docs/status.md): {long}"


def test_every_feature_row_links_to_its_details():
    unlinked = [feature for feature, status in feature_rows() if not LINK.search(feature + status)]
    assert not unlinked, f"feature rows without a link to docs: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve_to_files_and_headings(page):
    broken = []
    for _, target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_make_targets_named_exist(page):
    targets = set(re.findall(r"^([a-z0-9-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([a-z0-9-]+)", page.read_text()))
    assert named <= targets, f"{page.relative_to(ROOT)} names make targets the Makefile lacks: {named - targets}"
