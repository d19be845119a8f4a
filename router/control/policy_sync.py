"""Keeps a router's routing policies in step with the policy store (``router.store.policies``).

At start :meth:`PolicySync.start` applies the router's ``policy_files`` to the store (when their
content changed since they were last applied) and installs the store's head. While serving,
:meth:`PolicySync.run` reads the head's version every ``policy_poll_s`` (about a second); a new
version is read and compiled off the event loop, then swapped in between two decisions
(``RoutingEngine.install_policies``): every decision sees one whole set, on every worker and host
sharing the store, each within ``policy_poll_s`` of the change. A change made through this
router's admin API (:meth:`PolicySync.write`) is installed here as soon as it is committed.
"""

from __future__ import annotations

import asyncio
import getpass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.core.logs import LOG
from router.core.text import one_line
from router.decision.engine import RoutingEngine
from router.store.policies import Mutation, PolicyStore, PolicyStoreError
from xroute.config import load_policies
from xroute.errors import ConfigError
from xroute.schema.policy_ir import ConstraintError, PolicySet


def cli_principal() -> str:
    """Who changes the store from the command line: ``cli:<user>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:
        return "cli:unknown"


def read_policy_files(paths: Sequence[Path | str], check: Any = None) -> PolicySet:
    """The policy files' set (``xroute.config.load_policies``: a ``ConfigError`` naming the file and
    the field), its values checked with ``check(ps, prefix)`` (a router's catalog) when given."""
    files = load_policies(*paths)
    if check is not None:
        try:
            check(files, "policy_files")
        except ConstraintError as e:
            raise ConfigError(f"{', '.join(map(str, paths))}: {e}") from None
    return files


def apply_policy_files(store: PolicyStore, paths: Sequence[Path | str], principal: str,
                       check: Any = None) -> PolicySet | None:
    """:func:`read_policy_files`, applied to the store when they changed since they were last
    applied (``PolicyStore.apply_files``). Returns the new head set, or None."""
    return store.apply_files(principal, read_policy_files(paths, check), [str(p) for p in paths])


class PolicySync:
    """The engine's policies, from the store (module docstring)."""

    def __init__(self, engine: RoutingEngine, store: PolicyStore, files: Sequence[Path] = (), poll_s: float = 1.0):
        self.engine, self.store, self.files, self.poll_s = engine, store, list(files), poll_s
        self.last_error: str | None = None
        self.swaps = 0
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Apply the policy files (if changed) and install the head, before the first decision.
        A bad policy file is a ``ConfigError`` (the router does not start)."""
        if self.files:
            principal = "config:" + ",".join(str(f) for f in self.files)
            new = await asyncio.to_thread(apply_policy_files, self.store, self.files, principal,
                                          self.engine.check_policies)
            if new is not None:
                LOG.info("policy files applied to the policy store", extra={"fields": {
                    "files": [str(f) for f in self.files], "version": new.version}})
        await self.check()

    async def check(self) -> bool:
        """Install the store's head if it is newer than the engine's set; True when swapped."""
        head = await asyncio.to_thread(self.store.head)
        if head <= self.engine.policy_version:
            return False
        ps = await asyncio.to_thread(self.store.at, head)
        return await self.install(ps)

    async def install(self, ps: PolicySet) -> bool:
        async with self._lock:
            if ps.version <= self.engine.policy_version:  # (a newer one came first)
                return False
            compiled = await asyncio.to_thread(self.engine.compile_policies, ps)
            canary = await asyncio.to_thread(self.engine.compile_canary, ps)
            if ps.version <= self.engine.policy_version:
                return False
            checks = [("policy set", ps)] + ([("canary's policy set", ps.canary.policy_set)] if ps.canary else [])
            for what, checked in checks:
                try:
                    self.engine.check_policies(checked)
                except ConstraintError as e:  # stored for another catalog: those values match nothing here
                    LOG.warning(f"{what} names values this router's catalog lacks (they match nothing here)",
                                extra={"fields": {"version": ps.version, "problem": str(e)}})
            self.engine.install_policies(compiled, canary)
            self.swaps += 1
            LOG.info("routing policies installed", extra={"fields": {
                "version": ps.version, "policies": len(ps.policies),
                "canary": None if canary is None else f"{canary.id} ({canary.share:g} % by {canary.key})"}})
            return True

    async def flush_tallies(self) -> None:
        """Add what this router's canaries counted since the last flush to the store's tallies
        (``router.decision.canary``); kept for the next flush when the store cannot be written."""
        rows = self.engine.drain_tallies()
        if not rows:
            return
        try:
            await asyncio.to_thread(self.store.add_tallies, rows)
        except BaseException:
            self.engine._retired += rows
            raise

    async def run(self) -> None:
        """Poll the store's version every ``poll_s`` (logging an outage once), and write the
        canary's tallies."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.check()
                await self.flush_tallies()
                self.last_error = None
            except Exception as e:  # the store down, or a version that does not read: keep the current set
                if self.last_error is None:
                    LOG.warning("policy store unreadable; the current routing policies stay", extra={"fields": {
                        "error": one_line(e)}})
                self.last_error = one_line(e)

    async def write(self, principal: str, mutation: Mutation, request_id: str | None = None) -> PolicySet:
        """Commit a change to the store (durable before it returns), then install it here."""
        ps = await asyncio.to_thread(self.store.change, principal, mutation, request_id)
        await self.install(ps)
        return ps

    def describe(self) -> dict[str, Any]:
        return {"store": self.store.describe(), "backend": self.store.dialect, "version": self.engine.policy_version,
                "policies": len(self.engine.policies.policies), "swaps": self.swaps, "error": self.last_error,
                "poll_s": self.poll_s}


__all__ = ["PolicyStoreError", "PolicySync", "apply_policy_files", "cli_principal", "read_policy_files"]
