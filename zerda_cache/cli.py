"""``zerda-cache``: the operator's command line (the only CLI: the worker's entry point in
``workers/`` runs its ``worker`` command).

Every command takes ``--redis-url`` (or ``ZERDA_REDIS_URL``), ``--cluster``,
``--key-prefix`` and ``--log-level``, before or after the command's name; without a URL,
the commands that need a server refuse (only ``demo`` starts a server of its own).
Logging is configured here and nowhere else in the package: WARNING by default, INFO for
the worker and ``serve`` (APScheduler's own loggers stay at WARNING unless DEBUG is asked
for: they log every job run).

Exit codes (``EXIT_CODES``, printed by ``--help``): 0 ok; 1 not found (an entry, a
tenant) or unhealthy; 2 bad usage or bad input; 3 Redis unreachable or a Redis call
failed; 4 an import refused some lines (the others were imported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import click
import redis.exceptions
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from zerda_cache import __version__
from zerda_cache.core.config import (
    DEFAULT_HEALTH_FILE,
    DEFAULT_KEY_PREFIX,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_METRICS_HOST,
    DEFAULT_METRICS_PORT,
    CacheConfig,
    load_rl_config,
)
from zerda_cache.core.entry import BanditArm, IntelligentCacheEntry
from zerda_cache.core.errors import EntryNotFoundError, StorageError, ZerdaError
from zerda_cache.core.savings import from_stats, prices_of
from zerda_cache.learning.calibration import Serving, exact_level
from zerda_cache.learning.match_model import FEATURES
from zerda_cache.learning.tenant_policy import POLICY_FIELDS, TenantPolicy, flatten
from zerda_cache.learning.tenant_state import TenantState
from zerda_cache.storage import RedisStorage, connect
from zerda_cache.storage.reports import REPORT_TTL_S, ProcessReport, said
from zerda_cache.worker.maintenance import Maintenance

# Piped output (a file, grep, a CI log) is not cut to 80 columns as rich does by default.
console = Console(width=None if sys.stdout.isatty() else 240)
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Exit codes of every command (printed by ``--help``: the group's epilog; listed in
#: docs/worker.md too).
EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_REDIS, EXIT_REFUSED = 0, 1, 2, 3, 4
EXIT_CODES = (
    "Exit codes: 0 ok; 1 not found (an entry, a tenant) or unhealthy; 2 bad usage or bad "
    "input; 3 Redis unreachable or a Redis call failed; 4 an import refused some lines "
    "(the others were imported)."
)

#: Loggers too chatty at INFO: APScheduler logs every job it adds and runs (the worker's
#: lease job runs every few seconds). They stay at WARNING unless DEBUG is asked for.
QUIET_LOGGERS = ("apscheduler",)


def configure_logging(level: str) -> None:
    """The process's logging: ``level`` for zerda-cache, WARNING for ``QUIET_LOGGERS``
    unless ``level`` is DEBUG."""
    level = level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
    quiet = logging.DEBUG if level == "DEBUG" else logging.WARNING
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


@dataclass
class CliState:
    """Shared options, and a connection made on first use."""

    url: str | None
    cluster: bool
    key_prefix: str
    log_level: str | None = None
    rl_config: str | None = None
    _storage: RedisStorage | None = None
    _opened: list[RedisStorage] = field(default_factory=list)

    @property
    def config(self) -> CacheConfig:
        if self.rl_config is None:
            return CacheConfig(key_prefix=self.key_prefix)
        return CacheConfig(key_prefix=self.key_prefix, rl=load_rl_config(self.rl_config))

    def configure_logging(self, default: str) -> None:
        configure_logging(self.log_level or default)

    def server_url(self) -> str:
        """The URL to use. Without one, commands refuse: an embedded server would be
        empty and gone on exit, and writing settings there looked like success (only
        ``demo`` starts one)."""
        if self.url is None:
            raise click.UsageError(
                "no Redis URL: pass --redis-url or set ZERDA_REDIS_URL "
                "(only `zerda-cache demo` starts a server of its own)"
            )
        return self.url

    def client(self, config: CacheConfig | None = None) -> Any:
        """A new sync client with zerda-cache's timeouts (closed on exit)."""
        return self._connect(config if config is not None else self.config).client

    def storage(self) -> RedisStorage:
        if self._storage is None:
            self._storage = self._connect(self.config)
        return self._storage

    def _connect(self, config: CacheConfig) -> RedisStorage:
        client = connect(self.server_url(), config, cluster=self.cluster or None)
        storage = RedisStorage(client, config)
        self._opened.append(storage)
        return storage

    def close(self) -> None:
        for storage in self._opened:
            with contextlib.suppress(Exception):
                storage.close()


pass_state = click.make_pass_decorator(CliState)


