"""The exception hierarchy: one base class, ``ZerdaError``.

An application can catch ``ZerdaError`` around any cache call and carry on as if it were a
miss. Errors about bad input also derive from ``ValueError`` (or ``KeyError`` for unknown
entries) so that generic handlers keep working. Errors raised because Redis failed keep
the client's exception as ``__cause__`` (``raise ... from``).
"""

from __future__ import annotations


class ZerdaError(Exception):
    """Base class of every error zerda-cache raises on purpose."""


class InvalidTenantError(ZerdaError, ValueError):
    """A tenant id that is not ``[A-Za-z0-9._-]{1,64}``."""


class InvalidEmbeddingError(ZerdaError, ValueError):
    """An embedding that is not a finite, non-zero vector of the tenant's dimension."""


class DimensionMismatchError(InvalidEmbeddingError):
    """An embedding whose dimension differs from the one the tenant was created with."""

    def __init__(self, tenant: str, expected: int, got: int) -> None:
        super().__init__(
            f"tenant {tenant!r} stores {expected}-dimensional embeddings, got {got} dimensions"
        )
        self.tenant = tenant
        self.expected = expected
        self.got = got


class InvalidFeedbackError(ZerdaError, ValueError):
    """A feedback signal with a bad magnitude, entry id or source."""


class InvalidEntryError(ZerdaError, ValueError):
    """Bad content for an entry: empty query, oversized answer, bad metadata, ..."""


class InvalidSettingError(ZerdaError, ValueError):
    """A setting out of range: a tenant policy value (``set_tenant_policy``), or a
    per-call option such as ``lookup(max_error_rate=...)``."""


class EntryNotFoundError(ZerdaError, KeyError):
    """The entry does not exist in that tenant (never did, was evicted, or belongs to
    another tenant: keys are per tenant, so the two cannot be told apart)."""

    def __init__(self, tenant: str, entry_id: str) -> None:
        super().__init__(f"no entry {entry_id!r} in tenant {tenant!r}")
        self.tenant = tenant
        self.entry_id = entry_id

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class CorruptEntryError(ZerdaError):
    """A stored value that does not decode (bad msgpack, wrong shape, unknown schema)."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"corrupt value in {key}: {detail}")
        self.key = key
        self.detail = detail


class SchemaVersionError(CorruptEntryError):
    """A stored value written by another version of zerda-cache (its schema version is
    unknown here): not corrupt, only unreadable by this one, so never reported for
    eviction (a rolling upgrade must not delete the new version's entries)."""


class StorageError(ZerdaError):
    """Redis failed (connection, timeout, script error); the cause is chained."""


class StorageUnavailable(StorageError):
    """Redis could not be reached or did not answer: a connection refused or lost, a
    timeout, a server still loading its data, busy running a script, a cluster that is
    down or a replica that refuses writes. Every call fails alike until it is back (an
    outage), unlike a reply error about one key or one tenant's data (a script error, a
    key of another type: a ``StorageError`` only), after which other calls go on."""


class FencedError(StorageError):
    """A worker cycle's write refused: a worker with a newer lease has written to the
    tenant since (this one stalled past its lease). Nothing was written."""
