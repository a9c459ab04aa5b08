"""The only place Redis key strings are built.

Every key of one tenant carries the hash tag ``{<tenant>}``, so every Lua script touches a
single Redis Cluster slot. Tenant ids are validated (``zerda_cache.core.validation``) before they
come near a key.

Layout (``p`` is the configured prefix, ``zc`` by default):

=====================  =======  ==========================================================
key                    type     holds
=====================  =======  ==========================================================
``p:{t}:e:<id>``       hash     one entry: doc, vec, meta, dg (and dsp, under a bound;
                                wh, the last hits counted wrong: feedback.lua)
``p:{t}:st``           hash     entry id -> its learning state: arm, use and sz as 15
                                float64 (storage/codec.py)
``p:{t}:ids``          zset     live entry ids, scored by expiry (unix s, +inf = none)
``p:{t}:q``            hash     digest of (normalised query, scope) -> entry id
``p:{t}:log``          stream   add/del events that keep replicas' vector indexes current
``p:{t}:stats``        hash     counters (hits, misses, puts, bytes, evicted:<reason>, ...)
``p:{t}:fb``           stream   the rolling feedback log (approximate cap); the worker
                                reads the arms that changed from it
``p:{t}:cfg``          hash     tenant settings: dim; max_entries, max_bytes, ttl,
                                max_error_rate, ... (settings.py); ver, fence, evx
``p:{t}:cal``          hash     labelled outcomes of near matches, and lookups, per
                                similarity bin (calibration.py)
``p:{t}:lab``          list     the label log: [similarity, gap, crowd, right] JSON rows,
                                newest first, capped at label_window or 50,000
                                (match_model.py)
``p:{t}:seen``         list     under a bound: lookups' features in batches (msgpack), for
                                rescoring the lookup counts under a new model (capped)
``p:{t}:bad``          set      ids replicas found undecodable, for the worker to evict
``p:{t}:srv``          zset     id of each process that reported the settings it applies
                                to the tenant -> server time of its report (reports.py;
                                entries older than 60 s dropped; expires)
``p:{t}:ev``           set      ids of arms with evidence (a signal): the decay job's list
``p:{t}:snap``         hash     the worker's index snapshot: generation, log position, size
``p:{t}:snap:<g>:<i>`` string   chunk ``i`` of snapshot generation ``g``
``p:{t}:tag:<name>``   set      ids of the entries put with tag ``name`` (removed ones
                                until the worker's sweep or the tag's invalidation)
``p:{t}:tags``         set      the tenant's tag names
``p:{t}:cmp:<id>``     string   a completion id the proxy answered with -> its entry id
                                (expires)
``p:{t}:fly:<d>``      string   a lease on the upstream call for request digest ``d``
                                (coalesced misses; expires)
``p:tenants``          set      known tenants (global; never touched inside a script)
``p:worker:leader``    string   the worker's lease
``p:worker:cycles``    stream   start/end of the worker's cycles (capped)
``p:proc:<process>``   string   the settings that replica or worker applies where a tenant
                                stored none, JSON (one key a process; reports.py; expires)
``p:apikeys``          hash     the HTTP service's API keys: token digest -> record
                                (global; changed only by the apikey scripts)
=====================  =======  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from zerda_cache.core.validation import validate_tenant


@dataclass(frozen=True, slots=True)
class TenantKeys:
    """The keys of one tenant. Build with :func:`tenant_keys`."""

    tenant: str
    base: str  # "p:{t}:"
    ids: str
    st: str
    q: str
    log: str
    stats: str
    fb: str
    cfg: str
    cal: str
    lab: str
    seen: str
    bad: str
    srv: str
    ev: str
    snap: str
    tags: str

    def entry(self, entry_id: str) -> str:
        return self.base + "e:" + entry_id

    def snap_chunk(self, generation: str, index: int) -> str:
        return f"{self.snap}:{generation}:{index}"

    def tag(self, name: str) -> str:
        """The set of ids put with tag ``name`` (validated: ``validation.check_tag``)."""
        return self.base + "tag:" + name

    def completion(self, completion_id: str) -> str:
        return self.base + "cmp:" + completion_id

    def in_flight(self, digest: str) -> str:
        return self.base + "fly:" + digest

    def verification(self, nonce: str) -> str:
        """The mark of a verification ticket settled (``claim_ticket``)."""
        return self.base + "vt:" + nonce

    @property
    def entry_prefix(self) -> str:
        return self.base + "e:"


def tenant_keys(tenant: str, prefix: str = "zc") -> TenantKeys:
    """Validate ``tenant`` and return the names of all of its keys."""
    validate_tenant(tenant)
    base = f"{prefix}:{{{tenant}}}:"
    return TenantKeys(
        tenant=tenant,
        base=base,
        ids=base + "ids",
        st=base + "st",
        q=base + "q",
        log=base + "log",
        stats=base + "stats",
        fb=base + "fb",
        cfg=base + "cfg",
        cal=base + "cal",
        lab=base + "lab",
        seen=base + "seen",
        bad=base + "bad",
        srv=base + "srv",
        ev=base + "ev",
        snap=base + "snap",
        tags=base + "tags",
    )


def tenants_key(prefix: str = "zc") -> str:
    return f"{prefix}:tenants"


def process_key(process: str, prefix: str = "zc") -> str:
    """The settings one replica or worker applies (``storage/reports.py``): once a
    process, not a tenant, so on Redis Cluster in a slot of its own."""
    return f"{prefix}:proc:{process}"


def cycles_key(prefix: str = "zc") -> str:
    """The worker's cycle log (stream): start and end of every maintenance cycle."""
    return f"{prefix}:worker:cycles"


def leader_key(prefix: str = "zc") -> str:
    return f"{prefix}:worker:leader"


def api_keys_key(prefix: str = "zc") -> str:
    """The HTTP service's API keys (hash: SHA-256 digest of a token -> its JSON record).

    Global, not per tenant: the service learns the tenant from the key, so it cannot know
    the tenant's slot before reading it. On Redis Cluster the hash lives in one slot; each
    script that changes it touches only it, and reads are one HGET per request.
    """
    return f"{prefix}:apikeys"
