"""What every plan of a keyspace shares: its configuration, its keys, the bandit's script
arguments, and the ids found corrupt on the way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from zerda_cache.core.config import CacheConfig, RLConfig
from zerda_cache.core.errors import (
    CorruptEntryError,
    SchemaVersionError,
)
from zerda_cache.storage.keys import TenantKeys, tenant_keys, tenants_key
from zerda_cache.storage.replies import (
    STATE_HASH_FIELDS,
    ReadPlan,
    StateBatch,
    hash_row,
    state_entry,
)

log = logging.getLogger(__name__)


class PlanBase:
    """The plans of one keyspace: keys, validation, script arguments and the parsing of
    replies. ``Storage`` (store.py) executes them.

    Args:
        config: key prefix, size limits and the bandit parameters the scripts apply.
        clock: returns "now" in unix seconds; default: the Redis server's clock, read
            inside each script (one clock for every replica).
    """

    def __init__(
        self, config: CacheConfig | None = None, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.config = config if config is not None else CacheConfig()
        self.clock = clock
        self._keys: dict[str, TenantKeys] = {}
        self.registered_tenants: set[str] = set()
        #: Ids this process found undecodable (a doc, meta or vec the put script does not
        #: check), by tenant, until a lookup reports them for the worker to evict.
        self._suspected: dict[str, set[str]] = {}
        self._static: dict[RLConfig, tuple[list[str], list[str]]] = {}

    def rl_static(self, rl: RLConfig | None) -> tuple[list[str], list[str]]:
        """The script arguments of a policy's bandit parameters, formatted once per
        policy (repr round-trips floats): the decay ones, and the feedback ones."""
        rl = self.config.rl if rl is None else rl
        out = self._static.get(rl)
        if out is None:
            decay = [
                repr(rl.prior_alpha),
                repr(rl.prior_beta),
                repr(rl.usage_decay),
                repr(rl.decay_interval_s),
            ]
            feedback = [
                repr(rl.positive_feedback_reward),
                repr(rl.negative_feedback_penalty),
                *decay,
                str(self.config.feedback_log_maxlen),
                repr(rl.similarity_bar_margin),
                repr(rl.near_miss_penalty_share),
                repr(rl.negative_streak_forget),
            ]
            if len(self._static) > 1_000:
                self._static.clear()
            out = self._static[rl] = (decay, feedback)
        return out

    def keys(self, tenant: str) -> TenantKeys:
        """The (validated) keys of ``tenant``."""
        k = self._keys.get(tenant)
        if k is None:
            k = tenant_keys(tenant, self.config.key_prefix)
            if len(self._keys) < 10_000:
                self._keys[tenant] = k
        return k

    @property
    def tenants_key(self) -> str:
        return tenants_key(self.config.key_prefix)

    def now_arg(self) -> str:
        return "" if self.clock is None else repr(float(self.clock()))

    def rl_args(self, rl: RLConfig | None = None) -> list[str]:
        return self.rl_static(rl)[0]

    def suspect(self, tenant: str, entry_id: str, exc: CorruptEntryError) -> None:
        if isinstance(exc, SchemaVersionError):
            return  # another version's entry: readable by it, not to be evicted
        found = self._suspected.setdefault(tenant, set())
        if len(found) < 10_000:
            found.add(entry_id)

    def report_suspects(self, tenant: str) -> ReadPlan[None] | None:
        """The ids this process found corrupt in ``tenant`` (taken: reported once), added
        to the tenant's ``bad`` set, where the worker finds and evicts them; ``None``
        when there are none. A full server may refuse it: then they wait for the scan."""
        ids = sorted(self._suspected.pop(tenant, ()))
        if not ids:
            return None
        bad = self.keys(tenant).bad

        def queue(pipe: Any) -> None:
            pipe.sadd(bad, *ids)

        def parse(res: list[Any]) -> None:
            if isinstance(res[0], Exception):
                log.warning("tenant %s: %d corrupt ids not reported: %s", tenant, len(ids), res[0])

        return ReadPlan("report corrupt", queue, parse, 1, tolerant=(0,))

    def state_batch(
        self,
        tenant: str,
        ids: Sequence[str],
        rows: Sequence[Sequence[Any]],
        states: Sequence[bytes | None],
        scores: Sequence[Any],
    ) -> StateBatch:
        """The states of ``ids`` from their hashes' ``STATE_HASH_FIELDS`` (``rows``), the
        state hash and the ids' expiry scores, as ``read_states`` and a tied hit read
        them."""
        k = self.keys(tenant)
        out = StateBatch()
        for eid, raw, state, score in zip(ids, rows, states, scores, strict=True):
            key = k.entry(eid)
            try:
                row = hash_row(raw, key)
                if state is None and all(value is None for value in row):
                    out.missing.append(eid)
                    continue
                values = dict(zip(STATE_HASH_FIELDS, row, strict=True))
                out.entries[eid] = state_entry(tenant, eid, key, values, state, score)
            except CorruptEntryError as exc:
                log.warning("skipping corrupt entry: %s", exc)
                out.corrupt.append(eid)
                self.suspect(tenant, eid, exc)
        return out