def _set_state(attr: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None or value is False:
            return  # not given after the command's name: the group's value stands
        state = ctx.find_object(CliState)
        assert state is not None
        setattr(state, attr, value)
        if attr == "log_level":
            state.configure_logging(value)

    return callback


#: The options every command takes, before or after its name: (flag, attribute, is_flag,
#: help). The group reads the environment; after a command's name they override it.
SHARED_OPTIONS: tuple[tuple[str, str, bool, str], ...] = (
    (
        "--redis-url",
        "url",
        False,
        "redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// URL of the "
        "server (env ZERDA_REDIS_URL).",
    ),
    ("--cluster", "cluster", True, "The URL is a node of a Redis Cluster."),
    (
        "--key-prefix",
        "key_prefix",
        False,
        f"Prefix of every key zerda-cache writes (default {DEFAULT_KEY_PREFIX}).",
    ),
    (
        "--log-level",
        "log_level",
        False,
        "DEBUG, INFO, WARNING or ERROR; default WARNING, INFO for worker and serve "
        "(env ZERDA_LOG_LEVEL).",
    ),
    (
        "--rl-config",
        "rl_config",
        False,
        "A TOML or JSON file of RLConfig fields: the app replicas' policy, for the worker "
        "and the admin commands (env ZERDA_RL_CONFIG).",
    ),
)
_ENVVARS = {
    "url": "ZERDA_REDIS_URL",
    "log_level": "ZERDA_LOG_LEVEL",
    "rl_config": "ZERDA_RL_CONFIG",
}


def shared_options(command: F) -> F:
    """The group's options, accepted after a command's name too (``zerda-cache worker
    --redis-url ...``, as ``workers/eviction_worker.py`` passes them), with the same help
    text as on the group."""
    for name, attr, flag, help_text in reversed(SHARED_OPTIONS):
        command = click.option(
            name,
            attr + "_",
            is_flag=flag,
            default=False if flag else None,
            expose_value=False,
            callback=_set_state(attr),
            help=help_text,
        )(command)
    return command


def _group_options(command: F) -> F:
    """The shared options on the group itself, read from the environment too."""
    for name, attr, flag, help_text in reversed(SHARED_OPTIONS):
        if flag:
            command = click.option(name, attr, is_flag=True, help=help_text)(command)
        else:
            command = click.option(
                name,
                attr,
                envvar=_ENVVARS.get(attr),
                default=DEFAULT_KEY_PREFIX if attr == "key_prefix" else None,
                help=help_text,
            )(command)
    return command


@click.group(epilog=EXIT_CODES)
@click.version_option(__version__, "--version", prog_name="zerda-cache")
@_group_options
@click.pass_context
def cli(
    ctx: click.Context,
    url: str | None,
    cluster: bool,
    key_prefix: str,
    log_level: str | None,
    rl_config: str | None,
) -> None:
    """zerda-cache: a shared semantic cache that learns which answers to serve.

    Every command takes the options below before or after its name. Read commands take
    --json.
    """
    state = CliState(url, cluster, key_prefix, log_level, rl_config)
    state.configure_logging("INFO" if ctx.invoked_subcommand in ("worker", "serve") else "WARNING")
    ctx.obj = state
    ctx.call_on_close(state.close)


#: Errors of the server or the connection to it, as redis-py raises them where
#: zerda-cache's storage does not wrap them (connecting to a cluster, a sentinel).
REDIS_FAILURES = (StorageError, redis.exceptions.RedisError, redis.exceptions.RedisClusterException)


@contextlib.contextmanager
def errors() -> Iterator[None]:
    """Known failures as one line on stderr and their exit code (``EXIT_CODES``)."""
    try:
        yield
    except EntryNotFoundError as exc:
        err.print(f"[red]{exc}[/red]")
        sys.exit(EXIT_NOT_FOUND)
    except REDIS_FAILURES as exc:
        detail = " ".join(str(exc).split())
        if len(detail) > 300:
            detail = detail[:297] + "..."
        err.print(f"[red]error:[/red] Redis unreachable or failing: {detail}", soft_wrap=True)
        sys.exit(EXIT_REDIS)
    except (ZerdaError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(EXIT_USAGE)


# -- worker -------------------------------------------------------------------------------------
@cli.command()
@shared_options
@click.option(
    "--metrics-port",
    type=int,
    default=DEFAULT_METRICS_PORT,
    show_default=True,
    help="Serve /metrics here; 0: any free port.",
)
@click.option("--metrics-host", default=DEFAULT_METRICS_HOST, show_default=True)
@click.option("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL_S, show_default=True)
@click.option(
    "--decay-job-interval", type=float, default=None, help="Seconds between decay cycles."
)
@click.option("--eviction-interval", type=float, default=None)
@click.option("--metrics-interval", type=float, default=None)
@click.option(
    "--full-scan-interval",
    type=float,
    default=None,
    help="Scan a tenant within its capacity whole at least this often (s; default 3600); "
    "in between, eviction reads only its expired ids and arms with evidence.",
)
@click.option(
    "--snapshot-min-entries",
    type=int,
    default=None,
    help="Publish index snapshots of tenants this large, for new replicas to load "
    "(default 50000; 0: none).",
)
@click.option("--snapshot-interval", type=float, default=None, help="Seconds between checks.")
@click.option(
    "--snapshot-ef-construction",
    type=int,
    default=None,
    help="HNSW construction width of the snapshots' graphs (default 256; replicas build "
    "their own at ann_ef_construction, 128).",
)
@click.option("--max-entries", type=int, default=None, help="Default capacity per tenant.")
@click.option("--health-file", default=DEFAULT_HEALTH_FILE, show_default=True)
@click.option("--worker-id", default=None)
@click.option("--check", is_flag=True, help="Liveness probe: exit 0 if this worker is alive.")
@pass_state
def worker(
    state: CliState,
    /,
    metrics_port: int,
    metrics_host: str,
    lease_ttl: float,
    decay_job_interval: float | None,
    eviction_interval: float | None,
    metrics_interval: float | None,
    full_scan_interval: float | None,
    snapshot_min_entries: int | None,
    snapshot_interval: float | None,
    snapshot_ef_construction: int | None,
    max_entries: int | None,
    health_file: str,
    worker_id: str | None,
    check: bool,
) -> None:
    """Run the eviction/decay/metrics worker (one leads, the others stand by)."""
    from zerda_cache.worker.scheduler import Worker, health_problem

    if check:
        problem = health_problem(health_file, max_age_s=lease_ttl)
        click.echo("healthy" if problem is None else f"unhealthy: {problem}")
        sys.exit(0 if problem is None else 1)
    with errors():
        cfg = state.config
        changes: dict[str, Any] = {
            name: value
            for name, value in (
                ("decay_job_interval_s", decay_job_interval),
                ("eviction_interval_s", eviction_interval),
                ("metrics_interval_s", metrics_interval),
                ("full_scan_interval_s", full_scan_interval),
                ("snapshot_min_entries", snapshot_min_entries),
                ("snapshot_interval_s", snapshot_interval),
                ("snapshot_ef_construction", snapshot_ef_construction),
                ("max_entries", max_entries),
            )
            if value is not None
        }
        cfg = replace(cfg, eviction=replace(cfg.eviction, **changes))
        w = Worker(
            state.client(cfg),
            cfg,
            lease_ttl_s=lease_ttl,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            health_file=health_file,
            worker_id=worker_id,
        )
    w.install_signal_handlers()
    w.run()


# -- stats and inspect ----------------------------------------------------------------------------
def json_option(command: F) -> F:
    """``--json``: print the command's data as JSON instead of a table."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(
        command
    )


#: ``--tenant`` of the commands about one tenant.
tenant_option = click.option("--tenant", required=True)
#: ``--tenant`` of the commands about every tenant, or the one it names.
any_tenant_option = click.option("--tenant", default=None, help="One tenant (default: all).")


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float | int):
        return value
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


def _table(title: str, *columns: Sequence[str], left: Collection[str] = ("tenant",)) -> Table:
    """A table of ``columns`` (given in groups, as they read), the figures right-aligned
    and the columns named in ``left`` left-aligned."""
    table = Table(title=title)
    for col in (c for group in columns for c in group):
        table.add_column(col, justify="left" if col in left else "right")
    return table


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


#: The prices of the savings, for ``serve`` and ``stats`` alike (``with_prices`` reads them).
token_prices_option = click.option(
    "--token-prices",
    type=click.Path(exists=True, dir_okay=False),
    envvar="ZERDA_TOKEN_PRICES",
    default=None,
    help="A JSON file of US dollars per million tokens, {model: [prompt, completion]}, "
    "over the default table, for the savings (env ZERDA_TOKEN_PRICES).",
)


@cli.command()
@shared_options
@any_tenant_option
@json_option
@token_prices_option
@pass_state
def stats(state: CliState, tenant: str | None, as_json: bool, token_prices: str | None) -> None:
    """Counters, sizes and capacity per tenant (savings in dollars at the prices of
    ``--token-prices``, as ``serve`` takes them); the worker's leader and last cycles."""
    with errors():
        st = state.storage()
        tenants = [tenant] if tenant else st.tenants()
        m = Maintenance(st)
        cfg = with_prices(state.config, token_prices)
        prices = prices_of(cfg)
        if as_json:
            rows = []
            for t in tenants:
                s = st.stats(t)
                lookups = s.get("hits", 0) + s.get("misses", 0)
                saved = from_stats(s, prices)
                rows.append(
                    {
                        "tenant": t,
                        "capacity": m.limits(t).max_entries,
                        "hit_rate": s.get("hits", 0) / lookups if lookups else None,
                        **{k: v for k, v in s.items() if not k.startswith(("saved:", "wrong:"))},
                        "savings": {model: v.as_dict() for model, v in saved.items()},
                    }
                )
            cycles = [c for c in m.recent_cycles(6) if c.get("phase") == "end"]
            _print_json({"tenants": rows, "leader": st.leader(), "cycles": cycles})
            return
        table = _table(
            "zerda-cache tenants",
            ("tenant", "entries", "capacity", "bytes", "hit rate", "hits", "misses", "puts"),
            ("+fb", "-fb", "evicted"),
        )
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
        for t in tenants:
            total = from_stats(st.stats(t), prices).get("*")
            if total is not None:
                console.print(
                    f"{t}: hits saved {total.calls:,} LLM calls "
                    f"({total.prompt_tokens + total.completion_tokens:,} tokens, "
                    f"${total.usd:,.2f}); {total.wrong_calls:,} judged wrong "
                    f"(${total.wrong_usd:,.2f}); net ${total.net_usd:,.2f}"
                )
        console.print(f"worker leader: [bold]{st.leader() or 'none'}[/bold]")
        for c in m.recent_cycles(6):
            if c.get("phase") == "end":
                console.print(
                    f"  {c['job']:>6} cycle by {c['worker']}: {c.get('outcome', '?')} in "
                    f"{float(c.get('seconds', 'nan')):.3f}s"
                )


def _entry_json(
    e: IntelligentCacheEntry, entry_id: str, tenant: str, arm: BanditArm, serve_bar: float
) -> dict[str, Any]:
    """``inspect --json``: an entry as stored, its arm at now."""
    return {
        "entry_id": entry_id,
        "tenant": tenant,
        "scope": e.scope,
        "query": e.query,
        "response": e.response,
        "metadata": e.metadata,
        "created_at": e.created_at,
        "expires_at": None if math.isinf(e.expires_at) else e.expires_at,
        "alpha": arm.alpha,
        "beta": arm.beta,
        "signals": arm.pulls,
        "expected_reward": arm.expected_reward,
        "served": arm.expected_reward >= serve_bar,
        "similarity_bar": e.similarity_bar,
        "negative_streak": e.negative_streak,
        "confidence": e.confidence_score,
        "uses": e.usage_count,
        "quality": e.quality_score,
        "similarity_score": e.similarity_score,
        "size_bytes": e.size_bytes,
        "tags": list(e.tags),
        "usage": None
        if e.usage is None
        else {
            "model": e.usage.model,
            "prompt_tokens": e.usage.prompt_tokens,
            "completion_tokens": e.usage.completion_tokens,
        },
    }


@cli.command()
@shared_options
@click.argument("entry_id")
@tenant_option
@json_option
@pass_state
def inspect(state: CliState, entry_id: str, tenant: str, as_json: bool) -> None:
    """Show one entry: its question, answer, arm and usage (ids: ``entries list``)."""
    with errors():
        st = state.storage()
        e = st.get_entry(tenant, entry_id, with_vector=False)
        now = st.now()
        rl = TenantState(st).policy(tenant).rl  # the tenant's decay and serving bar
        arm = e.bandit_arm.at(now, rl)
        if as_json:
            _print_json(_entry_json(e, entry_id, tenant, arm, rl.serve_bar))
            return
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
                    if arm.expected_reward < rl.serve_bar
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
            ("tags", ", ".join(e.tags) or "none"),
            (
                "cost upstream",
                "not given"
                if e.usage is None
                else f"{e.usage.model}: {e.usage.prompt_tokens:,} prompt + "
                f"{e.usage.completion_tokens:,} completion tokens (what each hit saves)",
            ),
        ]
        for k, v in rows:
            table.add_row(k, v)
        console.print(table)


@cli.group()
def entries() -> None:
    """The entries of a tenant (their ids feed ``inspect``)."""


@entries.command("list")
@shared_options
@tenant_option
@click.option(
    "--limit", type=click.IntRange(min=1), default=50, show_default=True, help="At most this many."
)
@json_option
@pass_state
def entries_list(state: CliState, tenant: str, limit: int, as_json: bool) -> None:
    """List a tenant's entries: id, question, expected reward, uses, expiry (in no order;
    a ZSCAN of the live ids)."""
    from zerda_cache.core.errors import CorruptEntryError, EntryNotFoundError

    with errors():
        st = state.storage()
        now = st.now()
        rl = TenantState(st).policy(tenant).rl
        rows: list[dict[str, Any]] = []
        for batch in st.iter_ids(tenant):
            for eid, expires in batch:
                if len(rows) == limit:
                    break
                try:
                    e = st.get_entry(tenant, eid, with_vector=False)
                except EntryNotFoundError:
                    continue  # removed since the scan saw it
                except CorruptEntryError as exc:
                    rows.append({"entry_id": eid, "error": str(exc)})
                    continue
                arm = e.bandit_arm.at(now, rl)
                rows.append(
                    {
                        "entry_id": eid,
                        "scope": e.scope,
                        "query": e.query,
                        "expected_reward": arm.expected_reward,
                        "signals": arm.pulls,
                        "uses": e.usage_count,
                        "expires_at": None if math.isinf(expires) else expires,
                    }
                )
            if len(rows) == limit:
                break
        total = st.count(tenant)
        if as_json:
            _print_json({"tenant": tenant, "entries": rows, "total": total})
            return
        table = _table(
            f"tenant {tenant}: {len(rows):,} of {total:,} entries",
            ("entry id", "question", "reward", "signals", "uses", "expires"),
            left=("entry id", "question"),
        )
        for r in rows:
            if "error" in r:
                table.add_row(r["entry_id"], f"[red]{r['error']}[/red]", "", "", "", "")
                continue
            q = r["query"] if len(r["query"]) <= 60 else r["query"][:57] + "..."
            exp = r["expires_at"]
            table.add_row(
                r["entry_id"],
                q,
                f"{r['expected_reward']:.3f}",
                str(r["signals"]),
                f"{r['uses']:,}",
                "never" if exp is None else f"in {exp - now:,.0f} s",
            )
        console.print(table)


# -- tags -----------------------------------------------------------------------------------------
@cli.group()
def tags() -> None:
    """The tags of a tenant's entries (put(..., tags=[...])) and their invalidation."""


@tags.command("list")
@shared_options
@tenant_option
@json_option
@pass_state
def tags_list(state: CliState, tenant: str, as_json: bool) -> None:
    """List a tenant's tags and how many ids each one's set holds (the ids of removed
    entries among them until the worker's next sweep)."""
    with errors():
        found = state.storage().tags(tenant)
        if as_json:
            _print_json({"tenant": tenant, "tags": found})
            return
        table = Table(title=f"tenant {tenant}: {len(found):,} tags")
        table.add_column("tag")
        table.add_column("entries", justify="right")
        for name, n in found.items():
            table.add_row(name, f"{n:,}")
        console.print(table)


@tags.command("invalidate")
@shared_options
@tenant_option
@click.argument("tag")
@json_option
@pass_state
def tags_invalidate(state: CliState, tenant: str, tag: str, as_json: bool) -> None:
    """Remove every entry of TENANT put with TAG, from every replica (one call, through
    the tag's index: never a scan of the tenant)."""
    with errors():
        removed = state.storage().invalidate_tag(tenant, tag)
        if as_json:
            _print_json({"tenant": tenant, "tag": tag, "removed": removed})
            return
        console.print(f"removed {removed:,} entries tagged {tag!r} from tenant {tenant}")


# -- export and import ----------------------------------------------------------------------------
def _progress(disable: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=disable,
    )


@cli.command("export")
@shared_options
@tenant_option
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default="-",
    show_default=True,
    help="The file to write ('-': standard output).",
)
@pass_state
def export_cmd(state: CliState, tenant: str, output: str) -> None:
    """Write a tenant's live entries as JSON lines (answers, vectors, arms, uses, expiry
    and tags: the import brings them back as they were). Progress goes to stderr."""
    from zerda_cache.flows.transfer import export_tenant

    with errors():
        st = state.storage()
        with (
            click.open_file(output, "w", encoding="utf-8") as out,
            _progress(disable=False) as progress,
        ):
            task = progress.add_task(f"exporting {tenant}", total=st.count(tenant))

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            def left_out(entry_id: str, why: str) -> None:
                corrupt.append(entry_id)
                err.print(f"[yellow]warning:[/yellow] left out {escape(why)}", soft_wrap=True)

            corrupt: list[str] = []
            gone: list[str] = []
            written = export_tenant(
                st, tenant, out, progress=advance, corrupt=left_out, gone=gone.append
            )
        err.print(f"exported {written:,} entries of tenant {tenant}")
        if gone:
            err.print(f"{len(gone):,} entries were removed while the export ran (not exported)")
        if corrupt:
            err.print(
                f"left out {len(corrupt):,} corrupt entries (reported: the worker evicts "
                "them; `zerda-cache evict --tenant` does now)"
            )


@cli.command("import")
@shared_options
@click.option("--tenant", required=True, help="The tenant to import into (any name).")
@click.argument("source", type=click.Path(dir_okay=False, allow_dash=True))
@json_option
@pass_state
def import_cmd(state: CliState, tenant: str, source: str, as_json: bool) -> None:
    """Write the entries of an export (SOURCE, '-' for standard input) into TENANT. An id
    already there is skipped, so an import run again resumes where it stopped. Each line
    is checked as a put checks its input (the configuration's size limits included);
    lines that do not check out are refused, listed with their line numbers, and
    nothing of them is written: the exit code is then 4. A file whose header is not an
    export's, or of another dimension than the tenant's, is refused whole (exit 2)."""
    from zerda_cache.flows.transfer import ImportReport, import_tenant

    with errors():
        st = state.storage()
        with click.open_file(source, "r", encoding="utf-8") as lines, _progress(as_json) as bar:
            task = bar.add_task(f"importing into {tenant}", total=None)

            def advance(report: ImportReport) -> None:
                bar.update(task, completed=report.stored + report.skipped)

            report = import_tenant(st, tenant, lines, progress=advance)
        summary = {
            "tenant": tenant,
            "stored": report.stored,
            "skipped": report.skipped,
            "expired": report.expired,
            "refused": [{"line": n, "why": why} for n, why in report.refused],
        }
        if as_json:
            _print_json(summary)
        else:
            console.print(
                f"imported into {tenant}: {report.stored:,} stored, {report.skipped:,} "
                f"already there, {report.expired:,} expired, {len(report.refused):,} refused"
            )
            for n, why in report.refused[:20]:
                console.print(f"  line {n}: {escape(why)}", soft_wrap=True)
            if len(report.refused) > 20:
                console.print(f"  ... and {len(report.refused) - 20:,} more (--json lists all)")
    if report.refused:
        sys.exit(EXIT_REFUSED)


# -- evict ----------------------------------------------------------------------------------------
@cli.command()
@shared_options
@any_tenant_option
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@json_option
@pass_state
def evict(state: CliState, tenant: str | None, dry_run: bool, as_json: bool) -> None:
    """Run one eviction pass now (or plan it with --dry-run). Per tenant: entries scanned,
    capacity, the entries planned for removal by reason (expired, corrupt, low reward,
    over capacity) and those removed."""
    with errors():
        st = state.storage()
        m = Maintenance(st)
        tenants = [tenant] if tenant else st.tenants()
        rows: list[dict[str, Any]] = []
        with _progress(disable=as_json) as progress:
            for t in tenants:
                task = progress.add_task(f"scanning {t}", total=st.count(t))

                def advance(n: int, task: Any = task) -> None:
                    progress.advance(task, n)

                plan = m.plan_eviction(t, progress=advance)
                rows.append(
                    {
                        "tenant": t,
                        "entries": plan.scanned,
                        "capacity": plan.limits.max_entries,
                        "planned": plan.counts(),
                        "removed": None if dry_run else sum(m.execute(plan).removed.values()),
                    }
                )
        if as_json:
            _print_json({"dry_run": dry_run, "tenants": rows})
            return
        table = _table(
            "eviction" + (" (dry run)" if dry_run else ""),
            ("tenant", "entries", "capacity", "expired", "corrupt", "low reward"),
            ("capacity evictions", "removed"),
        )
        for r in rows:
            table.add_row(
                r["tenant"],
                f"{r['entries']:,}",
                f"{r['capacity']:,}",
                *(f"{r['planned'][k]:,}" for k in ("expired", "corrupt", "low_reward", "capacity")),
                "-" if r["removed"] is None else str(r["removed"]),
            )
        console.print(table)


# -- tenant settings ------------------------------------------------------------------------------
@cli.group()
def tenant() -> None:
    """A tenant's policy, stored in Redis: capacity, TTL, error bound, serving settings and
    bandit parameters. Every replica and worker applies a change within its
    policy_refresh_s, without a restart."""


def _setting_names() -> str:
    return ", ".join(sorted(POLICY_FIELDS))


@tenant.command("set")
@shared_options
@click.argument("name")
@click.option("--max-entries", type=int, default=None)
@click.option("--max-bytes", type=int, default=None)
@click.option("--ttl", type=float, default=None, help="Default TTL (s) of the tenant's puts.")
@click.option(
    "--max-error-rate",
    type=float,
    default=None,
    help="Error bound in (0, 1): serve near matches only where they were wrong at most this often.",
)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="SETTING=VALUE",
    help="Any setting, e.g. similarity_threshold=0.9 or rl.min_reward_to_serve=0.4 "
    "(repeatable; `zerda-cache tenant settings` lists them).",
)
@click.option(
    "--from-file",
    "from_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A TOML or JSON file of settings ([rl] and [eviction] tables for those sections).",
)
@click.option(
    "--clear",
    "clear_",
    multiple=True,
    metavar="SETTING",
    help="Remove an override: every process falls back to its own configuration (repeatable).",
)
@pass_state
def tenant_set(
    state: CliState,
    name: str,
    max_entries: int | None,
    max_bytes: int | None,
    ttl: float | None,
    max_error_rate: float | None,
    assignments: tuple[str, ...],
    from_file: str | None,
    clear_: tuple[str, ...],
) -> None:
    """Change a tenant's policy in one step (a new version; every replica and worker
    applies it within its policy_refresh_s)."""
    with errors():
        changes: dict[str, object] = {}
        if from_file is not None:
            changes.update(_read_settings_file(from_file))
        for key, value in (
            ("max_entries", max_entries),
            ("max_bytes", max_bytes),
            ("ttl", ttl),
            ("max_error_rate", max_error_rate),
        ):
            if value is not None:
                changes[key] = value
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise click.UsageError(f"--set takes SETTING=VALUE, got {item!r}")
            changes[key.strip()] = raw.strip()
        for key in clear_:
            changes[key] = None
        if not changes:
            raise click.UsageError(
                "nothing to set: give --max-entries, --max-bytes, --ttl, --max-error-rate, "
                "--set SETTING=VALUE, --from-file or --clear"
            )
        unknown = sorted(set(changes) - set(POLICY_FIELDS))
        if unknown:
            raise click.UsageError(f"unknown settings {unknown}; known: {_setting_names()}")
        state.storage().set_tenant_policy(name, changes)
        _show_tenant(state, name)


