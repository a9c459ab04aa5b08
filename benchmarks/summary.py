"""The opening table of docs/BENCHMARKS.md: each target the project holds itself to, its
bar, and the latest measurement of it.

The figures come from the benchmark scripts: each one ends its section with the figures
it measured (``_report.write_section(..., figures=...)``: a JSON object in an HTML
comment, ``<!-- figures {...} -->``), and every ``write_section`` rewrites this table.
The targets, and how each one reads the figures, are in ``_targets.py``. For each
target the table takes the latest section (by its run time) that has the figures it
reads; a target no section measures says so.

Older runs of a measurement move to docs/benchmarks-history.md, as written (``--archive``);
the scripts only ever write docs/BENCHMARKS.md.

    .venv/bin/python benchmarks/summary.py                  # rewrite the opening table
    .venv/bin/python benchmarks/summary.py --check          # exit 1 if it is out of date
    .venv/bin/python benchmarks/summary.py --archive NAME   # move section NAME to the history
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as ``python -m benchmarks.summary``
    sys.path.insert(0, str(HERE))

from _targets import TARGETS, Target  # noqa: E402

ROOT = HERE.parent
BENCHMARKS_MD = ROOT / "docs" / "BENCHMARKS.md"
HISTORY_MD = ROOT / "docs" / "benchmarks-history.md"

HEADER = """# Benchmarks

Every table below is written by a script in `benchmarks/`; none is typed by hand. Each
section names the machine and the exact command. The machines here are shared and noisy,
so every comparison is made side by side in one run and reported as a ratio.

The page opens with a headline: the few targets a user judges the cache by. Below it is
every target the project holds itself to, with the latest measurement of it. Both are made
from the figures each script records at the end of its section (`benchmarks/summary.py`,
which every script runs after writing its section; the targets are in
`benchmarks/_targets.py`); the commands are in the full table and the sections. This page
keeps the latest run of each measurement; earlier runs are in
[Benchmarks: earlier runs](benchmarks-history.md).
"""

HISTORY_HEADER = """# Benchmarks: earlier runs

Runs of a measurement that a later run of it replaced in [Benchmarks](BENCHMARKS.md), as
their scripts wrote them: each names its machine, its command and the commit it measured.
They show how a figure got where it is; the figures that stand are in the opening table
of [Benchmarks](BENCHMARKS.md).
"""

SECTION = re.compile(
    r"<!-- section:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /section:(?P=name) -->", re.S
)
#: A section's figures: ``<!-- figures {...} -->``, or with a note on where they came from
#: before the JSON (``<!-- figures, parsed from this section's tables {...} -->``).
FIGURES = re.compile(r"^<!-- figures(?P<note>[^{\n]*) (?P<json>\{.*?\}) -->$", re.M | re.S)
SUMMARY = re.compile(r"<!-- summary -->\n.*?<!-- /summary -->\n", re.S)
#: The row of a target no section measures.
NOT_MEASURED = "not measured"


@dataclass
class Section:
    """One section of docs/BENCHMARKS.md, as its script wrote it."""

    name: str
    title: str
    command: str
    commit: str
    run_at: str
    figures: dict[str, Any] = field(default_factory=dict)


def sections(text: str) -> list[Section]:
    """The sections of a page, in order, with their provenance and figures."""
    out = []
    for m in SECTION.finditer(text):
        body = m.group("body")
        title = re.search(r"^## (.+)$", body, re.M)
        command = re.search(r"^Command: `(.*)`", body, re.M)
        commit = re.search(r"^Commit: (\S+), run (.+)$", body, re.M)
        figures = FIGURES.search(body)
        out.append(
            Section(
                name=m.group("name"),
                title=title.group(1).strip() if title else m.group("name"),
                command=command.group(1) if command else "",
                commit=commit.group(1) if commit else "",
                run_at=commit.group(2).strip() if commit else "",
                figures=json.loads(figures.group("json")) if figures else {},
            )
        )
    return out


def figures_comment(figures: Mapping[str, Any]) -> str:
    """The comment a section ends with: its figures as one JSON object, numbers to six
    significant digits."""

    def short(v: Any) -> Any:
        return float(f"{v:.6g}") if isinstance(v, float) else v

    data = {k: short(v) for k, v in figures.items()}
    return f"<!-- figures {json.dumps(data, sort_keys=True)} -->"


def latest(target: Target, found: Iterable[Section]) -> Section | None:
    """The section run last of those that have every figure the target reads."""
    have = [s for s in found if all(k in s.figures for k in target.keys)]
    return max(have, key=lambda s: s.run_at, default=None)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def row(target: Target, found: list[Section]) -> list[str]:
    """The target's row: what, bar, latest measurement, met, section and command."""
    s = latest(target, found)
    if s is None:
        return [target.what, target.bar, "-", NOT_MEASURED, "-", f"`{target.command}`"]
    shown, met = target.judge(s.figures)
    day = s.run_at.split()[0]
    return [
        target.what,
        target.bar,
        shown,
        "met" if met else "**not met**",
        f"[{s.name}](#{s.name}), {day}",
        f"`{s.command}`",
    ]


