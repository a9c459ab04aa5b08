"""Export a tenant to JSON lines and import it back: to warm a new deployment, to move a
tenant, or to keep a copy.

The file's first line is a header, ``{"format": "zerda-cache-export", "version": 1,
"tenant", "dim", "exported_at", "entries"}``; each further line is one live entry:

- ``id``, ``query``, ``scope``, ``tags``, ``expires_at`` (unix seconds; ``null``: none):
  readable, for ``jq`` and for the import's checks;
- ``doc``, ``vec``, ``meta``, ``state``: the stored values, base64 (the answer, its
  metadata and question as msgpack; the vector's bytes; created_at, TTL, scope, dimension
  and tags; the learning state's 15 numbers: ``storage/codec.py``), so that the answer,
  its vector, its arm and its uses come back exactly as they were.

An import checks every line (it decodes as an entry would be read, of the tenant's
dimension) and writes each entry in one script call that indexes it as a put does (the
exact-match map, replicas' log, tags; ``IMPORT_BATCH`` calls a round trip), skipping an
id that is there already: an import
interrupted and run again resumes where it stopped. Expired entries are left out of an
export and skipped by an import.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from zerda_cache.core.errors import CorruptEntryError, DimensionMismatchError, InvalidEntryError
from zerda_cache.core.validation import check_tags, validate_entry_id
from zerda_cache.storage import RedisStorage, codec
from zerda_cache.storage.plans import ScriptCall, StoredEntry

FORMAT = "zerda-cache-export"
VERSION = 1
#: Entries read per round trip by an export, and written per round trip by an import.
EXPORT_BATCH = 500
IMPORT_BATCH = 200


@dataclass(slots=True)
class ImportReport:
    """What an import did: entries stored, skipped (their id was there: a resumed
    import), expired (left out) and refused (a line that does not check out, with why)."""

    stored: int = 0
    skipped: int = 0
    expired: int = 0
    refused: list[tuple[int, str]] = field(default_factory=list)


def export_tenant(
    storage: RedisStorage,
    tenant: str,
    out: IO[str],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write ``tenant``'s live entries to ``out`` as JSON lines; returns how many.
    ``progress(done, total)`` is called after each batch."""
    total = storage.count(tenant)
    now = storage.now()
    header = {
        "format": FORMAT,
        "version": VERSION,
        "tenant": tenant,
        "dim": storage.tenant_dim(tenant),
        "exported_at": now,
        "entries": total,
    }
    out.write(json.dumps(header) + "\n")
    written = seen = 0
    emitted: set[str] = set()  # a ZSCAN may return an id twice
    for batch in storage.iter_ids(tenant, EXPORT_BATCH):
        live = {eid: exp for eid, exp in batch if exp > now and eid not in emitted}
        for stored in storage.export_batch(tenant, list(live)):
            line = _line(stored, live[stored.entry_id])
            if line is not None:
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
                emitted.add(stored.entry_id)
                written += 1
        seen += len(batch)
        if progress is not None:
            progress(min(seen, total), total)
    return written


def _line(stored: StoredEntry, expires_at: float) -> dict[str, Any] | None:
    """One entry's line, or None when it is gone or does not read (the worker evicts it)."""
    key = stored.entry_id
    try:
        if None in (stored.doc, stored.vec, stored.meta, stored.state):
            return None
        query, _, _ = codec.unpack_doc(stored.doc, key=key)
        meta = codec.unpack_meta(stored.meta, key=key)
        codec.decode_vector(stored.vec, key=key, dim=int(meta["dim"]))  # type: ignore[arg-type]
        codec.unpack_state(stored.state, key=key)
    except CorruptEntryError:
        return None
    return {
        "id": stored.entry_id,
        "query": query,
        "scope": meta["sc"],
        "tags": list(meta["tg"]),
        "expires_at": None if math.isinf(expires_at) else expires_at,
        "doc": _b64(stored.doc),
        "vec": _b64(stored.vec),
        "meta": _b64(stored.meta),
        "state": _b64(stored.state),
    }


