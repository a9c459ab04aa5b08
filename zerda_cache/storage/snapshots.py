"""Index snapshots in Redis: the worker writes a tenant's index dump in chunks and
publishes it in one step; a replica reads the published chunks into one buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerda_cache.storage.codec import text
from zerda_cache.storage.driver import Flow, op
from zerda_cache.storage.executor import StorageCore
from zerda_cache.storage.keys import TenantKeys
from zerda_cache.storage.plans import (
    ScriptCall,
)

log = logging.getLogger(__name__)

#: An index snapshot is stored in strings of at most this many bytes (Redis caps a
#: string at 512 MB; smaller chunks keep each GET from holding the server long).
SNAPSHOT_CHUNK = 16 * 1024 * 1024
#: Chunks of a snapshot not published within this long are garbage (a worker died).
SNAPSHOT_UNPUBLISHED_TTL_MS = 3_600_000
#: The snapshot formats a replica reads (``fmt`` in the ``snap`` hash: the dump's own,
#: ``index.dump_format``, given by the writer). A replica whose list lacks "5" (binary
#: graphs, ``ann_dtype="b1"``), "4" (int8 graphs of vectors scaled before int8,
#: ``UsearchIndex.quant``) or "3" (int8 graphs with float16 rows beside them) scans
#: instead of loading a snapshot of that format.
SNAPSHOT_FORMATS_READ = ("1", "2", "3", "4", "5")
#: A snapshot chunk is copied into the replica's buffer this many bytes at a time.
_COPY_STEP = 4 * 1024 * 1024


def advise_huge_pages(buf: Any) -> bool:
    """Ask Linux to back ``buf`` (an anonymous ``mmap``, before it is written) with
    transparent huge pages, where the kernel offers them (``enabled`` set to ``always``
    or ``madvise`` under /sys/kernel/mm/transparent_hugepage; Debian's default is
    ``madvise``). A snapshot's graph is searched in place, one random node after another:
    with 4 KB pages nearly every node visited costs a TLB miss and a page walk, with 2 MB
    pages a few hundred entries cover a million-entry graph. At 1M MiniLM embeddings a
    search takes 0.81x as long as in 4 KB pages (p99 0.85x; bench_hnsw --pages;
    docs/BENCHMARKS.md, "hnsw-minilm-1000k-pages"). False where the advice is not
    available (another OS, a kernel without THP); the memory works the same."""
    import mmap

    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        buf.madvise(advice)
    except OSError:  # EINVAL: a kernel built without transparent huge pages
        return False
    return True


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A published index snapshot: its generation, the log position its index is at, and
    what checks its bytes."""

    generation: str
    last_id: str
    added: int
    entries: int
    dim: int
    size: int
    chunks: int
    checksum: str
    created_at: float

    @classmethod
    def parse(cls, raw: Mapping[Any, Any]) -> SnapshotInfo | None:
        f = {text(k): text(v) for k, v in raw.items()}
        if not f or f.get("fmt") not in SNAPSHOT_FORMATS_READ:
            return None
        try:
            return cls(
                generation=f["gen"],
                last_id=f["last_id"],
                added=int(f["added"]),
                entries=int(f["entries"]),
                dim=int(f["dim"]),
                size=int(f["size"]),
                chunks=int(f["chunks"]),
                checksum=f["sum"],
                created_at=float(f["at"]),
            )
        except (KeyError, ValueError):
            return None


def _chunk_keys(k: TenantKeys, info: SnapshotInfo) -> list[str]:
    return [k.snap_chunk(info.generation, i) for i in range(info.chunks)]


def _digester() -> Any:
    """The snapshot checksum's hash, to be fed (``update``) a part at a time."""
    import hashlib

    return hashlib.blake2b(digest_size=16)


def _digest(blob: bytes) -> str:
    digest = _digester()
    digest.update(blob)
    return str(digest.hexdigest())


