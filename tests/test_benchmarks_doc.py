"""docs/BENCHMARKS.md opens with the table of targets that benchmarks/summary.py makes from
the figures the benchmark scripts record in their sections: nobody types a figure in it.
Each row names a section of the page; a script's rerun replaces its own section and the
table, and leaves the history page (docs/benchmarks-history.md) alone."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _report  # noqa: E402
import summary  # noqa: E402
from _targets import TARGETS  # noqa: E402

DOC = ROOT / "docs" / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "benchmarks-history.md"


def table_rows(text: str) -> list[list[str]]:
    block = summary.SUMMARY.search(text)
    assert block is not None, "no opening table"
    full = block.group(0).split(summary.FULL_TITLE, 1)[1]
    lines = [line for line in full.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[1:]]


def test_the_opening_table_is_what_the_figures_give() -> None:
    text = DOC.read_text()
    assert summary.with_summary(text) == text, (
        "the opening table differs from what the sections' figures give: "
        "run .venv/bin/python benchmarks/summary.py (never edit it by hand)"
    )


def test_the_table_opens_the_page() -> None:
    text = DOC.read_text()
    assert text.startswith(summary.HEADER)
    assert text.index("<!-- summary -->") < text.index("<!-- section:")


def test_every_row_names_a_section_of_the_page() -> None:
    text = DOC.read_text()
    found = {s.name: s for s in summary.sections(text)}
    rows = table_rows(text)
    assert len(rows) == len(TARGETS)
    for what, _bar, _latest, met, where, command in rows:
        if met == summary.NOT_MEASURED:
            assert where == "-", what
            continue
        assert met in ("met", "**not met**"), (what, met)
        name = re.fullmatch(r"\[([\w.-]+)\]\(#([\w.-]+)\), \d{4}-\d{2}-\d{2}", where)
        assert name is not None and name.group(1) == name.group(2), where
        section = found.get(name.group(1))
        assert section is not None, f"{what}: no section {name.group(1)!r} in BENCHMARKS.md"
        assert f'<a id="{section.name}"></a>' in text  # the link's anchor
        assert command == f"`{section.command}`", what


def test_most_targets_are_measured() -> None:
    """A target no section measures says so; the rest each come from a section."""
    rows = table_rows(DOC.read_text())
    unmeasured = [r[0] for r in rows if r[3] == summary.NOT_MEASURED]
    assert len(unmeasured) <= 2, unmeasured


def test_the_sections_figures_are_readable() -> None:
    """Every section names its command and run; where a figures block is, it parses and
    names its figures as the targets do (``area.…``)."""
    text = DOC.read_text()
    assert text.count("<!-- figures") == sum(1 for s in summary.sections(text) if s.figures)
    for s in summary.sections(text):
        assert s.command.startswith(".venv/bin/python benchmarks/"), s.name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", s.run_at), s.name
        for key in s.figures:
            assert re.fullmatch(r"[\w-]+(\.[\w-]+)+", key), (s.name, key)


def nav_files(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from nav_files(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from nav_files(value)


def test_the_guide_lists_both_pages() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    files = set(nav_files(config["nav"]))
    assert {"BENCHMARKS.md", "benchmarks-history.md"} <= files
    assert HISTORY.read_text().startswith(summary.HISTORY_HEADER)
    assert "](benchmarks-history.md)" in DOC.read_text()


def test_no_section_is_on_both_pages() -> None:
    here = {s.name for s in summary.sections(DOC.read_text())}
    moved = {s.name for s in summary.sections(HISTORY.read_text())}
    assert here and moved and not here & moved


# --- the writer, on copies of the pages ---------------------------------------------------
@pytest.fixture
def pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    doc, history = tmp_path / "BENCHMARKS.md", tmp_path / "benchmarks-history.md"
    doc.write_text(DOC.read_text())
    history.write_text(HISTORY.read_text())
    monkeypatch.setattr(_report, "BENCHMARKS_MD", doc)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "bench_lookup.py")])
    return doc, history


def test_a_rerun_replaces_its_section_and_the_table(pages: tuple[Path, Path]) -> None:
    doc, history = pages
    kept = history.read_text()
    key = "lookup.minilm.100000.p50_ping"
    for ratio in (6.25, 4.5):  # a run, then another: the second replaces the first
        _report.write_section(
            "lookup", "Lookup (bench_lookup.py)", f"Body at {ratio}.", figures={key: ratio}
        )
    text = doc.read_text()
    assert text.count("<!-- section:lookup -->") == 1
    assert "Body at 4.5." in text and "Body at 6.25." not in text
    assert summary.with_summary(text) == text
    row = next(r for r in table_rows(text) if r[0].startswith("Lookup p50 / PING p50, 100k"))
    assert row[2:4] == ["4.5x", "met"]
    assert row[4].startswith("[lookup](#lookup), ")
    assert row[5] == "`.venv/bin/python benchmarks/bench_lookup.py`"
    # a target the run did not measure again keeps the other sections' figures
    assert any(r[4].startswith("[cold-start-1m-minilm-width]") for r in table_rows(text))
    assert history.read_text() == kept


def test_a_new_section_goes_last_and_the_latest_run_wins(pages: tuple[Path, Path]) -> None:
    doc, history = pages
    kept = history.read_text()
    key = "worker.1000000.cycle_s"
    _report.write_section("worker-again", "Worker again", "Slower.", figures={key: 12.0})
    text = doc.read_text()
    assert text.rstrip().endswith("<!-- /section:worker-again -->")
    row = next(r for r in table_rows(text) if r[0] == "Worker: full cycle over 1M entries")
    assert row[2:4] == ["12.0 s", "**not met**"]
    assert row[4].startswith("[worker-again](#worker-again)")
    assert history.read_text() == kept


def test_archiving_moves_a_section_as_it_is(pages: tuple[Path, Path]) -> None:
    doc, history = pages
    before = doc.read_text()
    block = re.search(r"<!-- section:memory -->.*?<!-- /section:memory -->", before, re.S)
    assert block is not None
    summary.archive(["memory"], doc, history)
    after = doc.read_text()
    assert "<!-- section:memory -->" not in after
    assert history.read_text().rstrip().endswith(block.group(0))
    row = next(r for r in table_rows(after) if "default vector storage" in r[0])
    assert row[3] == summary.NOT_MEASURED
    assert summary.with_summary(after) == after


def test_the_page_opens_with_a_headline_of_at_most_ten_targets() -> None:
    text = DOC.read_text()
    block = summary.SUMMARY.search(text)
    assert block is not None
    head = block.group(0).split(summary.FULL_TITLE, 1)[0]
    rows = [line for line in head.splitlines() if line.startswith("| ")][1:]
    assert 0 < len(rows) == len(summary.HEADLINE) <= summary.MAX_HEADLINE
    full = {r[0]: r for r in table_rows(text)}
    for line in rows:
        what, latest, met, where = (c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1])
        assert full[what][2:5] == [latest, met, where], what  # the same figures as below
