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

from zerda_cache.core.errors import (
    CorruptEntryError,
    DimensionMismatchError,
    InvalidEntryError,
    ZerdaError,
)
from zerda_cache.core.validation import (
    check_dim,
    check_expiry,
    validate_entry_id,
)
from zerda_cache.storage import RedisStorage, codec
from zerda_cache.storage.plans import ScriptCall, StoredEntry
from zerda_cache.storage.replies import unit_score

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
    corrupt: Callable[[str, str], None] | None = None,
    gone: Callable[[str], None] | None = None,
) -> int:
    """Write ``tenant``'s live entries to ``out`` as JSON lines; returns how many.
    ``progress(done, total)`` is called after each batch.

    An entry that does not read (a corrupt field) is left out and the export goes on:
    ``corrupt(entry_id, why)`` is called for it, and it is reported to the tenant's
    ``bad`` set, where the worker finds and evicts it. An entry removed while the
    export ran (its hash is gone) is no corrupt one: ``gone(entry_id)`` is called for
    it, and nothing is reported (``_batch``)."""
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
        for stored in _batch(storage, tenant, list(live)):
            try:
                line = _line(stored, live[stored.entry_id], storage.keys(tenant).entry)
            except CorruptEntryError as exc:
                storage.suspect(tenant, stored.entry_id, exc)
                if corrupt is not None:
                    corrupt(stored.entry_id, str(exc))
                continue
            if line is None:
                if gone is not None:
                    gone(stored.entry_id)
                continue
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            emitted.add(stored.entry_id)
            written += 1
        seen += len(batch)
        if progress is not None:
            progress(min(seen, total), total)
    report = storage.report_suspects(tenant)
    if report is not None:
        storage.read(report)
    return written


def _batch(storage: RedisStorage, tenant: str, entry_ids: list[str]) -> list[StoredEntry]:
    """The stored fields of ``entry_ids`` for an export. The pipeline reads the entries'
    hashes, then their states: an entry the worker evicted between the two reads has a
    whole hash and no state. Those are read once more, so that an entry whose hash is
    gone by then reads as gone, and one removed and written again whole is exported;
    one with its hash and still no state is left as it reads (``_line``: missing)."""
    rows = storage.export_batch(tenant, entry_ids)
    torn = [r.entry_id for r in rows if r.state is None and None not in (r.doc, r.vec, r.meta)]
    if not torn:
        return rows
    again = {r.entry_id: r for r in storage.export_batch(tenant, torn)}
    return [again.get(r.entry_id, r) for r in rows]


def _line(
    stored: StoredEntry, expires_at: float, key_of: Callable[[str], str]
) -> dict[str, Any] | None:
    """One entry's line; None when it is gone (removed since its id was read: its hash
    is gone, whether or not the state read after it still found the state).

    Raises:
        CorruptEntryError: a field is missing (the entry's hash is partly there, or
            whole without a state) or does not read, or its key is of another type.
    """
    key = key_of(stored.entry_id)
    if stored.corrupt is not None:
        raise CorruptEntryError(key, stored.corrupt)
    fields = (stored.doc, stored.vec, stored.meta, stored.state)
    if stored.doc is None and stored.vec is None and stored.meta is None:
        return None
    if None in fields:
        raise CorruptEntryError(key, "doc, vec, meta or state is missing")
    query, _, _ = codec.unpack_doc(stored.doc, key=key)
    meta = codec.unpack_meta(stored.meta, key=key)
    codec.decode_vector(stored.vec, key=key, dim=meta["dim"])  # type: ignore[arg-type]
    codec.unpack_state(stored.state, key=key)
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

    Every line is checked as a put checks its input (``check_line``), with the limits
    of ``storage``'s configuration, before anything of it is written: a line that does
    not check out is refused (``ImportReport.refused``, with its line number) and
    nothing of it is written.

    Raises:
        InvalidEntryError: the first line is not an export's header, is of a format
            version this library does not read, or its ``dim`` is not a dimension.
        DimensionMismatchError: the export's vectors are not of the tenant's dimension.
    """
    it = iter(lines)
    header = _header(next(it, ""))
    dim = storage.tenant_dim(tenant)
    if dim is not None and header["dim"] not in (None, dim):
        raise DimensionMismatchError(tenant, dim, header["dim"])
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
            stored, fields = check_line(line, dim if dim is not None else header["dim"], storage)
        except (ValueError, KeyError, TypeError, RecursionError, ZerdaError) as exc:
            report.refused.append((number, _why(exc)))
            continue
        if fields["expires_at"] <= now:
            report.expired += 1
            continue
        pending.append(storage.plan_restore_entry(tenant, stored, **fields))
        if dim is None:  # the tenant's first entry fixes its dimension: sent alone
            dim = fields["dim"]
            send()
        elif len(pending) >= size:
            send()
    if pending:
        send()
    if progress is not None:
        progress(report)
    return report


def _why(exc: BaseException) -> str:
    """A refused line's reason, on one line of at most 300 characters."""
    if isinstance(exc, KeyError):
        text = f"a line lacks the field {exc.args[0]!r}"
    elif isinstance(exc, RecursionError):
        text = "a line nests too deep"
    else:
        text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _header(line: str) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise InvalidEntryError("not a zerda-cache export: its first line is not the header")
    if header.get("version") != VERSION:
        raise InvalidEntryError(
            f"export format version {header.get('version')!r}; this library reads {VERSION}"
        )
    dim = header.get("dim")
    header["dim"] = None if dim is None else check_dim(dim, "the export header's dim")
    return header


