"""``zerda-cache``: the operator's command line.

Every command takes ``--redis-url`` (or ``ZERDA_REDIS_URL``); without either, the commands
that need a server start the embedded one (a throwaway server: useful for trying things,
empty each time). Logging is configured here and nowhere else in the package.

Exit codes: 0 ok, 1 not found or unhealthy, 2 bad usage or Redis unreachable.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from zerda_cache.config import CacheConfig
from zerda_cache.errors import EntryNotFoundError, ZerdaError
from zerda_cache.keys import leader_key
from zerda_cache.maintenance import Maintenance
from zerda_cache.storage import RedisStorage

console = Console()
err = Console(stderr=True)


@dataclass
class CliState:
    """Shared options, and a connection made on first use."""

    url: str | None
    cluster: bool
    key_prefix: str
    _storage: RedisStorage | None = None
    _server: Any = None
    _closers: list[Any] = field(default_factory=list)

    @property
    def config(self) -> CacheConfig:
        return CacheConfig(key_prefix=self.key_prefix)

    def storage(self) -> RedisStorage:
        if self._storage is None:
            from zerda_cache.manager import connect

            url = self.url
            if url is None:
                from zerda_cache.testing import RedisServer

                self._server = RedisServer().start()
                url = self._server.url
                err.print(
                    f"[yellow]no --redis-url or ZERDA_REDIS_URL: using an embedded "
                    f"{self._server.kind} server at {url} (empty, gone on exit)[/yellow]"
                )
            client = connect(url, self.config, cluster=self.cluster or None)
            self._closers.append(client.close)
            self._storage = RedisStorage(client, self.config)
        return self._storage

    def close(self) -> None:
        for close in self._closers:
            with contextlib.suppress(Exception):
                close()
        if self._server is not None:
            self._server.stop()


pass_state = click.make_pass_decorator(CliState)


@click.group()
@click.option(
    "--redis-url",
    envvar="ZERDA_REDIS_URL",
    default=None,
    help="redis://, rediss:// or unix:// URL (env ZERDA_REDIS_URL).",
)
@click.option("--cluster", is_flag=True, help="The URL is a Redis Cluster node.")
@click.option("--key-prefix", default=CacheConfig().key_prefix, show_default=True)
@click.option("--log-level", envvar="ZERDA_LOG_LEVEL", default="WARNING", show_default=True)
@click.pass_context
def cli(
    ctx: click.Context, redis_url: str | None, cluster: bool, key_prefix: str, log_level: str
) -> None:
    """zerda-cache: a shared semantic cache that learns which answers to serve."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    state = CliState(url=redis_url, cluster=cluster, key_prefix=key_prefix)
    ctx.obj = state
    ctx.call_on_close(state.close)


@contextlib.contextmanager
def errors() -> Iterator[None]:
    try:
        yield
    except EntryNotFoundError as exc:
        err.print(f"[red]{exc}[/red]")
        sys.exit(1)
    except (ZerdaError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(2)


# -- worker -------------------------------------------------------------------------------------
@cli.command()
@click.option("--metrics-port", type=int, default=9108, show_default=True)
@click.option("--metrics-host", default="0.0.0.0", show_default=True)
@click.option("--lease-ttl", type=float, default=15.0, show_default=True)
@click.option("--decay-interval", type=float, default=None, help="Seconds between decay cycles.")
@click.option("--eviction-interval", type=float, default=None)
@click.option("--metrics-interval", type=float, default=None)
@click.option("--max-entries", type=int, default=None, help="Default capacity per tenant.")
@click.option("--health-file", default="/tmp/zerda-cache-worker.health", show_default=True)
@click.option("--worker-id", default=None)
@click.option("--check", is_flag=True, help="Liveness probe: exit 0 if this worker is alive.")
@pass_state
def worker(state: CliState, /, **opts: Any) -> None:
    """Run the eviction/decay/metrics worker (one leads, the others stand by)."""
    from zerda_cache.worker import main

    argv = ["--key-prefix", state.key_prefix]
    if state.url:
        argv += ["--redis-url", state.url]
    if state.cluster:
        argv.append("--cluster")
    for name, value in opts.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, str(value)]
    if state.url is None and not opts["check"]:
        state.storage()  # starts the embedded server
        argv += ["--redis-url", state._server.url]
    sys.exit(main(argv))


