"""What every route and service uses, built once by the app's lifespan (``router.app.factory``):
settings, engine, decision log, keys, metrics, model slot, shared state and the optional parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.control.keys import KeyStore
from router.core.metrics import Metrics
from router.core.settings import RouterSettings
from router.decision.engine import RoutingEngine
from router.service.ports import SharedState
from router.store.sqlite import GroupCommitLog


@dataclass
class Services:
    """Everything the routes use, built once by the lifespan (``RouterApp.services``)."""

    settings: RouterSettings
    engine: RoutingEngine
    store: GroupCommitLog
    keys: KeyStore
    metrics: Metrics
    models: object  # router.service.models.ModelManager (kept loose to avoid an import cycle)
    #: the shared state as the services consume it (router.service.ports): admission, outcomes,
    #: affinity, the shared view, idempotency, recovery
    state: SharedState
    #: the pools' inference servers' own metrics (router.service.scrape.InferenceScraper), when configured
    scraper: object | None = None
    #: the OpenAI-compatible gateway (router.gateway.service.Gateway), set once built
    gateway: object | None = None
    #: the routing policies' store and its sync (router.control.policy_sync.PolicySync)
    policies: Any = None
    #: what /readyz answers, probed in the background (router.service.readiness.Readiness)
    readiness: object | None = None
    #: pool events and session migrations (router.service.migration.Migrator), set once built
    migrator: Any = None
    #: the migration webhooks' sender (router.service.webhooks.WebhookSender), set once built
    webhooks: Any = None
    #: tenants, quotas, roles and bindings: the access store and its sync (router.control.access_store.AccessSync)
    access: Any = None