def _read_settings_file(path: str) -> dict[str, object]:
    import json
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = f.read()
        data = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode())
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"cannot read {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise click.UsageError(f"{path!r}: expected a table of settings")
    return flatten(data)


@tenant.command("settings")
@json_option
def tenant_settings_list(as_json: bool) -> None:
    """List the settings a tenant may store, with the library's defaults."""
    defaults = CacheConfig()
    rows = []
    for field_name, f in sorted(POLICY_FIELDS.items()):
        section = getattr(defaults, f.section) if f.section else defaults
        rows.append((field_name, f.kind.__name__, getattr(section, f.attr), f.doc))
    if as_json:
        _print_json([{"name": n, "type": t, "default": d, "about": a} for n, t, d, a in rows])
        return
    table = Table(title="tenant settings")
    for col in ("setting", "type", "default", "about"):
        table.add_column(col)
    for n, t, d, a in rows:
        table.add_row(n, t, "none" if d is None else str(d), a)
    console.print(table)


@tenant.command("show")
@shared_options
@click.argument("name")
@json_option
@pass_state
def tenant_show(state: CliState, name: str, as_json: bool) -> None:
    """Show a tenant's effective policy: its stored settings, and where it stored none,
    what the replicas and the worker that read its policy in the last minute report they
    apply (or their disagreement; this command's defaults when none reported). Exit 1
    for a tenant that was never put to, configured or given an API key."""
    from zerda_cache.core.validation import validate_tenant

    with errors():
        validate_tenant(name)
        if not _tenant_known(state.storage(), name):
            err.print(
                f"[red]error:[/red] no tenant {name!r}: nothing was ever put to, configured "
                "or keyed for it (`zerda-cache stats` lists the tenants)"
            )
            sys.exit(EXIT_NOT_FOUND)
        _show_tenant(state, name, as_json)


