"""A canary rollout in the decision path (``docs/policies.md``, "Canary rollouts").

While the policy store's set holds a canary (``xroute.schema.policy_ir.Canary``), each decision's
arm is chosen by :func:`in_canary`: the first 8 bytes of ``blake2b(id + "\\x00" + key)`` read as an
unsigned big-endian integer, below ``share`` percent of 2**64 -- a function of the canary's id and
the request's key alone, so every router, worker and restart puts a key in the same arm, and a key
in the canary at one share stays in it at any higher share (the id, not the share, is hashed).

The key (the canary's ``key``): ``tenant`` -- the caller's tenant; ``session`` -- the request's
``session_id``, or its request id when it has none; ``request`` -- the request id (the
``X-Request-ID`` the router answers with; every attempt of one gateway request shares it), else the
decision id.

:class:`CanaryArms` is the canary compiled once when its version is installed (the canary set as
the stable one is, with its own outcome buffers): choosing the arm is one hash and a comparison.
It also counts, per arm, what the decision log does not hold -- the exclusions of the decisions
made and the refusals by error -- until the policy sync adds them to the store's tallies
(:meth:`CanaryArms.drain`; ``router.store.policies.PolicyStore.add_tallies``).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from envs import policies as env_policies
from xroute.schema.policy_ir import Canary

#: the arms' names (index: whether the canary decides)
ARMS = ("stable", "canary")
#: 2**64: the hash's range
_SPAN = 1 << 64


def threshold(share: float) -> int:
    """The hash values below which a key is in a canary of ``share`` percent."""
    return min(_SPAN, round(share / 100.0 * _SPAN))


def bucket(canary_id: str, key: str) -> int:
    """The key's hash for the canary ``canary_id``: 0 <= value < 2**64."""
    digest = hashlib.blake2b(f"{canary_id}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def in_canary(canary_id: str, key: str, share: float) -> bool:
    """Whether ``key`` is in the canary arm of ``canary_id`` at ``share`` percent (module docstring)."""
    return bucket(canary_id, key) < threshold(share)


class CanaryArms:
    """A running canary compiled for one catalog: its set, its outcome buffers, the arm labels the
    decision log keeps (``stable:<id>``, ``canary:<id>``), the answers' ``policies`` heads, and
    the per-arm tallies not yet written to the store."""

    def __init__(self, canary: Canary, compiled: env_policies.CompiledPolicies, store_version: int):
        self.canary = canary
        self.id, self.key, self.share, self.version = canary.id, canary.key, canary.share, canary.version
        self.limit = threshold(canary.share)
        self._salt = f"{canary.id}\x00"
        self.compiled = compiled
        self.buffers = compiled.outcome_buffers()
        self.labels = (f"stable:{canary.id}", f"canary:{canary.id}")
        ref = json.dumps({"id": canary.id, "version": canary.version, "key": canary.key, "share": canary.share},
                         separators=(",", ":"))
        #: the answers' ``"policies":{`` heads for each arm (the store's version in force, then the arm)
        self.heads = (f'{{"version":{store_version},"arm":"stable","canary":{ref},',
                      f'{{"version":{store_version},"arm":"canary","canary":{ref},')
        #: (arm, kind, reason) -> count, since the last :meth:`drain`
        self.tallies: Counter[tuple[str, str, str]] = Counter()
        #: (arm, compiled set's id) -> (the compiled set, its policies' exclusions by rank), since the last drain
        self._pcounts: dict[tuple[bool, int], tuple[Any, np.ndarray]] = {}

    def carry(self, old: CanaryArms) -> None:
        """Take over what ``old`` (an earlier version of the same canary) counted and did not drain."""
        self.tallies.update(old.tallies)
        for k, v in old._pcounts.items():
            self._pcounts.setdefault(k, v)

    def choose(self, key: str) -> bool:
        """True: ``key`` is in the canary arm."""
        digest = hashlib.blake2b((self._salt + key).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") < self.limit

    def describe(self) -> dict[str, Any]:
        c = self.canary
        return {"id": c.id, "key": c.key, "share": c.share, "version": c.version, "base_version": c.base_version,
                "started_at": c.started_at, "principal": c.principal, "description": c.description,
                "policies": len(c.policy_set.policies)}

    def excluded(self, canary: bool, ccounts: dict[str, int], pcounts: tuple[Any, Any] | None,
                 env: Sequence[tuple[str, int]]) -> None:
        """Count a decision's exclusions under its arm: the constraint layers' (``ccounts``), the
        routing policies' (``pcounts``: their compiled set and counts by rank, added as one array)
        and the rest (``env``: (reason, count) pairs, zeros skipped)."""
        t = self.tallies
        arm = ARMS[canary]
        for reason, n in ccounts.items():
            t[(arm, "excluded", reason)] += n
        for reason, n in env:
            if n:
                t[(arm, "excluded", reason)] += n
        if pcounts is not None:
            compiled, counts = pcounts
            acc = self._pcounts.get((canary, id(compiled)))
            if acc is None:
                acc = self._pcounts[(canary, id(compiled))] = (compiled, np.zeros(compiled.R, dtype=np.int64))
            total = acc[1]
            total += counts[: compiled.R]

    def denied(self, canary: bool, error: str) -> None:
        self.tallies[(ARMS[canary], "denied", error)] += 1

    def drain(self) -> list[tuple[str, str, str, str, int]]:
        """The tallies since the last drain as (canary id, arm, kind, reason, count) rows
        (the store's), emptied."""
        t, self.tallies = self.tallies, Counter()
        acc, self._pcounts = self._pcounts, {}
        for (canary, _), (compiled, counts) in acc.items():
            for k in np.flatnonzero(counts).tolist():
                t[(ARMS[canary], "excluded", compiled.reasons[k])] += int(counts[k])
        return [(self.id, arm, kind, reason, n) for (arm, kind, reason), n in t.items() if n]


__all__ = ["ARMS", "CanaryArms", "bucket", "in_canary", "threshold"]