def check_line(
    line: str, dim: int | None, storage: RedisStorage
) -> tuple[StoredEntry, dict[str, Any]]:
    """One line of an export, checked as an entry is read (the stored values decode,
    the vector is of the tenant's dimension and of unit length) and as a put checks its
    input: its content by the put's own checks (``codec.checked_doc``, with
    ``storage``'s limits), and its state's similarity, quality and confidence in
    [0, 1], as a put's are. The doc is packed again (as a put packs it) and the size
    (``#doc + #vec``, the tenant's byte count) is computed, never read from the file.
    The rest of the state (the arm, its uses and times) is taken as the file holds it
    once it decodes: feedback and hits, not a put, wrote it. ``ValueError``
    (``InvalidEntryError``, ``CorruptEntryError``...) when a line does not check out."""
    row = json.loads(line, parse_constant=_no_constant)
    if not isinstance(row, dict):
        raise InvalidEntryError("a line is not a JSON object")
    eid = validate_entry_id(row["id"], InvalidEntryError)
    raw_doc, vec, raw_meta, state = (_unb64(row[f]) for f in ("doc", "vec", "meta", "state"))
    key = f"line of {eid}"
    query, response, metadata = codec.unpack_doc(raw_doc, key=key)
    meta = codec.unpack_meta(raw_meta, key=key)
    query, doc, scope, tags, _ = codec.checked_doc(
        storage.config,
        query,
        response,
        metadata,
        scope=meta["sc"],
        tags=list(meta["tg"]),
        usage=meta["us"],
    )
    want = dim if dim is not None else meta["dim"]
    codec.decode_vector(vec, key=key, dim=want)
    if meta["dim"] != want:
        raise CorruptEntryError(key, f"meta.dim is {meta['dim']}, the tenant's {want}")
    size = len(doc) + len(vec)
    state = codec.state_with_size(state, size, key=key)  # the file's size is not used
    arm, use, _ = codec.unpack_state(state, key=key)
    for name, value in (
        ("similarity", use.similarity),
        ("quality", use.quality),
        ("confidence", use.confidence),
    ):
        unit_score(f"the state's {name}", value)
    stored = StoredEntry(eid, doc, vec, raw_meta, state)
    fields = {
        "digest": codec.query_digest(query, scope),
        "scope": scope,
        "dim": want,
        "expires_at": check_expiry(row.get("expires_at")),
        "size": size,
        "evidence": arm.pulls > 0,
        "tags": tags,
    }
    return stored, fields


def _no_constant(name: str) -> Any:
    raise InvalidEntryError(f"{name} is not a JSON number")


def _b64(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode("ascii")


def _unb64(value: object) -> bytes:
    if not isinstance(value, str):
        raise ValueError("a stored value is not a base64 string")
    return base64.b64decode(value, validate=True)


__all__ = ["FORMAT", "VERSION", "ImportReport", "check_line", "export_tenant", "import_tenant"]
