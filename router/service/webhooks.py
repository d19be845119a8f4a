"""Migration webhooks: a tenant hears that a migration of one of its sessions ended (``docs/migration.md``,
"Webhooks").

A tenant with ``webhook`` in its settings (``router.core.settings.TenantWebhook``: a URL and where its
signing secret is) gets one :class:`xroute.schema.migration.MigrationNotice` per migration that
ends -- ``committed`` (the session's new placement, and where to replay from), ``aborted`` (its pool
went away with no target: route it anew) or ``rolled_back`` (it stays).

* **Durable.** The delivery is written in the same transaction as the transition that ends the
  migration (``MigrationStore.transition(notify=...)``): no ended migration without its notice,
  whatever crashes when.
* **At least once.** Any router sends due deliveries (a claim -- a compare-and-set with a lease --
  keeps two from sending one at the same time); a 2xx ends it. A router that dies after the
  receiver's 2xx and before recording it sends it again later: receivers deduplicate by
  ``X-Xroute-Delivery`` (the same on every attempt).
* **Retried with backoff.** Any other answer, a timeout or a connection error schedules the next
  attempt ``webhook_backoff_s`` x 2^(attempts-1) later (at most ``webhook_backoff_max_s``, times a
  jitter in [0.5, 1]); after ``webhook_max_attempts`` the delivery is ``failed`` (kept, counted in
  ``xroute_router_webhooks_total{outcome="failed"}``, logged without its body). The schedule is in
  the store, not in a retry loop in memory (why not ``tenacity``: retries must outlive the process).
* **Signed.** ``X-Xroute-Signature: t=<unix>,v1=<HMAC-SHA256 of "<t>." + body>`` under the tenant's
  secret, read when sending (a rotated secret applies to the next attempt);
  ``xroute.schema.migration.verify_webhook`` checks it on the receiving side.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any

import aiohttp

from router.core.logs import LOG
from router.core.settings import TenantConfig
from router.core.text import one_line
from router.service.migration import woken_or_timeout
from router.store.migrations import Conflict, MigrationStore
from xroute.errors import ConfigError
from xroute.schema.migration import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    MigrationNotice,
    MigrationRecord,
    MigrationState,
    SessionView,
    sign_webhook,
)

S = MigrationState


def session_after(rec: MigrationRecord) -> SessionView:
    """Where the session of a migration that just ended is (as ``GET /v1/sessions/{id}`` answers)."""
    placement = rec.target if rec.state == S.committed else (rec.source if rec.state == S.rolled_back else None)
    replay = (rec.last_ack_seq + 1 if rec.state == S.committed and not rec.recomputed and rec.last_ack_seq is not None
              else None)
    return SessionView(session_id=rec.session_id, tenant=rec.tenant, placement=placement, version=rec.version,
                       migrating=False, migration=rec, replay_from=replay)


class WebhookSender:
    """Sends the pending deliveries of the store (every router runs one; module docstring)."""

    BATCH = 64
    CONCURRENT = 16

    def __init__(self, settings: Any, store: MigrationStore, metrics: Any, tenants: Mapping[str, TenantConfig]):
        self.settings, self.store, self.metrics = settings, store, metrics
        self.tenants: dict[str, TenantConfig] = dict(tenants)
        self.counters: Counter[str] = Counter()
        self._http: aiohttp.ClientSession | None = None
        self._wake = asyncio.Event()
        self._sem = asyncio.Semaphore(self.CONCURRENT)

    def set_tenants(self, tenants: Mapping[str, TenantConfig]) -> None:
        """The tenants as installed now (``AccessSync.on_install``): a webhook changed or removed
        applies to the next attempt."""
        self.tenants = dict(tenants)

    def notice(self, rec: MigrationRecord, now: float) -> dict[str, Any] | None:
        """The delivery to queue with the transition that ends ``rec`` (its state and version as
        after it); None when its tenant has no webhook."""
        cfg = self.tenants.get(rec.tenant)
        if cfg is None or cfg.webhook is None:
            return None
        did = "wh_" + uuid.uuid4().hex
        body = MigrationNotice(type=f"session.migration.{rec.state.value}", delivery_id=did,  # type: ignore[arg-type]
                               at=now, session=session_after(rec)).model_dump_json()
        return {"delivery_id": did, "tenant": rec.tenant, "session_id": rec.session_id, "body": body}

    def wake(self) -> None:
        self._wake.set()

    def _count(self, outcome: str) -> None:
        self.counters[outcome] += 1
        if self.metrics is not None:
            self.metrics.webhooks.labels(outcome).inc()

    #: how often the store is asked for due deliveries while no tenant has a webhook (a delivery
    #: queued for one removed since is then failed; a migration ending here wakes the loop at once)
    IDLE_POLL_S = 5.0

    async def run(self) -> None:
        while True:
            busy = any(t.webhook is not None for t in self.tenants.values())
            await woken_or_timeout(self._wake, self.settings.migration_poll_s if busy else self.IDLE_POLL_S)
            try:
                await self.send_due()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # (the store down: logged, tried again)
                LOG.warning("webhooks not sent", extra={"fields": {"error": str(e)[:300]}})

    async def send_due(self) -> int:
        """Send every delivery due now (claimed first); returns how many were attempted."""
        now = time.time()
        rows = await asyncio.to_thread(self.store.due_webhooks, now, self.BATCH)
        if not rows:
            return 0
        lease = now + self.settings.webhook_timeout_s + 5.0
        mine = []
        for row in rows:
            try:
                await self.store.submit(self.store.claim_webhook(row[0], now, lease))
            except Conflict:
                continue  # another router holds it, or it ended meanwhile
            mine.append(row)
        await asyncio.gather(*(self._send(*row) for row in mine))
        return len(mine)

    async def _send(self, delivery_id: str, tenant: str, session_id: str, body: str, attempts: int) -> None:
        async with self._sem:
            attempts += 1
            cfg = self.tenants.get(tenant)
            hook = None if cfg is None else cfg.webhook
            status: int | None = None
            error: str | None = None
            if hook is None:
                await self._record(delivery_id, "failed", attempts, None, "the tenant has no webhook now")
                return
            try:
                secret = hook.read(f"'tenants.{tenant}.webhook.secret")
                data = body.encode()
                headers = {"Content-Type": "application/json", DELIVERY_HEADER: delivery_id,
                           SIGNATURE_HEADER: sign_webhook(secret.encode(), data, int(time.time())),
                           "User-Agent": "xroute-router"}
                if self._http is None:
                    self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                        total=self.settings.webhook_timeout_s))
                async with self._http.post(hook.url, data=data, headers=headers, allow_redirects=False) as r:
                    status = r.status
                    await r.read()
                if 200 <= status < 300:
                    await self._record(delivery_id, "delivered", attempts, status, None)
                    return
                error = f"HTTP {status}"
            except ConfigError as e:
                error = str(e)
            except (aiohttp.ClientError, TimeoutError) as e:
                error = one_line(e)
            if attempts >= self.settings.webhook_max_attempts:
                await self._record(delivery_id, "failed", attempts, status, error)
                LOG.warning("webhook failed for good", extra={"fields": {
                    "delivery_id": delivery_id, "tenant": tenant, "session_id": session_id, "attempts": attempts,
                    "error": error}})
                return
            await self._record(delivery_id, "pending", attempts, status, error)

    async def _record(self, delivery_id: str, status: str, attempts: int, http_status: int | None,
                      error: str | None) -> None:
        now = time.time()
        s = self.settings
        delay = min(s.webhook_backoff_s * 2 ** (attempts - 1), s.webhook_backoff_max_s) * random.uniform(0.5, 1.0)
        await self.store.submit(self.store.webhook_attempted(delivery_id, status, attempts, now + delay, http_status,
                                                             error, now))
        self._count({"pending": "retried"}.get(status, status))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