def _tenant_known(st: RedisStorage, name: str) -> bool:
    """Whether ``name`` was ever put to, configured or given an API key: in the tenant
    registry, or with entries, stored settings or a key (the registry may have been
    evicted by an allkeys-* policy; the worker re-creates it)."""
    return (
        name in st.tenants()
        or st.count(name) > 0
        or bool(st.tenant_settings(name))
        or any(k.tenant == name for k in st.api_keys())
    )


def _exact_bar_text(bar: float | None) -> str:
    """What ``TenantPolicy.exact_bar`` means for the operator."""
    if bar is None or bar == 0.0:
        return "every servable entry (level 0 up)"
    if bar > 1.0:
        return "no entry yet (every exact repeat is verified)"
    return f"entries with expected reward >= {bar:.2f} (level {exact_level(bar)} up)"


def _show_tenant(state: CliState, name: str, as_json: bool = False) -> None:
    st = state.storage()
    reports = st.settings_reports(name)
    policy = _as_applied(TenantState(st).policy(name), reports)
    if as_json:
        _print_json(_tenant_json(st, name, policy, reports))
    else:
        console.print(_tenant_table(st, name, policy, reports))


#: The settings ``tenant show`` leads with, and how it writes their values.
_LIMITS: dict[str, Callable[[Any], str]] = {
    "max_entries": lambda v: f"{v:,}",
    "max_bytes": lambda v: "none" if v is None else _fmt_bytes(v),
    "ttl": lambda v: "none" if v is None else f"{v:,.0f} s",
    "max_error_rate": lambda v: "none (no bound)" if v is None else f"{v:.2%}",
}


