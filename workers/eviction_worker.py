"""The eviction worker's entry point: a thin shell over ``zerda_cache.worker``.

    python workers/eviction_worker.py --redis-url redis://localhost:6379/0

Everything (the lease, the APScheduler jobs, signals, metrics) lives in the library; see
``zerda_cache/worker.py`` and ``docs/metrics.md``. ``zerda-cache worker`` runs the same.
"""

from __future__ import annotations

import sys

from zerda_cache.worker import main

if __name__ == "__main__":
    sys.exit(main())
