"""The eviction worker's entry point: the ``zerda-cache worker`` command, as a script.

    python workers/eviction_worker.py --redis-url redis://localhost:6379/0

Takes the options of ``zerda-cache worker --help``. Everything (the lease, the
APScheduler jobs, signals, metrics) lives in the library; see ``zerda_cache/worker/scheduler.py``
and ``docs/metrics.md``.
"""

from __future__ import annotations

import sys

from zerda_cache.cli import cli

if __name__ == "__main__":
    cli(["worker", *sys.argv[1:]], prog_name="eviction_worker.py")