def _as_applied(policy: TenantPolicy, reports: Sequence[ProcessReport]) -> TenantPolicy:
    """``policy`` (this command's configuration with the tenant's stored settings) with
    each setting the tenant did not store as the processes that apply it reported it,
    where they agree (``storage/reports.py``): so that the bound, the per-serve ceiling
    and what they serve are the replicas', the capacity the worker's. Applied as the
    processes apply settings (``settings.apply_values``), each value on its own where
    they do not go together: a value no configuration takes (a report written by hand)
    leaves that setting this command's, and only it."""
    from zerda_cache.core.settings import apply_values

    reported: dict[str, Any] = {}
    for setting, f in POLICY_FIELDS.items():
        groups = said(reports, setting)
        if setting in policy.stored or len(groups) != 1:
            continue
        value = groups[0][0]
        try:  # reported as JSON: typed as a stored value would be
            reported[setting] = None if value is None else f.parse(value)
        except ValueError:
            continue
    if not reported:
        return policy
    config, _, _ = apply_values(policy.config, reported)
    return replace(policy, config=config)


def _applied_text(
    setting: str, value: Any, policy: TenantPolicy, reports: Sequence[ProcessReport]
) -> str:
    """A leading setting's value in ``tenant show``, and whose it is: stored for the
    tenant, the configuration of the processes that reported it (or their
    disagreement), or this command's default when none of them reported."""
    fmt = _LIMITS[setting]
    if setting in policy.stored:
        return fmt(value)
    who = "worker" if POLICY_FIELDS[setting].section == "eviction" else "replica"
    groups = said(reports, setting)
    if not groups:
        return f"{fmt(value)} (default: no {who} reported its settings)"
    if len(groups) == 1:
        return f"{fmt(groups[0][0])} (configuration of {_plural(len(groups[0][1]), who)})"
    each = ", ".join(f"{fmt(v)} ({_plural(len(procs), who)})" for v, procs in groups)
    return f"[yellow]{who}s disagree: {each}[/yellow]"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _reports_text(reports: Sequence[ProcessReport]) -> str:
    """Who reported the settings they apply to the tenant (``tenant show``)."""
    if not reports:
        return f"no replica or worker in the last {REPORT_TTL_S:.0f} s"
    roles = sorted({r.role for r in reports})
    return ", ".join(_plural(sum(r.role == role for r in reports), role) for role in roles)


