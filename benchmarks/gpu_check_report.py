"""What `benchmarks/gpu_check.py` found, and the Markdown it writes into ``benchmarks/results/``.

A run is a list of sections; each section holds correctness checks (pass/fail, with the numbers that decided
it), measurement tables (no pass/fail: timings and throughput) and skip lines (what did not run and why). The
exit status comes from the checks alone: any failed check fails the run.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Check:
    """One comparison against a reference. ``detail`` says what was compared and the tolerance."""

    name: str
    case: str  # shape / model / dtype, in words
    passed: bool
    measured: str  # the numbers that decided it, e.g. "max abs 1.2e-3, max rel 4e-4"
    tolerance: str
    error: str = ""  # why it failed, in one line (an exception, the first out-of-tolerance element...)


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Section:
    title: str
    checks: list[Check] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Report:
    device_name: str
    mode: str  # "full" (real shapes on CUDA) or "tiny" (the CPU self-test through Triton's interpreter)
    environment: dict[str, str]
    sections: list[Section] = field(default_factory=list)
    started: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))

    def section(self, title: str) -> Section:
        self.sections.append(Section(title))
        return self.sections[-1]

    @property
    def failures(self) -> list[tuple[str, Check]]:
        return [(s.title, c) for s in self.sections for c in s.checks if not c.passed]

    @property
    def passed(self) -> bool:
        return not self.failures

    def file_name(self) -> str:
        """``gpu-check-<YYYY-MM-DD>-<device>[-tiny].md``, the device name lower-cased with dashes."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.device_name.lower()).strip("-") or "unknown-device"
        suffix = "-tiny" if self.mode == "tiny" else ""
        return f"gpu-check-{self.started:%Y-%m-%d}-{slug}{suffix}.md"

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self.file_name()
        path.write_text(self.markdown())
        return path

    def markdown(self) -> str:
        checks = [c for s in self.sections for c in s.checks]
        verdict = "PASS" if self.passed else "FAIL"
        lines = [
            f"# kubellm GPU check: {self.device_name}",
            "",
            f"**{verdict}**: {len(checks) - len(self.failures)} of {len(checks)} correctness checks passed "
            f"({self.mode} mode, started {self.started:%Y-%m-%d %H:%M} UTC).",
            "",
        ]
        if self.failures:
            lines += ["## Failures", ""]
            lines += [f"- {title} / {c.name} ({c.case}): {c.error or c.measured}" for title, c in self.failures]
            lines.append("")
        lines += ["## Environment", ""] + [f"- {k}: {v}" for k, v in self.environment.items()] + [""]
        for s in self.sections:
            lines += _section_markdown(s)
        return "\n".join(lines).rstrip() + "\n"


def _section_markdown(s: Section) -> list[str]:
    lines = [f"## {s.title}", ""]
    if s.checks:
        lines += _table(["check", "case", "measured", "tolerance", "result"],
                        [[c.name, c.case, c.measured, c.tolerance,
                          "pass" if c.passed else f"**FAIL**: {c.error}" if c.error else "**FAIL**"]
                         for c in s.checks])
    for t in s.tables:
        lines += [f"### {t.title}", ""] + _table(t.header, t.rows) + [f"- {n}" for n in t.notes]
        if t.notes:
            lines.append("")
    lines += [f"- {n}" for n in s.notes]
    lines += [f"- skipped: {n}" for n in s.skipped]
    if s.notes or s.skipped:
        lines.append("")
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    def cell(v: str) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return out + [""]
