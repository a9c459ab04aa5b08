"""The README's Python examples run as written (each starts its own throwaway server)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(BLOCKS[index], f"README.md example {index + 1}", "exec"), {"__name__": "doc"})
    out = capsys.readouterr().out
    assert out.strip()  # every example prints what it shows
    assert "miss" not in out.splitlines()[0]