# -- stats and inspect ----------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@cli.command()
@click.option("--tenant", default=None, help="One tenant (default: all).")
@pass_state
def stats(state: CliState, tenant: str | None) -> None:
    """Counters, sizes and capacity per tenant; the worker's leader and last cycles."""
    with errors():
        st = state.storage()
        tenants = [tenant] if tenant else st.tenants()
        m = Maintenance(st)
        table = Table(title="zerda-cache tenants")
        for col in (
            "tenant",
            "entries",
            "capacity",
            "bytes",
            "hit rate",
            "hits",
            "misses",
            "puts",
            "+fb",
            "-fb",
            "evicted",
        ):
            table.add_column(col, justify="left" if col == "tenant" else "right")
        for t in tenants:
            s = st.stats(t)
            limits = m.limits(t)
            lookups = s.get("hits", 0) + s.get("misses", 0)
            evicted = sum(v for k, v in s.items() if k.startswith("evicted:"))
            table.add_row(
                t,
                f"{s.get('entries', 0):,}",
                f"{limits.max_entries:,}",
                _fmt_bytes(max(0, s.get("bytes", 0))),
                f"{s.get('hits', 0) / lookups:.1%}" if lookups else "-",
                f"{s.get('hits', 0):,}",
                f"{s.get('misses', 0):,}",
                f"{s.get('puts', 0):,}",
                f"{s.get('positive', 0):,}",
                f"{s.get('negative', 0):,}",
                f"{evicted:,}",
            )
        console.print(table)
        raw = st.client.get(leader_key(state.key_prefix))
        leader = raw.decode() if raw else "none"
        console.print(f"worker leader: [bold]{leader}[/bold]")
        for c in m.recent_cycles(6):
            if c.get("phase") == "end":
                console.print(
                    f"  {c['job']:>6} cycle by {c['worker']}: {c.get('outcome', '?')} in "
                    f"{float(c.get('seconds', 'nan')):.3f}s"
                )


@cli.command()
@click.argument("entry_id")
@click.option("--tenant", required=True)
@pass_state
def inspect(state: CliState, entry_id: str, tenant: str) -> None:
    """Show one entry: its question, answer, arm and usage."""
    with errors():
        st = state.storage()
        e = st.get_entry(tenant, entry_id, with_vector=False)
        now = st.now()
        arm = e.bandit_arm.at(now, st.config.rl)
        table = Table(show_header=False, title=f"entry {entry_id}")
        rows = [
            ("tenant", tenant),
            ("scope", e.scope or "(default)"),
            ("query", e.query),
            ("response", e.response if len(e.response) < 400 else e.response[:400] + "..."),
            ("metadata", str(e.metadata)),
            ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.created_at))),
            ("expires", "never" if math.isinf(e.expires_at) else f"in {e.expires_at - now:,.0f} s"),
            ("arm (now)", f"Beta({arm.alpha:.3f}, {arm.beta:.3f}), {arm.pulls} signals"),
            (
                "expected reward",
                f"{arm.expected_reward:.3f}"
                + (
                    "  [red](below the serving bar: not served)[/red]"
                    if arm.expected_reward < st.config.rl.serve_bar
                    else ""
                ),
            ),
            (
                "own similarity bar",
                f"{e.similarity_bar:.3f}" if e.similarity_bar > 0 else "none (not raised yet)",
            ),
            ("complaints in a row", str(e.negative_streak)),
            ("confidence", f"{e.confidence_score:.3f}"),
            ("uses", f"{e.usage_count:,}"),
            ("quality / similarity", f"{e.quality_score:.2f} / {e.similarity_score:.2f}"),
            ("size", _fmt_bytes(e.size_bytes)),
        ]
        for k, v in rows:
            table.add_row(k, v)
        console.print(table)


# -- evict ----------------------------------------------------------------------------------------
@cli.command()
@click.option("--tenant", default=None, help="One tenant (default: all).")
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@pass_state
def evict(state: CliState, tenant: str | None, dry_run: bool) -> None:
    """Run one eviction pass now (or plan it with --dry-run)."""
    with errors():
        st = state.storage()
        m = Maintenance(st)
        tenants = [tenant] if tenant else st.tenants()
        table = Table(title="eviction" + (" (dry run)" if dry_run else ""))
        for col in (
            "tenant",
            "entries",
            "capacity",
            "expired",
            "corrupt",
            "low reward",
            "capacity evictions",
            "removed",
        ):
            table.add_column(col, justify="left" if col == "tenant" else "right")
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as progress:
            for t in tenants:
                task = progress.add_task(f"scanning {t}", total=st.count(t))

                def advance(n: int, task: Any = task) -> None:
                    progress.advance(task, n)

                plan = m.plan_eviction(t, progress=advance)
                counts = plan.counts()
                removed = "-" if dry_run else str(sum(m.execute(plan).removed.values()))
                table.add_row(
                    t,
                    f"{plan.scanned:,}",
                    f"{plan.limits.max_entries:,}",
                    *(f"{counts[k]:,}" for k in ("expired", "corrupt", "low_reward", "capacity")),
                    removed,
                )
        console.print(table)