def _tenant_json(
    st: RedisStorage, name: str, policy: TenantPolicy, reports: Sequence[ProcessReport]
) -> dict[str, Any]:
    """``tenant show --json``: the effective policy and what the tenant learnt; each
    setting the tenant did not store as the processes that apply it reported it."""
    settings = st.tenant_settings(name)
    cfg, ev, cal = policy.config, policy.eviction, policy.calibration
    threshold = policy.threshold()
    return {
        "tenant": name,
        "version": policy.version,
        "stored": dict(policy.stored),
        "rejected": dict(policy.rejected),
        "reports": [dataclasses.asdict(r) for r in reports],
        "applied": {
            setting: [{"value": v, "processes": procs} for v, procs in said(reports, setting)]
            for setting in sorted(POLICY_FIELDS)
        },
        "max_entries": ev.max_entries,
        "max_bytes": ev.max_bytes,
        "ttl": cfg.default_ttl_s,
        "max_error_rate": cfg.max_error_rate,
        "near_match_threshold": threshold,
        "exact_repeat_bar": policy.exact_bar(),
        "labels": cal.labels,
        "exact_repeat_labels": cal.exact_labels,
        "lookups_counted": cal.lookups,
        "match_model_version": cal.model_version,
        "wrong_per_request": (cal.wrong_per_request(threshold) if threshold is not None else None),
        "serving": _serving_json(policy),
        "dim": int(settings["dim"]) if "dim" in settings else None,
        "entries": st.count(name),
        "effective": {
            n: _effective(cfg, f.section, f.attr) for n, f in sorted(POLICY_FIELDS.items())
        },
    }


def _tenant_table(
    st: RedisStorage, name: str, policy: TenantPolicy, reports: Sequence[ProcessReport]
) -> Table:
    """``tenant show``: the limits (stored, or as the processes that apply them
    reported them), what the error bound serves, what the tenant learnt, the other
    stored settings and those left out."""
    settings = st.tenant_settings(name)
    cfg, ev, cal = policy.config, policy.eviction, policy.calibration

    def applied(setting: str, value: Any) -> str:
        return _applied_text(setting, value, policy, reports)

    table = Table(title=f"tenant {name} (policy version {policy.version})", show_header=False)
    table.add_row("settings reported by", _reports_text(reports))
    table.add_row("max entries", applied("max_entries", ev.max_entries))
    table.add_row("max bytes", applied("max_bytes", ev.max_bytes))
    table.add_row("default ttl", applied("ttl", cfg.default_ttl_s))
    table.add_row("max error rate", applied("max_error_rate", cfg.max_error_rate))
    serving = policy.serving()
    if serving is not None:
        _add_bound_rows(table, policy, serving)
    table.add_row(
        "labelled outcomes", f"{cal.labels:,.0f} near matches, {cal.exact_labels:,.0f} exact"
    )
    table.add_row("lookups counted", f"{cal.lookups:,.0f}")
    table.add_row(
        "match model",
        f"version {cal.model_version} ({', '.join(FEATURES[: len(cal.model.mu)])})"
        if cal.model is not None
        else "none yet (scores are similarities)",
    )
    shown = {"max_entries", "max_bytes", "ttl", "max_error_rate"}
    for setting in sorted(policy.stored):
        if setting not in shown:
            f = POLICY_FIELDS[setting]
            table.add_row(setting, f"{_effective(cfg, f.section, f.attr)}")
    for setting, why in sorted(policy.rejected.items()):
        table.add_row(setting, f"[red]left out: {why}[/red]")
    table.add_row("dimension", str(int(settings["dim"])) if "dim" in settings else "not set yet")
    table.add_row("entries", f"{st.count(name):,}")
    return table


def _serving_json(policy: TenantPolicy) -> dict[str, Any] | None:
    """``tenant show --json``: what the tenant serves under its bound, as its lookups
    apply it (``TenantPolicy.serving``); ``None`` without a bound."""
    serving = policy.serving()
    return None if serving is None else dataclasses.asdict(serving)


def _add_bound_rows(table: Table, policy: TenantPolicy, serving: Serving) -> None:
    """Under an error bound (``TenantPolicy.serving``): the score near matches are served
    from, the exact repeats served (the lowest level), and the estimate of wrong serves
    per request with its 95% bound (the one held under the error bound)."""
    threshold, bound = serving.threshold, serving.max_error_rate
    score = "similarity" if policy.calibration.model is None else "match score"
    table.add_row(
        "serves near matches from",
        f"{score} {threshold:.3f}"
        if threshold is not None
        else "nothing yet (near matches are verified)",
    )
    table.add_row("serves exact repeats of", _exact_bar_text(policy.exact_bar()))
    table.add_row(
        "wrong serves per request",
        f"{serving.estimated_error:.2%} estimated, {serving.error_bound:.2%} at 95% "
        f"(bound {bound:.2%})",
    )