class SnapshotStore(StorageCore):
    """The snapshot operations (``snapshot.py`` writes, ``replica/indexes.py`` reads)."""

    def snapshot_info_flow(self, tenant: str) -> Flow[SnapshotInfo | None]:
        """The tenant's published index snapshot, or ``None`` (none, or another format)."""
        raw = yield from self.command_flow("snapshot", "hgetall", self.keys(tenant).snap)
        return SnapshotInfo.parse(raw)

    def read_snapshot_flow(self, tenant: str, info: SnapshotInfo) -> Flow[memoryview | None]:
        """The snapshot's bytes, or ``None`` if a chunk is gone (a newer snapshot replaced
        it meanwhile) or they do not match the published size and checksum.

        They are gathered in anonymous memory (``mmap``: its pages are zero until
        written) a few MB at a time, and hashed as they come: no step holds Python's
        GIL for long, where joining a gigabyte of chunks would stall every other thread
        (a lookup) for a large part of a second."""
        import mmap

        k = self.keys(tenant)
        if info.size <= 0:
            return None
        # Private: pages given back with MADV_DONTNEED are freed (see index._release_lead).
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", 0))
        buf = mmap.mmap(-1, info.size, flags=flags)
        advise_huge_pages(buf)
        view = memoryview(buf)
        digest = _digester()
        at = 0
        for i in range(info.chunks):
            chunk = yield from self.command_flow(
                "snapshot", "get", k.snap_chunk(info.generation, i)
            )
            if chunk is None:
                return None
            if at + len(chunk) > info.size:
                break  # more than was published: the size and checksum below decide
            src = memoryview(chunk)
            for lo in range(0, len(src), _COPY_STEP):  # GIL-holding copies stay short
                part = src[lo : lo + _COPY_STEP]
                view[at : at + len(part)] = part
                digest.update(part)  # hashlib lets go of the GIL for large updates
                at += len(part)
            del src, chunk
        if at != info.size or digest.hexdigest() != info.checksum:
            log.warning("tenant %s: index snapshot %s does not check out", tenant, info.generation)
            return None
        return view

    def write_snapshot_flow(
        self,
        tenant: str,
        blob: bytes,
        *,
        fmt: str,
        last_id: str,
        added: int,
        entries: int,
        dim: int,
    ) -> Flow[bool]:
        """Store ``blob``, an index dump of format ``fmt`` (``index.dump_format``), as
        the tenant's index snapshot at log position ``(last_id, added)``: the chunks
        first (unreferenced, with a TTL), then ``snapshot.lua`` publishes them and
        deletes the previous generation. False if another snapshot was published
        meanwhile (this one's chunks expire)."""
        import secrets

        k = self.keys(tenant)
        old = yield from self.snapshot_info_flow(tenant)
        gen = secrets.token_hex(6)
        n = max(1, -(-len(blob) // SNAPSHOT_CHUNK))
        new_keys = [k.snap_chunk(gen, i) for i in range(n)]
        for i, key in enumerate(new_keys):
            part = blob[i * SNAPSHOT_CHUNK : (i + 1) * SNAPSHOT_CHUNK]
            yield from self.command_flow(
                "snapshot", "set", key, part, px=SNAPSHOT_UNPUBLISHED_TTL_MS
            )
        old_keys = [] if old is None else _chunk_keys(k, old)
        fields = {
            "fmt": fmt,
            "last_id": last_id,
            "added": str(int(added)),
            "entries": str(int(entries)),
            "dim": str(int(dim)),
            "size": str(len(blob)),
            "chunks": str(n),
            "sum": _digest(blob),
            "at": repr(time.time()),
        }
        args: list[Any] = ["commit", "" if old is None else old.generation, gen, n]
        for name, value in fields.items():
            args += [name, value]
        plan = ScriptCall("snapshot", [k.snap, *new_keys, *old_keys], args, lambda r: int(r))
        return bool((yield from self.run_flow(plan)))

    def drop_snapshot_flow(self, tenant: str) -> Flow[None]:
        """Delete the tenant's index snapshot (``clear`` does: its vectors may not fit
        the tenant any more)."""
        k = self.keys(tenant)
        info = yield from self.snapshot_info_flow(tenant)
        chunks = [] if info is None else _chunk_keys(k, info)
        yield from self.run_flow(
            ScriptCall("snapshot", [k.snap, *chunks], ["drop"], lambda r: None)
        )

    snapshot_info = op(snapshot_info_flow)
    read_snapshot = op(read_snapshot_flow)
    write_snapshot = op(write_snapshot_flow)
    drop_snapshot = op(drop_snapshot_flow)
