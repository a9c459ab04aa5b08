"""Shared helpers of the benchmark scripts: machine description and docs/BENCHMARKS.md.

Each benchmark owns one section of docs/BENCHMARKS.md, delimited by HTML comments, and
rewrites only that section, so the scripts can run in any order. A section ends with the
figures its script measured against the project's targets (a JSON object in an HTML
comment); the opening table of the file is made from them (``summary.py``), and
``write_section`` rewrites it with the section.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from summary import HEADER, figures_comment, with_summary

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "docs" / "BENCHMARKS.md"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line: CPU, cores, memory, OS, Python."""
    mem = ""
    try:
        kb = int(re.findall(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())[0])
        mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, IndexError):
        pass
    return (
        f"{cpu_model()}, {os.cpu_count()} cores{mem}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}"
    )


def command() -> str:
    """The command line that is running, as a user would type it from the repo root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(script)
    return " ".join([".venv/bin/python", shlex.quote(shown), *map(shlex.quote, sys.argv[1:])])


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance() -> dict[str, str]:
    """Where numbers come from: machine, command, commit and time of this run."""
    return {
        "machine": machine(),
        "command": command(),
        "commit": git_rev(),
        "run_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def write_section(
    name: str,
    title: str,
    body: str,
    origin: dict[str, str] | None = None,
    figures: Mapping[str, Any] | None = None,
) -> None:
    """Replace (or append) section ``name`` of docs/BENCHMARKS.md, then the opening table.

    ``origin`` (see ``provenance``) names the run that measured the numbers when the
    section is rendered later from saved results; by default, this run. ``figures``: the
    run's headline figures, by the names ``_targets.py`` reads them (for example
    ``lookup.minilm.100000.p50_ping``); the opening table shows, for each target, the
    latest section that has its figures.
    """
    o = origin or provenance()
    block = (
        f'<!-- section:{name} -->\n<a id="{name}"></a>\n\n## {title}\n\n'
        f"Machine: {o['machine']}  \nCommand: `{o['command']}`  \n"
        f"Commit: {o['commit']}, run {o['run_at']}\n\n{body.strip()}\n"
        + (f"\n{figures_comment(figures)}\n" if figures else "")
        + f"<!-- /section:{name} -->"
    )
    BENCHMARKS_MD.parent.mkdir(parents=True, exist_ok=True)
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else HEADER
    pattern = re.compile(
        rf"<!-- section:{re.escape(name)} -->.*?<!-- /section:{re.escape(name)} -->", re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(with_summary(text))


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def busiest_commands(
    client: Any, skip: tuple[str, ...] = (), top: int = 6
) -> list[tuple[str, Any]]:
    """Redis's own account per command since its stats were last reset (``INFO
    commandstats``): the ``top`` commands by time, as ``(NAME, stats)`` with the
    server's ``calls``, ``usec`` and ``usec_per_call``, leaving out the commands named in
    ``skip`` (lower case, e.g. ``"ping"``) and the INFO and CONFIG of the measuring
    itself. Commands that scripts call are counted twice: on their own, and within their
    script's time."""
    left_out = {"info", "config", *skip}
    stats = [
        (name.removeprefix("cmdstat_").upper(), v)
        for name, v in client.info("commandstats").items()
        if name.removeprefix("cmdstat_").split("|")[0] not in left_out
    ]
    stats.sort(key=lambda kv: -kv[1]["usec"])
    return stats[:top]
