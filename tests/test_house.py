"""House rules a newcomer can rely on, checked on the source itself.

Code comments and docstrings say how things are and why, never their history: no dates,
no commit ids. A figure that explains a constant points to the benchmark script that
measures it (and to docs/BENCHMARKS.md), not to the day it was measured.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerda_cache"

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
#: What reads as history in the package's source: a date (2026-12-04, 2026-12,
#: "December 2026", "December 4, 2026") or a commit id ("commit a780d98", "at 37ae331";
#: a hex word of 7 to 40 characters with at least one digit, so that English words made
#: of the letters a-f, such as "defaced", do not count).
_HEX = r"(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}"
HISTORY = re.compile(
    r"\b(?:19|20)\d{2}-(?:0[1-9]|1[0-2])(?:-\d{2})?\b"
    rf"|\b(?:{_MONTHS})(?:\s+\d{{1,2}},?)?\s+(?:19|20)\d{{2}}\b"
    rf"|\bcommits?\s+{_HEX}\b"
    rf"|\bat\s+{_HEX}\b",
    re.IGNORECASE,
)
#: ``(path relative to the repository, line text)`` pairs whose date is data, not
#: history (a format example, a fixed date a test relies on). Empty: none is needed.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _sources() -> list[Path]:
    paths = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")]
    return sorted(p for p in paths if "__pycache__" not in p.parts)


def test_code_comments_carry_no_dates_or_history() -> None:
    sources = _sources()
    assert len(sources) > 50  # the scan really reads the package
    hits = []
    for path in sources:
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = HISTORY.search(line)
            if match and (rel, line.strip()) not in ALLOWED:
                hits.append(f"{rel}:{number}: {match.group(0)!r} in {line.strip()}")
    assert not hits, "dates or commit ids in the package's source:\n" + "\n".join(hits)


def test_the_scan_knows_history_when_it_sees_it() -> None:
    for text in (
        "(side by side, 2026-12-03)",
        "run 2026-12 on a 2-core host",
        "measured in December 2026",
        "since December 4, 2026",
        "before commit a780d98, of three fields",
        "the tree at 37ae331 did this",
    ):
        assert HISTORY.search(text), text
    for text in (
        "a removal costs the server ~15-20 us",
        "entries 20,000 to 1,000,000 (1e-4)",
        "a graph that was defaced at decade boundaries",
        "ZCIX format 5, M=32, ef_construction=128",
        "float16 bits 0x3c00",
    ):
        assert not HISTORY.search(text), text
