"""Encoding of everything stored in Redis: msgpack maps and raw vectors (float16 by
default, or float32: ``vector_storage``).

Only msgpack and raw float16 or float32 bytes are ever decoded from Redis (no pickle, no
eval), and every decoder checks the shape it gets: a value that does not decode is
reported as ``CorruptEntryError`` naming its key, never a crash deeper down.

Entry hash fields (see ``storage/keys.py`` for the keys):

========  ==========================================================================
``doc``   msgpack ``{v, q: query, r: response, m: metadata}`` (written by Python)
``vec``   the L2-normalised embedding as little-endian float32 bytes, or (``float16``
          storage) ``h`` then little-endian float16 bytes
``meta``  msgpack ``{v, ct: created_at, ttl, sc: scope, dim[, tg: tags][, us: usage]}``
          (written by the put script)
``dg``    digest of (normalised query, scope): the exact-match key
``wh``    msgpack list: the numbers of the entry's last hits counted wrong in the
          savings (feedback.lua; absent until one is)
========  ==========================================================================

An entry's learning state is its field of the tenant's state hash ``st``: 15
little-endian float64 (120 bytes, ``STATE_FIELDS``; ``ZC_STATE`` in lua/_lib.lua):

=========  =========================================================================
``arm``    ``a`` alpha, ``b`` beta, ``n`` pulls, ``r`` reward_sum, ``t`` decayed_at
``use``    ``un`` usage_count, ``la`` last_access, ``c`` confidence, ``v`` version (bumped
           by every hit and feedback: eviction's "changed since scored" check), ``ss``
           similarity, ``qs`` quality, ``sb`` the entry's own similarity bar, ``pm`` the
           lowest similarity of a positive signal, ``ns`` the run of negative signals
``sz``     bytes of doc + vec, for the tenant's byte count (NaN: unknown)
=========  =========================================================================

Fixed-width numbers, not msgpack maps: the worker's scan decodes a batch of states as one
numpy array. The hit script returns the state as it wrote it (``trusted_state``); the
feedback script returns ``arm`` and ``use`` as msgpack maps (``{a, b, n, r, t}`` and
``{n, la, c, v, ss, qs, sb, pm[, ns]}``: ``trusted_arm``, ``trusted_use``).

Entries written by zerda-cache 0.1 hold msgpack ``arm`` and ``use`` maps and ``sz`` as
fields of their own hash, which the scripts move to ``st`` the first time they touch the
entry (``zc_raw_state`` in lua/_lib.lua); the readers here take either.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt

from zerda_cache.core.config import CacheConfig
from zerda_cache.core.entry import BanditArm, LLMUsage
from zerda_cache.core.errors import (
    CorruptEntryError,
    InvalidEmbeddingError,
    InvalidEntryError,
    SchemaVersionError,
)
from zerda_cache.core.validation import (
    check_query,
    check_response,
    check_scope,
    check_tags,
    check_text,
    finite_number,
    whole_number,
)

SCHEMA_VERSION = 1
_VEC_DTYPE = np.dtype("<f4")
_VEC16_DTYPE = np.dtype("<f2")
_F16_MARK = b"h"

Vector = npt.NDArray[np.float32]


def text(value: bytes | str) -> str:
    """A reply value as ``str`` (clients are created with ``decode_responses=False``)."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