# -- tenant settings ------------------------------------------------------------------------------
@cli.group()
def tenant() -> None:
    """Per-tenant capacity and TTL, stored in Redis (the worker and puts read them)."""


@tenant.command("set")
@click.argument("name")
@click.option("--max-entries", type=int, default=None)
@click.option("--max-bytes", type=int, default=None)
@click.option("--ttl", type=float, default=None, help="Default TTL (s) of the tenant's puts.")
@click.option(
    "--clear",
    "clear_",
    multiple=True,
    type=click.Choice(["max_entries", "max_bytes", "ttl"]),
    help="Remove an override (repeatable).",
)
@pass_state
def tenant_set(
    state: CliState,
    name: str,
    max_entries: int | None,
    max_bytes: int | None,
    ttl: float | None,
    clear_: tuple[str, ...],
) -> None:
    """Set or clear a tenant's overrides."""
    with errors():
        settings: dict[str, float | None] = {k: None for k in clear_}
        for key, value in (("max_entries", max_entries), ("max_bytes", max_bytes), ("ttl", ttl)):
            if value is not None:
                settings[key] = value
        if not settings:
            raise click.UsageError(
                "nothing to set: give --max-entries, --max-bytes, --ttl or --clear"
            )
        state.storage().set_tenant_settings(name, **settings)
        _show_tenant(state, name)


@tenant.command("show")
@click.argument("name")
@pass_state
def tenant_show(state: CliState, name: str) -> None:
    """Show a tenant's effective capacity and TTL."""
    with errors():
        _show_tenant(state, name)


def _show_tenant(state: CliState, name: str) -> None:
    st = state.storage()
    settings = st.tenant_settings(name)
    limits = Maintenance(st).limits(name)
    default_ttl = st.config.default_ttl_s
    table = Table(title=f"tenant {name}", show_header=False)
    table.add_row(
        "max entries",
        f"{limits.max_entries:,}" + ("" if "max_entries" in settings else " (default)"),
    )
    table.add_row(
        "max bytes",
        "none"
        if limits.max_bytes is None
        else _fmt_bytes(limits.max_bytes) + ("" if "max_bytes" in settings else " (default)"),
    )
    ttl = settings.get("ttl", default_ttl)
    table.add_row(
        "default ttl",
        "none" if ttl is None else f"{ttl:,.0f} s" + ("" if "ttl" in settings else " (default)"),
    )
    table.add_row("dimension", str(int(settings["dim"])) if "dim" in settings else "not set yet")
    table.add_row("entries", f"{st.count(name):,}")
    console.print(table)


# -- demo -----------------------------------------------------------------------------------------
@cli.command()
@click.option("--short", is_flag=True, help="A quick run (for tests).")
@click.option("--out", default="out/demo", show_default=True, help="Report and chart folder.")
@click.option("--replicas", type=int, default=3, show_default=True)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option(
    "--embedder",
    type=click.Choice(["hashing", "minilm"]),
    default="hashing",
    show_default=True,
    help="minilm: all-MiniLM-L6-v2 offline (make minilm).",
)
@pass_state
def demo(state: CliState, short: bool, out: str, replicas: int, seed: int, embedder: str) -> None:
    """The whole system on a FAQ workload: replicas, users, the worker, a learning curve."""
    from zerda_cache.demo import DemoOptions, run_demo

    opts = DemoOptions(short=short, out_dir=out, replicas=replicas, seed=seed, embedder=embedder)
    if state.url:
        opts = replace(opts, redis_url=state.url)
    sys.exit(run_demo(opts, console=console))


@cli.command("demo-app")
@click.option("--metrics-port", type=int, default=9109, show_default=True)
@click.option("--rate", type=float, default=5.0, show_default=True, help="Questions per second.")
@click.option("--seed", type=int, default=7, show_default=True)
@pass_state
def demo_app(state: CliState, metrics_port: int, rate: float, seed: int) -> None:
    """A long-running demo app replica (FAQ questions, simulated users) with /metrics."""
    from zerda_cache.demo import serve_app

    if state.url is None:
        raise click.UsageError("demo-app needs --redis-url or ZERDA_REDIS_URL")
    sys.exit(serve_app(state.url, metrics_port=metrics_port, rate=rate, seed=seed))


def main() -> None:
    cli(prog_name="zerda-cache")


if __name__ == "__main__":
    main()