def _effective(cfg: CacheConfig, section: str, attr: str) -> Any:
    return getattr(getattr(cfg, section) if section else cfg, attr)


# -- demo -----------------------------------------------------------------------------------------
@cli.command()
@shared_options
@click.option("--short", is_flag=True, help="A quick run: 8 s instead of 45.")
@click.option(
    "--duration",
    type=click.FloatRange(min=1.0),
    default=None,
    help="Seconds the replicas ask questions (default 45; 8 with --short).",
)
@click.option("--out", default="out/demo", show_default=True, help="Report and chart folder.")
@click.option("--replicas", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option(
    "--embedder",
    type=click.Choice(["hashing", "minilm"]),
    default="hashing",
    show_default=True,
    help="minilm: all-MiniLM-L6-v2 offline (pip install 'zerda-cache[minilm]').",
)
@pass_state
def demo(
    state: CliState,
    short: bool,
    duration: float | None,
    out: str,
    replicas: int,
    seed: int,
    embedder: str,
) -> None:
    """The whole system on a FAQ workload: replicas, users, the worker, a learning curve
    beside a plain threshold cache's. Without --redis-url it starts an embedded server
    (the embedded extra); the chart needs matplotlib (the demo extra)."""
    from zerda_cache.demo import DemoOptions, run_demo

    opts = DemoOptions(short=short, out_dir=out, replicas=replicas, seed=seed, embedder=embedder)
    if duration is not None:
        opts = replace(opts, duration_s=duration)
    if state.url:
        opts = replace(opts, redis_url=state.url)
    sys.exit(run_demo(opts, console=console))


@cli.command("demo-app")
@shared_options
@click.option("--metrics-port", type=int, default=9109, show_default=True)
@click.option("--rate", type=float, default=5.0, show_default=True, help="Questions per second.")
@click.option("--seed", type=int, default=7, show_default=True)
@pass_state
def demo_app(state: CliState, metrics_port: int, rate: float, seed: int) -> None:
    """A long-running demo app replica (FAQ questions, simulated users) with /metrics."""
    from zerda_cache.demo import serve_app

    sys.exit(serve_app(state.server_url(), metrics_port=metrics_port, rate=rate, seed=seed))


# -- the HTTP service -----------------------------------------------------------------------------
@cli.command()
@shared_options
@click.option(
    "--host",
    envvar="ZERDA_HOST",
    default="127.0.0.1",
    show_default=True,
    help="0.0.0.0 in a container (env ZERDA_HOST).",
)
@click.option(
    "--port",
    type=int,
    envvar="ZERDA_PORT",
    default=8080,
    show_default=True,
    help="The port to listen on (env ZERDA_PORT).",
)
@click.option(
    "--embedder",
    envvar="ZERDA_EMBEDDER",
    default="none",
    show_default=True,
    help="none (callers send vectors; the proxy passes through), hashing[:DIM], minilm "
    "(extra minilm), sentence-transformers:MODEL (extra sentence-transformers), or the "
    "base URL of an OpenAI-compatible embeddings API (extra openai-embeddings) "
    "(env ZERDA_EMBEDDER).",
)
@click.option(
    "--embedding-model",
    envvar="ZERDA_EMBEDDING_MODEL",
    default="text-embedding-3-small",
    show_default=True,
    help="The model an embeddings URL is asked for (env ZERDA_EMBEDDING_MODEL; its key: "
    "env ZERDA_EMBEDDINGS_API_KEY).",
)
@click.option(
    "--upstream-url",
    envvar="ZERDA_UPSTREAM_URL",
    default=None,
    help="The OpenAI-compatible API behind the proxy, e.g. https://api.openai.com/v1 "
    "(env ZERDA_UPSTREAM_URL; its key: env ZERDA_UPSTREAM_API_KEY).",
)
@click.option("--upstream-timeout", type=float, default=120.0, show_default=True)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=1024 * 1024,
    show_default=True,
    help="Larger request bodies are refused (413).",
)
@click.option(
    "--warm-tenant",
    multiple=True,
    help="Build this tenant's index at start-up; /readyz waits for it (repeatable).",
)
@click.option(
    "--similarity-threshold",
    type=float,
    envvar="ZERDA_SIMILARITY_THRESHOLD",
    default=None,
    help="Cosine similarity a near match needs, 0 to 1; default 0.85 "
    "(env ZERDA_SIMILARITY_THRESHOLD).",
)
@click.option(
    "--redis-timeout",
    type=float,
    envvar="ZERDA_REDIS_TIMEOUT",
    default=None,
    help="Socket timeout (s) of Redis calls; default 0.5, lookups fail open past it "
    "(env ZERDA_REDIS_TIMEOUT).",
)
@click.option(
    "--vector-storage",
    type=click.Choice(["float32", "float16"]),
    envvar="ZERDA_VECTOR_STORAGE",
    default="float16",
    show_default=True,
    help="How puts store vectors (float32: 1.4x the memory of float16; for deployments "
    "that still run a version that cannot read float16, see docs/operations.md) "
    "(env ZERDA_VECTOR_STORAGE).",
)
@token_prices_option
@click.option(
    "--completion-ttl",
    type=click.FloatRange(min=1),
    envvar="ZERDA_COMPLETION_TTL",
    default=86_400.0,
    show_default=True,
    help="Seconds a proxy completion id stays mapped for feedback (env ZERDA_COMPLETION_TTL).",
)
@click.option(
    "--coalesce-wait",
    type=click.FloatRange(min=0),
    envvar="ZERDA_COALESCE_WAIT",
    default=30.0,
    show_default=True,
    help="Seconds a proxy miss waits for an identical one's upstream call before making "
    "its own; 0 turns coalescing off (env ZERDA_COALESCE_WAIT).",
)
@pass_state
def serve(
    state: CliState,
    host: str,
    port: int,
    embedder: str,
    embedding_model: str,
    upstream_url: str | None,
    upstream_timeout: float,
    max_body_bytes: int,
    warm_tenant: tuple[str, ...],
    similarity_threshold: float | None,
    redis_timeout: float | None,
    vector_storage: str,
    token_prices: str | None,
    completion_ttl: float,
    coalesce_wait: float,
) -> None:
    """Run the HTTP service and the OpenAI-compatible caching proxy (needs the service
    extra: pip install 'zerda-cache[service]')."""
    import os

    try:
        import uvicorn

        from zerda_cache.aio import AsyncCacheManager
        from zerda_cache.core.validation import validate_tenant
        from zerda_cache.service import ServiceSettings, Upstream, create_app
        from zerda_cache.service.coordination import CoalesceSettings
        from zerda_cache.service.embedding import make_embedder
    except ImportError as exc:
        raise click.UsageError(
            f"serve needs the service extra ({exc.name} is missing): "
            "pip install 'zerda-cache[service]'"
        ) from exc
    url = state.server_url()  # refuses without one: the keys live in Redis
    with errors():
        cfg = _serve_config(
            state.config, similarity_threshold, redis_timeout, vector_storage, token_prices
        )
        try:
            embed_fn = make_embedder(
                embedder,
                model=embedding_model,
                api_key=os.environ.get("ZERDA_EMBEDDINGS_API_KEY"),
            )
        except RuntimeError as exc:  # an embedder whose extra is not installed
            raise click.UsageError(str(exc)) from exc
        upstream = None
        if upstream_url:
            upstream = Upstream(
                upstream_url,
                api_key=os.environ.get("ZERDA_UPSTREAM_API_KEY") or None,
                timeout_s=upstream_timeout,
            )
        for t in warm_tenant:
            validate_tenant(t)
        if upstream is not None and embed_fn is None:
            logging.getLogger("zerda_cache.service").warning(
                "--embedder none: the proxy passes every request through uncached"
            )
        client = connect(url, cfg, cluster=state.cluster or None, asyncio=True)
        manager = AsyncCacheManager(client, cfg, embed_fn=embed_fn)
        app = create_app(
            manager,
            upstream=upstream,
            settings=ServiceSettings(
                max_body_bytes=max_body_bytes,
                warm_tenants=warm_tenant,
                completion_ttl_s=completion_ttl,
                coalesce=CoalesceSettings(enabled=coalesce_wait > 0, wait_s=coalesce_wait),
            ),
            close_on_shutdown=True,
        )
    level = (state.log_level or "INFO").lower()
    uvicorn.run(app, host=host, port=port, log_level=level, server_header=False)