def import_tenant(
    storage: RedisStorage,
    tenant: str,
    lines: Iterable[str],
    *,
    progress: Callable[[ImportReport], None] | None = None,
    every: int = 1_000,
) -> ImportReport:
    """Write the entries of an export (its lines, header first) into ``tenant``, which
    may differ from the exported one. ``progress(report)`` is called every ``every``
    entries.

    Raises:
        InvalidEntryError: the first line is not an export's header, or of a format
            version this library does not read.
        DimensionMismatchError: the export's vectors are not of the tenant's dimension.
    """
    it = iter(lines)
    header = _header(next(it, ""))
    dim = storage.tenant_dim(tenant)
    if dim is not None and header.get("dim") not in (None, dim):
        raise DimensionMismatchError(tenant, dim, int(header["dim"]))
    report = ImportReport()
    now = storage.now()
    # Scripts ride in pipelines (IMPORT_BATCH calls a round trip), except on Redis
    # Cluster, whose pipelines cannot carry them: there, one call at a time.
    size = 1 if storage.cluster else IMPORT_BATCH
    pending: list[ScriptCall[bool]] = []
    told = 0

    def send() -> None:
        nonlocal told
        if len(pending) == 1:
            results = [storage.run(pending[0])]
        else:
            results = storage.read(storage.batch("import", pending))
        for done in results:
            if done:
                report.stored += 1
            else:
                report.skipped += 1
        pending.clear()
        if progress is not None and report.stored + report.skipped - told >= every:
            told = report.stored + report.skipped
            progress(report)

    for number, line in enumerate(it, start=2):
        if not line.strip():
            continue
        try:
            stored, fields = _entry(line, dim if dim is not None else header.get("dim"))
        except (ValueError, KeyError, TypeError, CorruptEntryError, InvalidEntryError) as exc:
            report.refused.append((number, str(exc)))
            continue
        if fields["expires_at"] <= now:
            report.expired += 1
            continue
        if dim is None:  # the tenant's first entry fixes its dimension: sent alone
            dim = fields["dim"]
            pending.append(storage.plan_restore_entry(tenant, stored, **fields))
            send()
            continue
        pending.append(storage.plan_restore_entry(tenant, stored, **fields))
        if len(pending) >= size:
            send()
    if pending:
        send()
    if progress is not None:
        progress(report)
    return report


def _header(line: str) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise InvalidEntryError("not a zerda-cache export: its first line is not the header")
    if header.get("version") != VERSION:
        raise InvalidEntryError(
            f"export format version {header.get('version')!r}; this library reads {VERSION}"
        )
    return header


def _entry(line: str, dim: Any) -> tuple[StoredEntry, dict[str, Any]]:
    """One line, checked as an entry is read: the stored values decode, the vector is of
    its meta's (and the tenant's) dimension and of unit length, the tags are valid."""
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError("a line is not a JSON object")
    eid = validate_entry_id(row["id"], InvalidEntryError)
    stored = StoredEntry(
        eid, _unb64(row["doc"]), _unb64(row["vec"]), _unb64(row["meta"]), _unb64(row["state"])
    )
    key = f"line of {eid}"
    query, _, _ = codec.unpack_doc(stored.doc, key=key)
    meta = codec.unpack_meta(stored.meta, key=key)
    want = int(dim) if dim is not None else int(meta["dim"])
    codec.decode_vector(stored.vec, key=key, dim=want)  # type: ignore[arg-type]
    if int(meta["dim"]) != want:
        raise CorruptEntryError(key, f"meta.dim is {meta['dim']}, the tenant's {want}")
    arm, _, size = codec.unpack_state(stored.state, key=key)
    tags = check_tags(list(meta["tg"]))
    expires = row.get("expires_at")
    expires_at = math.inf if expires is None else float(expires)
    if math.isnan(expires_at):
        raise ValueError("expires_at is NaN")
    fields = {
        "digest": codec.query_digest(query, meta["sc"]),
        "scope": meta["sc"],
        "dim": want,
        "expires_at": expires_at,
        "size": size,
        "evidence": arm.pulls > 0,
        "tags": tags,
    }
    return stored, fields


def _b64(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode("ascii")


def _unb64(value: object) -> bytes:
    if not isinstance(value, str):
        raise ValueError("a stored value is not a base64 string")
    return base64.b64decode(value, validate=True)


__all__ = ["FORMAT", "VERSION", "ImportReport", "export_tenant", "import_tenant"]