#: The headline's rows (``Target.what`` of ``_targets.py``), at most ``MAX_HEADLINE``: speed,
#: what a replica costs, the bound's price in LLM calls, and that nothing is lost.
HEADLINE = (
    "Lookup p50 / PING p50, 100k entries of real embeddings (MiniLM)",
    "Near-copy (cosine 0.97) recall@1, 1M MiniLM entries",
    "New replica, 1M entries: index ready, from the worker's snapshot",
    "Replica index memory / raw float32, 1M MiniLM entries",
    "Worker: full cycle over 1M entries",
    "Redis bytes per entry / payload, 100k MiniLM QQP entries, default vector storage",
    "QQP, every pair: realised error at max_error_rate 1%, 2%, 5%, whole run and each half "
    "(before, after the drift)",
    "QQP, every pair: LLM calls per request at max_error_rate 2%, with correct hits ≥ 0.70 of "
    "the oracle's",
    "Fault campaign: acknowledged writes lost",
    "Client instructions per call, current / baseline, worst operation",
)
MAX_HEADLINE = 10
FULL_TITLE = "## Targets and where they stand"


def headline(found: list[Section]) -> list[str]:
    """The headline table's lines: what, latest, met and the section, for ``HEADLINE``."""
    by_what = {t.what: t for t in TARGETS}
    missing = [w for w in HEADLINE if w not in by_what]
    if missing or len(HEADLINE) > MAX_HEADLINE:
        raise ValueError(f"HEADLINE names no target {missing} or has over {MAX_HEADLINE} rows")
    lines = ["| target | latest | met | section |", "|---|---|---|---|"]
    for what in HEADLINE:
        cells = row(by_what[what], found)
        lines.append("| " + " | ".join(map(_cell, [cells[0], cells[2], cells[3], cells[4]])) + " |")
    return lines


def render(found: list[Section]) -> str:
    """The headline and the full table of targets, between the summary's markers."""
    header = ["target", "bar", "latest", "met", "section, run", "command"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(_cell, row(t, found))) + " |" for t in TARGETS]
    return (
        "<!-- summary -->\n## Headline\n\n"
        + "\n".join(headline(found))
        + f"\n\n{FULL_TITLE}\n\n"
        + "\n".join(lines)
        + "\n<!-- /summary -->\n"
    )


def with_summary(text: str) -> str:
    """``text`` with its opening table made from its own sections' figures (in place of
    the one it has, else before its first section)."""
    block = render(sections(text))
    if SUMMARY.search(text):
        return SUMMARY.sub(lambda _: block, text, count=1)
    first = text.find("<!-- section:")
    if first < 0:
        return text.rstrip() + "\n\n" + block
    return text[:first] + block + "\n" + text[first:]


def archive(names: list[str], doc: Path = BENCHMARKS_MD, history: Path = HISTORY_MD) -> None:
    """Move sections ``names`` from ``doc`` to the end of ``history``, as they are, and
    rewrite ``doc``'s opening table without them."""
    text = doc.read_text()
    moved = []
    for name in names:
        m = re.search(
            rf"<!-- section:{re.escape(name)} -->\n.*?<!-- /section:{re.escape(name)} -->\n*",
            text,
            re.S,
        )
        if m is None:
            raise SystemExit(f"no section {name!r} in {doc}")
        moved.append(m.group(0).rstrip("\n"))
        text = text[: m.start()] + text[m.end() :]
    kept = history.read_text() if history.exists() else HISTORY_HEADER
    history.write_text(kept.rstrip("\n") + "\n\n" + "\n\n".join(moved) + "\n")
    doc.write_text(with_summary(text.rstrip("\n") + "\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    parser.add_argument("--archive", nargs="+", metavar="NAME", help="sections to move")
    args = parser.parse_args()
    if args.archive:
        archive(args.archive)
    text = BENCHMARKS_MD.read_text()
    fresh = with_summary(text)
    if args.check:
        if fresh != text:
            raise SystemExit(f"{BENCHMARKS_MD}: the opening table is out of date")
        return
    BENCHMARKS_MD.write_text(fresh)
    print(render(sections(fresh)))


if __name__ == "__main__":
    main()