# --- vectors -------------------------------------------------------------------------------
def normalize_vector(embedding: object) -> Vector:
    """Validate an embedding and return it L2-normalised as a float32 vector.

    Raises:
        InvalidEmbeddingError: not a 1-D vector of real numbers (bools, strings, complex
            numbers and other objects are refused, never converted), empty, NaN/inf, or
            zero norm.
    """
    if type(embedding) is np.ndarray and embedding.dtype == np.float32 and embedding.ndim == 1:
        # The common case (an embedding model's float32 vector): its squared norm in
        # float64 cannot overflow (384 * 3.4e38 ** 2 is ~1e80) nor warn, so no errstate.
        sq = float(np.dot(wide := embedding.astype(np.float64), wide))
        if 0.0 < sq < math.inf:
            return (wide / math.sqrt(sq)).astype(np.float32)
    try:
        raw = np.asarray(embedding)
    except (TypeError, ValueError) as exc:
        raise InvalidEmbeddingError(f"embedding is not a numeric vector: {exc}") from exc
    if raw.dtype.kind not in "fiu":
        raise InvalidEmbeddingError(
            f"embedding must hold real numbers, got {raw.dtype} values"
            + (" (complex: take .real yourself if that is meant)" if raw.dtype.kind == "c" else "")
        )
    arr = raw.astype(np.float64, copy=False)
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidEmbeddingError(
            f"embedding must be a non-empty 1-D vector, got shape {arr.shape}"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        sq = float(np.dot(arr, arr))
    if 0.0 < sq < math.inf:  # the common case: finite, non-zero, no overflow
        return (arr / math.sqrt(sq)).astype(np.float32)
    if not np.all(np.isfinite(arr)):
        raise InvalidEmbeddingError("embedding contains NaN or infinite values")
    scale = float(np.max(np.abs(arr)))
    if scale == 0.0:
        raise InvalidEmbeddingError("embedding is all zeros: it has no direction")
    arr = arr / scale  # a huge-but-finite vector: its squared norm overflowed
    return (arr / float(np.linalg.norm(arr))).astype(np.float32)


def encode_vector(embedding: object, storage: str = "float32") -> bytes:
    """``normalize_vector`` then raw little-endian float32 bytes, or (``storage``
    ``"float16"``) the marker byte ``h`` and little-endian float16 bytes: an odd length,
    which no float32 vector has."""
    vec = normalize_vector(embedding)
    if storage == "float16":
        return _F16_MARK + vec.astype(_VEC16_DTYPE).tobytes()
    return vec.astype(_VEC_DTYPE, copy=False).tobytes()


def vector_dim(raw: bytes) -> int:
    """The dimension of an encoded vector (either storage)."""
    return (len(raw) - 1) // 2 if len(raw) % 2 else len(raw) // 4


#: How far a stored vector's squared norm may be from 1. Every vector is stored
#: L2-normalised (``encode_vector``), which float32 rounding leaves within ~1e-6; one
#: further off (all zeros, values written around the put script) is corrupt: it would
#: match nothing, or match with a similarity that means nothing.
UNIT_TOLERANCE = 1e-3


def decode_vector(raw: bytes, *, key: str = "?", dim: int | None = None) -> Vector:
    """A stored vector, checked: finite, of unit length and (``dim``) of the tenant's
    dimension; ``CorruptEntryError`` otherwise."""
    if not isinstance(raw, bytes | bytearray) or len(raw) == 0:
        raise CorruptEntryError(key, "vec is empty or not bytes")
    if len(raw) % 2 and raw[:1] == _F16_MARK and len(raw) > 1:
        vec = np.frombuffer(raw, dtype=_VEC16_DTYPE, offset=1).astype(np.float32)
        norm = float(np.linalg.norm(vec))
        if np.isfinite(norm) and norm > 0:
            vec /= norm  # rounding to float16 moved it off the unit sphere a little
    elif len(raw) % 4 == 0:
        vec = np.frombuffer(raw, dtype=_VEC_DTYPE).astype(np.float32)
    else:
        raise CorruptEntryError(key, "vec is neither float32 nor marked float16 values")
    if dim is not None and len(vec) != dim:
        raise CorruptEntryError(key, f"vec has {len(vec)} dimensions, the tenant's {dim}")
    sq = float(np.dot(vec, vec))
    if not abs(sq - 1.0) <= UNIT_TOLERANCE:  # NaN fails this too
        if not np.all(np.isfinite(vec)):
            raise CorruptEntryError(key, "vec holds NaN or infinite values")
        raise CorruptEntryError(key, f"vec is not of unit length (squared norm {sq:.6g})")
    return vec


# --- query digest --------------------------------------------------------------------------
def normalize_query(query: str) -> str:
    """NFKC, case-folded, whitespace collapsed: what counts as the same question."""
    if query.isascii():  # NFKC leaves ASCII as it is, and casefold is lower there
        return " ".join(query.lower().split())
    return " ".join(unicodedata.normalize("NFKC", query).casefold().split())


_DIGEST_RE = re.compile(rb"[0-9a-f]{40}")


def check_digest(raw: object, *, key: str = "?") -> None:
    """An entry's ``dg`` field (its ``query_digest``, by which eviction takes it out of
    the exact-match map), if present, is one; ``CorruptEntryError`` otherwise."""
    if raw is not None and not (isinstance(raw, bytes) and _DIGEST_RE.fullmatch(raw)):
        raise CorruptEntryError(key, "dg is not a query digest")


def query_digest(query: str, scope: str = "") -> str:
    """Hex sha256 of (normalised query, scope): the exact-match key of an entry."""
    h = hashlib.sha256()
    h.update(scope.encode("utf-8"))
    h.update(b"\x00")
    h.update(normalize_query(query).encode("utf-8"))
    return h.hexdigest()[:40]


# --- msgpack -------------------------------------------------------------------------------
def _check_metadata(value: object, path: str, depth: int = 0) -> None:
    if depth > 16:
        raise InvalidEntryError(f"metadata nested deeper than 16 levels at {path}")
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidEntryError(f"metadata key {k!r} at {path} is not a str")
            check_text(k, f"metadata key at {path}")
            _check_metadata(v, f"{path}.{k}", depth + 1)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_metadata(v, f"{path}[{i}]", depth + 1)
    elif value is None or isinstance(value, str | bytes | bool | int | float):
        if isinstance(value, str):
            check_text(value, f"metadata value at {path}")
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise InvalidEntryError(f"metadata integer at {path} does not fit in 64 bits")
    else:
        raise InvalidEntryError(
            f"metadata value at {path} has unserialisable type {type(value).__name__}"
        )


def pack_doc(
    query: str,
    response: str,
    metadata: Mapping[str, Any] | None,
    *,
    max_metadata_bytes: int | None = None,
) -> bytes:
    """Pack an entry's immutable content; metadata must be str-keyed msgpack-able data.

    Raises:
        InvalidEntryError: a non-str key, an unserialisable value, or metadata packing to
            more than ``max_metadata_bytes``.
    """
    if metadata is not None and not isinstance(metadata, Mapping):
        raise InvalidEntryError(f"metadata must be a mapping, got {type(metadata).__name__}")
    meta = dict(metadata) if metadata else {}
    _check_metadata(meta, "metadata")
    if max_metadata_bytes is not None:
        packed = len(msgpack.packb(meta, use_bin_type=True))
        if packed > max_metadata_bytes:
            raise InvalidEntryError(
                f"metadata packs to {packed} bytes, over max_metadata_bytes={max_metadata_bytes}"
            )
    return bytes(
        msgpack.packb(
            {"v": SCHEMA_VERSION, "q": query, "r": response, "m": meta}, use_bin_type=True
        )
    )


class CheckedDoc(NamedTuple):
    """An entry's content as ``checked_doc`` checked it: its doc packed, and its scope,
    tags and usage as the put script takes them."""

    query: str
    doc: bytes
    scope: str
    tags: tuple[str, ...]
    usage: LLMUsage | None


def checked_doc(
    cfg: CacheConfig,
    query: object,
    response: object,
    metadata: Mapping[str, Any] | None,
    *,
    scope: object = None,
    tags: object = None,
    usage: object = None,
) -> CheckedDoc:
    """The checks of an entry's content, with ``cfg``'s limits (``max_query_chars``,
    ``max_response_bytes``, ``max_metadata_bytes``, the scope's length, the tags, the
    usage), and its doc packed. A put and an import both call this one function, so a
    limit a put gains applies to what an import writes too.

    Raises:
        InvalidEntryError: a value a put refuses.
    """
    query = check_query(query, cfg.max_query_chars)
    response = check_response(response, cfg.max_response_bytes)
    checked_scope = check_scope(scope)
    checked_tags = check_tags(tags)
    checked_usage = LLMUsage.of(usage)
    doc = pack_doc(query, response, metadata, max_metadata_bytes=cfg.max_metadata_bytes)
    return CheckedDoc(query, doc, checked_scope, checked_tags, checked_usage)


def _unpack_map(raw: object, key: str, field: str) -> dict[str, Any]:
    if not isinstance(raw, bytes | bytearray):
        raise CorruptEntryError(key, f"{field} is missing")
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptEntryError(key, f"{field} is not valid msgpack ({exc})") from exc
    if not isinstance(value, dict):
        raise CorruptEntryError(key, f"{field} is a {type(value).__name__}, not a map")
    return value


def _num(value: dict[str, Any], name: str, key: str, field: str) -> float:
    """``value[name]`` as a float, if it is one that is finite (``finite_number``: no
    bool, NaN, infinity, nor an int past a float's range), else ``CorruptEntryError``.
    Every number a decoder reads goes through here or ``_whole``, so that a number
    written around the scripts is a corrupt entry, never an ``OverflowError`` later."""
    x = finite_number(value.get(name))
    if x is None:
        raise CorruptEntryError(key, f"{field}.{name} is not a finite number: {value.get(name)!r}")
    return x


def _whole(value: object, what: str, key: str, low: int = 0, high: int = 2**53) -> int:
    """``value`` as an int, if it is a whole number in ``[low, high]`` (``whole_number``),
    else ``CorruptEntryError``."""
    n = whole_number(value, low, high)
    if n is None:
        raise CorruptEntryError(key, f"{what} is not a whole number in [{low}, {high}]: {value!r}")
    return n


def unpack_doc(raw: object, *, key: str = "?") -> tuple[str, str, dict[str, Any]]:
    """Return (query, response, metadata)."""
    doc = _unpack_map(raw, key, "doc")
    if doc.get("v") != SCHEMA_VERSION:
        raise SchemaVersionError(key, f"doc has unknown schema version {doc.get('v')!r}")
    q, r, m = doc.get("q"), doc.get("r"), doc.get("m")
    if not isinstance(q, str) or not isinstance(r, str) or not isinstance(m, dict):
        raise CorruptEntryError(key, "doc lacks query, response or metadata")
    return q, r, m


def unpack_arm(raw: object, *, key: str = "?") -> BanditArm:
    return _arm(_unpack_map(raw, key, "arm"), key)


def _arm(arm: dict[str, Any], key: str) -> BanditArm:
    for name in ("a", "b"):
        if _num(arm, name, key, "arm") <= 0:
            raise CorruptEntryError(key, f"arm.{name} must be > 0, got {arm[name]!r}")
    return BanditArm(
        alpha=_num(arm, "a", key, "arm"),
        beta=_num(arm, "b", key, "arm"),
        pulls=_whole(arm.get("n"), "arm.n", key),
        reward_sum=_num(arm, "r", key, "arm"),
        decayed_at=_num(arm, "t", key, "arm"),
    )


@dataclass(frozen=True, slots=True)
class Use:
    """The decoded ``use`` field."""

    count: int
    last_access: float
    confidence: float
    version: int
    similarity: float
    quality: float
    similarity_bar: float
    min_positive_similarity: float
    #: ``ns``, absent from entries written before it existed (read as 0).
    negative_streak: int = 0


def unpack_use(raw: object, *, key: str = "?") -> Use:
    return _use(_unpack_map(raw, key, "use"), key)


def _use(use: dict[str, Any], key: str) -> Use:
    return Use(
        count=_whole(use.get("n"), "use.n", key),
        last_access=_num(use, "la", key, "use"),
        confidence=_num(use, "c", key, "use"),
        version=_whole(use.get("v"), "use.v", key),
        similarity=_num(use, "ss", key, "use"),
        quality=_num(use, "qs", key, "use"),
        similarity_bar=_num(use, "sb", key, "use"),
        min_positive_similarity=_num(use, "pm", key, "use"),
        negative_streak=_streak(use, key),
    )


#: A run of negative signals past this is corrupt, as the scripts' ``zc_valid_streak``
#: (``ns < 1e9``) and the scan (``state_columns``) call it.
MAX_STREAK = 10**9 - 1
#: A size (``sz``) past this is not one: evict.lua takes a size of ``2**53`` or more as
#: unknown (a float64 no longer holds every whole number past it).
MAX_SIZE = 2**53 - 1


def _streak(use: dict[str, Any], key: str) -> int:
    """``ns``: absent (0) or a whole number in [0, ``MAX_STREAK``]."""
    if "ns" not in use:
        return 0
    return _whole(use["ns"], "use.ns", key, 0, MAX_STREAK)


#: The fields of a state, in order (see the module's docstring).
STATE_FIELDS = ("a", "b", "n", "r", "t", "un", "la", "c", "v", "ss", "qs", "sb", "pm", "ns", "sz")
STATE_BYTES = 8 * len(STATE_FIELDS)
_STATE = struct.Struct("<" + "d" * len(STATE_FIELDS))


def unpack_state(raw: object, *, key: str = "?") -> tuple[BanditArm, Use, int]:
    """Decode an entry's state (its field of the state hash), checked as the scripts
    check it (``zc_state``), with the counts (``n``, ``un``, ``v``, ``ns``) and ``sz``
    whole numbers in range too (``_whole``: ``sz`` at most ``MAX_SIZE``)."""
    if not isinstance(raw, bytes | bytearray):
        raise CorruptEntryError(key, "state is missing")
    if len(raw) != STATE_BYTES:
        raise CorruptEntryError(key, f"state is {len(raw)} bytes, not {STATE_BYTES}")
    f = dict(zip(STATE_FIELDS, _STATE.unpack(raw), strict=True))
    arm = {name: f[name] for name in ("a", "b", "n", "r", "t")}
    use = {"n": f["un"], **{name: f[name] for name in ("la", "c", "v", "ss", "qs", "sb", "pm")}}
    if f["ns"]:
        use["ns"] = f["ns"]
    for part, values in (("arm", arm), ("use", use)):  # zc_all_numbers: a finite sum
        if not math.isfinite(sum(values.values())):
            raise CorruptEntryError(key, f"{part} holds a number that is not finite")
    size = _whole(f["sz"], "sz", key, 0, MAX_SIZE)
    return _arm(arm, key), _use(use, key), size


def state_with_size(raw: object, size: int, *, key: str = "?") -> bytes:
    """A state with its ``sz`` set to ``size``: an import computes an entry's size
    itself, as the put script does (``#doc + #vec``), rather than take the one in its
    file (the tenant's byte count adds it up). The file's ``sz`` must be a finite number
    (the worker's scan calls any other state corrupt: ``state_columns``), of any value:
    it is replaced. The rest is for ``unpack_state`` to check, on the state returned.

    Raises:
        CorruptEntryError: ``raw`` is not a state's 120 bytes, or its ``sz`` is not finite.
    """
    if not isinstance(raw, bytes | bytearray) or len(raw) != STATE_BYTES:
        raise CorruptEntryError(key, f"state is not {STATE_BYTES} bytes")
    values = list(_STATE.unpack(raw))
    at = STATE_FIELDS.index("sz")
    if not math.isfinite(values[at]):
        raise CorruptEntryError(key, f"sz is not a finite number: {values[at]!r}")
    values[at] = float(size)
    return _STATE.pack(*values)


def trusted_arm(raw: bytes) -> BanditArm:
    """Decode an arm a script has just packed (no shape checks: the hot path)."""
    d = msgpack.unpackb(raw, raw=False)
    return BanditArm(float(d["a"]), float(d["b"]), int(d["n"]), float(d["r"]), float(d["t"]))


def trusted_use(raw: bytes) -> Use:
    """Decode a ``use`` map a script has just packed (no shape checks)."""
    d = msgpack.unpackb(raw, raw=False)
    return Use(
        int(d["n"]),
        float(d["la"]),
        float(d["c"]),
        int(d["v"]),
        float(d["ss"]),
        float(d["qs"]),
        float(d["sb"]),
        float(d["pm"]),
        int(d.get("ns", 0)),
    )


def trusted_state(raw: bytes) -> tuple[BanditArm, Use]:
    """Decode a state a script has just packed and checked (``zc_pack_state``; no checks
    here: the hit path). The size is left out: no caller of this needs it."""
    a, b, n, r, t, un, la, c, v, ss, qs, sb, pm, ns, _ = _STATE.unpack(raw)
    return BanditArm(a, b, int(n), r, t), Use(int(un), la, c, int(v), ss, qs, sb, pm, int(ns))


#: ``state_columns``' values, in order: alpha, beta, decayed_at, uses, last access,
#: confidence, version, size.
STATE_COLUMNS = 8
#: Where ``state_columns``' values are in a state.
_COLUMNS = [STATE_FIELDS.index(name) for name in ("a", "b", "t", "un", "la", "c", "v", "sz")]


def state_columns(
    states: Sequence[bytes | None],
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float64]]:
    """Decode the states of a batch of entries (the worker's scan, lua/state.lua) into a
    status per entry (1 fine, 0 gone: no state, -1 corrupt) and an n x
    ``STATE_COLUMNS`` matrix of values (zeros unless fine).

    Corrupt is what the scripts that write arms call corrupt (``zc_state``: not 120
    bytes, arm or use fields whose sum is not finite, alpha or beta not positive, a run
    of negatives that is not a whole number in [0, 1e9)) and, as the scan needs the
    size, a ``sz`` that is not finite. The whole batch is one numpy array, a small
    fraction of the cost of decoding two msgpack maps an entry (docs/design.md, "The
    worker's cycle"; bench_worker times the scan)."""
    n = len(states)
    status = np.zeros(n, dtype=np.int8)
    values = np.zeros((n, STATE_COLUMNS), dtype=np.float64)
    present = [i for i, raw in enumerate(states) if raw is not None]
    sized = [i for i in present if len(states[i] or b"") == STATE_BYTES]
    status[present] = -1
    if not sized:
        return status, values
    mat = np.frombuffer(b"".join([states[i] or b"" for i in sized]), dtype="<f8")
    mat = mat.reshape(len(sized), len(STATE_FIELDS))
    with np.errstate(over="ignore", invalid="ignore"):
        arm_sum = mat[:, 0:5].sum(axis=1)  # zc_all_numbers' test: a sum that is not
        use_sum = mat[:, 5:13].sum(axis=1)  # finite (NaN and infinities carry into it)
        ns = mat[:, 13]
        fine = (
            np.isfinite(arm_sum)
            & np.isfinite(use_sum)
            & (mat[:, 0] > 0)
            & (mat[:, 1] > 0)
            & (ns >= 0)
            & (ns < 1e9)
            & (ns == np.floor(ns))
            & np.isfinite(mat[:, 14])
        )
    at = np.array(sized, dtype=np.int64)
    status[at[fine]] = 1
    values[at[fine]] = mat[fine][:, _COLUMNS]
    return status, values