def _serve_config(
    cfg: CacheConfig,
    similarity_threshold: float | None,
    redis_timeout: float | None,
    vector_storage: str,
    token_prices: str | None,
) -> CacheConfig:
    """``serve``'s configuration: the shared one with the options given on top."""
    if similarity_threshold is not None:
        cfg = replace(cfg, similarity_threshold=similarity_threshold)
    if redis_timeout is not None:
        cfg = replace(cfg, redis_timeout_s=redis_timeout)
    cfg = replace(cfg, vector_storage=vector_storage)
    return with_prices(cfg, token_prices)


def with_prices(cfg: CacheConfig, token_prices: str | None) -> CacheConfig:
    """``cfg`` with the prices of the ``--token-prices`` file (``None``: as it is)."""
    if token_prices is None:
        return cfg
    return replace(cfg, token_prices=_read_prices(token_prices))


def _read_prices(path: str) -> dict[str, tuple[float, float]]:
    """A prices file: ``{model: [prompt, completion]}``, US dollars per million tokens."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return {str(m): (float(v[0]), float(v[1])) for m, v in raw.items()}
    except (OSError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise click.BadParameter(
            f"{path}: expected {{model: [prompt, completion]}} ({exc})", param_hint="--token-prices"
        ) from None


# -- API keys of the HTTP service -----------------------------------------------------------------
@cli.group()
def keys() -> None:
    """Per-tenant API keys of the HTTP service (only their SHA-256 digests are stored)."""


@keys.command("create")
@shared_options
@click.option("--tenant", required=True, help="The tenant the key is bound to.")
@click.option("--name", default="", help="A label for listings (who or what uses it).")
@pass_state
def keys_create(state: CliState, tenant: str, name: str) -> None:
    """Create a key for TENANT and print its token once (it cannot be shown again)."""
    from zerda_cache.apikeys import create_key

    with errors():
        token, record = create_key(state.storage(), tenant, name)
        # Said whole on its own line: under TOKEN=$(...) the token goes to the variable
        # and only this line is seen, so it must not end where the token would follow.
        err.print(
            f"created key {record.id} for tenant {tenant}: its token is printed on stdout, "
            "only this once (it cannot be shown again)"
        )
        click.echo(token)


@keys.command("list")
@shared_options
@any_tenant_option
@json_option
@pass_state
def keys_list(state: CliState, tenant: str | None, as_json: bool) -> None:
    """List keys (id, tenant, name, created, revoked); never the tokens."""
    with errors():
        listed = [k for k in state.storage().api_keys() if tenant is None or k.tenant == tenant]
        if as_json:
            _print_json(
                [
                    {
                        "id": k.id,
                        "tenant": k.tenant,
                        "name": k.name,
                        "created": k.created,
                        "revoked": k.revoked,
                        "active": k.active,
                    }
                    for k in listed
                ]
            )
            return
        table = Table(title="zerda-cache API keys")
        for col in ("id", "tenant", "name", "created", "status"):
            table.add_column(col)
        for k in listed:
            status = "active" if k.revoked is None else "revoked " + _utc(k.revoked)
            table.add_row(k.id, k.tenant, k.name, _utc(k.created), status)
        console.print(table)


@keys.command("revoke")
@shared_options
@click.argument("key", required=False)
@click.option("--tenant", default=None, help="Revoke every key of this tenant.")
@pass_state
def keys_revoke(state: CliState, key: str | None, tenant: str | None) -> None:
    """Revoke KEY (its id, or the token itself), or every key of --tenant. Immediate: the
    service reads the key's record on every request. Exit 1 if nothing was revoked."""
    from zerda_cache.apikeys import KEY_ID_RE, key_id, looks_like_token, token_digest

    with errors():
        if (key is None) == (tenant is None):
            raise click.UsageError("give a KEY id (or token), or --tenant, not both")
        st = state.storage()
        if key is not None:
            kid = key_id(token_digest(key)) if looks_like_token(key) else key
            if not KEY_ID_RE.fullmatch(kid):
                raise click.UsageError(f"{key!r} is neither a key id (12 hex digits) nor a token")
            revoked = st.revoke_api_keys(key_id=kid)
        else:
            assert tenant is not None
            from zerda_cache.core.validation import validate_tenant

            revoked = st.revoke_api_keys(tenant=validate_tenant(tenant))
        for kid in revoked:
            click.echo(f"revoked {kid}")
        if not revoked:
            err.print("[yellow]no active key matched: nothing revoked[/yellow]")
            sys.exit(1)


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def _plain_help(command: click.Command) -> None:
    """Help texts come from docstrings written in reStructuredText: show ``x`` as 'x'."""

    def plain(text: str | None) -> str | None:
        return None if text is None else re.sub(r"``(.+?)``", r"'\1'", text)

    command.help = plain(command.help)
    command.short_help = plain(command.short_help)
    for param in command.params:
        if isinstance(param, click.Option):
            param.help = plain(param.help)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _plain_help(sub)


_plain_help(cli)


def main() -> None:
    cli(prog_name="zerda-cache")


if __name__ == "__main__":
    main()
