"""What the decision log keeps of each decision for off-policy evaluation, and how the router
explores (``docs/ope.md``).

**Exploration.** A tenant with ``explore_epsilon`` = eps > 0 (``router.core.settings.TenantConfig``)
has each request sent, with probability eps, to an offering drawn uniformly from the set ``A`` it
may go to (valid now, allowed by the constraints, preferred when a prefer rule applies: the
offerings the policy ranked), and to the policy's choice otherwise. The draw is a function of the
decision (:func:`draw`: a keyed hash of the request's ``Idempotency-Key``, else its decision id),
so replaying a decision -- or retrying a request under its key after a failure -- draws the same.
The propensity of the offering served is exact (:func:`propensity`): ``(1 - eps) + eps/|A|`` for
the policy's choice, ``eps/|A|`` for any other; 1 without exploration.

**The record** (``decisions.features``, :func:`pack` / :func:`unpack`): the action set as indices
into the catalog (whose offering ids are kept once per catalog in table ``catalogs``, under
:func:`catalog_key`), the index of the served and of the policy's choice in it, the request vector
and one row per offering of the set -- float32, exactly what the policy saw -- in one compact
little-endian blob, Zstandard-compressed by SQLite's writer process (``router.store.sqlite``; PostgreSQL
compresses such values itself). The
decision's ``propensity`` and ``epsilon`` are columns of their own; the propensity is NULL when
the shared state moved the request off the offering drawn (that pool had no room: the served
offering's probability is then unknown, and the export leaves the decision out).

The logged decision an export writes is ``xroute.schema.ope.LoggedDecision`` (defined there only).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import zstandard

#: the record's layout version (its first byte; a Zstandard frame starts with 0x28)
VERSION = 1
_HEAD = struct.Struct("<BHHHBB8s")  # version, |A|, chosen, policy's choice, F, R, catalog key
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True, slots=True)
class Record:
    """A decision's OPE record, read back."""

    catalog_key: str  #: 16 hex digits: the catalog the indices refer to (table ``catalogs``)
    action_idx: np.ndarray  #: (|A|,) int: catalog indices of the action set, ascending
    chosen: int  #: position in the set of the offering served
    argmax: int  #: position in the set of the policy's choice
    request: np.ndarray  #: (R,) float32
    rows: np.ndarray  #: (|A|, F) float32


def catalog_key(offering_ids: list[str]) -> str:
    """The key a catalog (its offering ids, in order) is kept under: 16 hex digits of a hash."""
    return hashlib.blake2b("\n".join(offering_ids).encode(), digest_size=8).hexdigest()


def draw(key: str) -> tuple[float, float]:
    """Two uniform numbers in [0, 1) that are a function of ``key`` (a keyed 128-bit hash): the
    first decides whether to explore, the second which offering."""
    h = hashlib.blake2b(key.encode(), digest_size=16, person=b"xroute-explore").digest()
    return int.from_bytes(h[:8], "little") / 2.0**64, int.from_bytes(h[8:], "little") / 2.0**64


def propensity(epsilon: float, size: int, is_policy_choice: bool) -> float:
    """P(the served offering | the observation) under eps-greedy over a set of ``size``."""
    if epsilon <= 0.0:
        return 1.0
    return (1.0 - epsilon) + epsilon / size if is_policy_choice else epsilon / size


def pack(key: bytes, idx: np.ndarray, chosen: int, argmax: int, request: np.ndarray, rows: np.ndarray) -> bytes:
    """The record of a decision: ``key`` (:func:`catalog_key`'s 8 bytes), the set's catalog
    indices ``idx`` (ascending), the positions of the served offering and the policy's choice,
    the request vector and the rows (float32)."""
    m, f = rows.shape
    return b"".join((_HEAD.pack(VERSION, m, chosen, argmax, f, request.shape[0], key), idx.astype("<u2").tobytes(),
                     request.astype("<f4", copy=False).tobytes(), rows.astype("<f4", copy=False).tobytes()))


def serving(record: bytes, offering: int) -> bytes:
    """``record`` (uncompressed) with ``offering`` (a catalog index in its action set) as the one
    served."""
    m = _HEAD.unpack_from(record)[1]
    pos = int(np.searchsorted(np.frombuffer(record, "<u2", m, _HEAD.size), offering))
    return record[:3] + struct.pack("<H", pos) + record[5:]


def unpack(blob: bytes) -> Record:
    """:func:`pack`'s record (compressed or not) back."""
    raw = bytes(blob)
    if raw[:4] == _ZSTD_MAGIC:
        raw = zstandard.ZstdDecompressor().decompress(raw)
    version, m, chosen, argmax, f, r, key = _HEAD.unpack_from(raw)
    if version != VERSION:
        raise ValueError(f"an OPE record of layout {version}; this version reads {VERSION}")
    at = _HEAD.size
    idx = np.frombuffer(raw, "<u2", m, at).astype(np.int64)
    at += 2 * m
    request = np.frombuffer(raw, "<f4", r, at).astype(np.float32)
    at += 4 * r
    rows = np.frombuffer(raw, "<f4", m * f, at).astype(np.float32).reshape(m, f)
    return Record(key.hex(), idx, chosen, argmax, request, rows)