def unpack_meta(raw: object, *, key: str = "?") -> dict[str, Any]:
    """Return the meta map with numbers as floats, checked."""
    meta = _unpack_map(raw, key, "meta")
    if meta.get("v") != SCHEMA_VERSION:
        raise SchemaVersionError(key, f"meta has unknown schema version {meta.get('v')!r}")
    out: dict[str, Any] = {name: _num(meta, name, key, "meta") for name in ("ct", "ttl")}
    out["dim"] = _whole(meta.get("dim"), "meta.dim", key, 1, 2**31 - 1)
    scope = meta.get("sc", "")
    if not isinstance(scope, str):
        raise CorruptEntryError(key, "meta.sc is not a str")
    out["sc"] = scope
    tags = meta.get("tg", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise CorruptEntryError(key, "meta.tg is not a list of str")
    out["tg"] = tuple(tags)
    usage = meta.get("us")
    out["us"] = None
    if usage is not None:
        out["us"] = _usage(usage, key)
    return out


def _usage(usage: object, key: str) -> LLMUsage:
    """``meta.us``, ``[model, prompt_tokens, completion_tokens]``, as ``LLMUsage`` checks
    a put's (token counts whole numbers in [0, 2**31): an infinite count is corrupt)."""
    if not isinstance(usage, list | tuple) or len(usage) != 3:
        raise CorruptEntryError(key, f"meta.us is not [model, prompt, completion]: {usage!r}")
    model, prompt, completion = usage
    try:
        return LLMUsage(
            model,
            _whole(prompt, "meta.us prompt tokens", key, 0, 2**31 - 1),
            _whole(completion, "meta.us completion tokens", key, 0, 2**31 - 1),
        )
    except InvalidEntryError as exc:
        raise CorruptEntryError(key, f"meta.us is not a usage: {exc}") from None
