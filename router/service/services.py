"""What every route and service uses, built once by the app's lifespan (``router.app.factory``):
settings, engine, decision log, keys, metrics, model slot, shared state and the optional parts.

Every field is typed with what it holds. The one part built above this layer, the OpenAI-compatible
gateway (``router.gateway.service.Gateway``: ``router.gateway`` imports this package, never the
reverse), is typed by what the layers below read of it, :class:`GatewayView`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.control.access_store import AccessSync
from router.control.keys import KeyStore
from router.control.policy_sync import PolicySync
from router.core.metrics import Metrics
from router.core.settings import RouterSettings
from router.decision.engine import RoutingEngine
from router.service.admission_queue import AdmissionQueue
from router.service.capacity import CapacityPlans
from router.service.models import ModelManager
from router.service.ports import SharedState
from router.service.readiness import Readiness
from router.service.scrape import InferenceScraper
from router.store.sqlite import GroupCommitLog

if TYPE_CHECKING:  # types only: the migrator (and the webhooks' sender, which waits on its wake-ups) place
    # through router.service.admission, which reads Services
    from router.service.migration import Migrator
    from router.service.webhooks import WebhookSender


class GatewayView(Protocol):
    """What the layers below the gateway read of it: its transcript store (None: no tenant of this
    router keeps prompts)."""

    @property
    def transcripts(self) -> object | None: ...


@dataclass
class Services:
    """Everything the routes use, built once by the lifespan (``RouterApp.services``)."""

    settings: RouterSettings
    engine: RoutingEngine
    store: GroupCommitLog
    keys: KeyStore
    metrics: Metrics
    #: the model slot's loading and hot swap
    models: ModelManager
    #: the shared state as the services consume it (router.service.ports): admission, outcomes,
    #: affinity, the shared view, idempotency, recovery
    state: SharedState
    #: the pools' inference servers' own metrics, when configured
    scraper: InferenceScraper | None = None
    #: the OpenAI-compatible gateway, set once built
    gateway: GatewayView | None = None
    #: the routing policies' store and its sync
    policies: PolicySync | None = None
    #: what /readyz answers, probed in the background
    readiness: Readiness | None = None
    #: pool events and session migrations, set once built
    migrator: Migrator | None = None
    #: the migration webhooks' sender, set once built
    webhooks: WebhookSender | None = None
    #: tenants, quotas, roles and bindings: the access store and its sync
    access: AccessSync | None = None
    #: admission that predicts: this process's queue (None: ``admission.enabled`` is off)
    admission: AdmissionQueue | None = None
    #: the capacity plan ``GET /v1/capacity/plan`` answers (``router.service.capacity``), set once built
    capacity: CapacityPlans | None = None
