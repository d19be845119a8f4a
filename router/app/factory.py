"""The router's FastAPI app: :func:`create_app` (factory) and its lifespan.

At start the lifespan loads the telemetry and the live environment, opens the decision log, the
policy, access and migration stores, loads the model (within ``model_load_timeout_s``; otherwise it
serves the fallback and keeps trying), opens and restores the shared state, builds the services
(:func:`start_services`), then starts the background loops (model watch, readiness, telemetry
refresh, shared view, policy and access sync, migrations, webhooks, scrape). Everything it opens is
on one ``AsyncExitStack``: at shutdown -- or when the start fails part way -- the loops are
cancelled and each part closed in the reverse order of its opening, so the gateway's last outcomes
and whatever the decision log holds are committed before the log closes.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Receive, Scope, Send

from router.api import access as access_routes
from router.api import admin, capacity, decisions, feedback, health, offerings, quotas, route
from router.api import canary as canary_routes
from router.api import metrics as metrics_routes
from router.api import migration as migration_routes
from router.api import policies as policy_routes
from router.console import auth as console_auth
from router.console import canary as console_canary
from router.console import pages as console_pages
from router.console import policies as console_policies
from router.control.access_store import AccessStore, AccessSync
from router.control.keys import KeyStore
from router.control.policy_sync import PolicySync
from router.core import tracing
from router.core.logs import LOG, configure_logging, flush_logs, iso
from router.core.metrics import Metrics
from router.core.settings import RouterSettings, load_settings
from router.core.startup import CLOCK, release_gc, settle_gc
from router.core.text import one_line
from router.decision.engine import RoutingEngine
from router.gateway import routes as gateway_routes
from router.gateway.openai_api import ChatBody, CompletionBody
from router.gateway.service import Gateway
from router.http import errors
from router.http.middleware import RequestContext
from router.service import watchdog_sync
from router.service.admission_queue import AdmissionQueue
from router.service.capacity import CapacityPlans
from router.service.migration import Migrator
from router.service.models import ModelManager
from router.service.ports import SharedState
from router.service.readiness import Readiness
from router.service.recovery import SharedStateSync, refresh_shared_view
from router.service.scrape import InferenceScraper
from router.service.services import Services
from router.service.webhooks import WebhookSender
from router.state.base import StateUnavailable
from router.state.open import StateSettings, open_state
from router.store.migrations import MigrationStore
from router.store.policies import PolicyStore
from router.store.sqlite import DecisionStore, GroupCommitLog
from xroute.schema.decision import RouteRequest
from xroute.schema.migration import CloudEventEnvelope, PoolEvent

API_VERSION = "1.0.0"


async def _refresh_telemetry(engine: RoutingEngine, metrics: Metrics, every: float) -> None:
    fresh = engine.freshness
    first = True
    while True:
        if not first:
            await asyncio.sleep(every)
        first = False
        source = engine.source
        try:
            new = await asyncio.to_thread(source.poll)
            if new is not None:  # a live source's new commit: built off the loop, swapped in between decisions
                prepared = await asyncio.to_thread(engine.prepare_telemetry, new)
                engine.apply_telemetry(prepared)
                source.accept()
                LOG.info("telemetry reloaded", extra={"fields": {"bundle_hash": engine.bundle_hash,
                                                                 "as_of": iso(source.as_of())}})
        except Exception as e:
            if fresh.last_error is None:
                LOG.warning("telemetry source unreachable or invalid; its data ages", extra={"fields": {"error": str(e)}})
            fresh.last_error = f"{type(e).__name__}: {e}"
        else:
            fresh.last_ok_wall = source.as_of()
            fresh.last_error = None
        metrics.telemetry_age.set(fresh.age(time.time()))
        flush_logs()


async def open_decision_log(settings: RouterSettings, metrics: Metrics, engine: RoutingEngine) -> GroupCommitLog:
    """The decision log the settings name, started: PostgreSQL when ``db_url`` is set, else SQLite
    at ``db_path`` (answers compressed against the engine's dictionary with ``db_compress``)."""
    store: GroupCommitLog
    if settings.db_url is not None:
        from router.store.postgres import PostgresLog

        pg = PostgresLog(settings.db_url.get_secret_value(), settings.db_batch_max, on_commit=metrics.committed)
        await pg.open()
        store = pg
    else:
        sqlite = DecisionStore(settings.db_path, settings.db_synchronous, settings.db_batch_max,
                               on_commit=metrics.committed, checkpoint_rows=settings.db_checkpoint_rows,
                               checkpoint_s=settings.db_checkpoint_s,
                               on_checkpoint=metrics.log_checkpoint_seconds.observe)
        if settings.db_compress:
            sqlite.use_dictionary(engine.response_dictionary())
        store = sqlite
    store.start()
    if settings.log_features:  # the decisions' OPE records name their offerings by index into it
        await store.register_catalog(engine.catalog_key, engine.offering_ids)
    return store


async def open_router_state(settings: RouterSettings) -> SharedState:
    """The shared state the settings name (``router.state.base``). A server that cannot be reached at
    start is logged, not fatal: each operation raises ``StateUnavailable`` (or answers locally with
    ``state_fail_open``) until it is back."""

    def failover(why: str) -> None:
        LOG.warning("shared state unreachable; answering from this process's own view (state_fail_open)",
                    extra={"fields": {"error": why}})

    url = settings.state_url.get_secret_value() if settings.state_url is not None else None
    state: SharedState = open_state(StateSettings(
        settings.state_backend, url, settings.state_fail_open, settings.state_timeout_s, settings.state_prefix,
        settings.state_stats_alpha, restore_window_s=settings.state_restore_window_s), on_failover=failover)
    if not await state.healthy():
        LOG.warning("shared state unreachable at start", extra={"fields": state.describe()})
    return state


PUBLIC_PATHS = ("/healthz", "/readyz")


class RouterApp(FastAPI):
    """The FastAPI app behind one pure-ASGI front, :class:`RequestContext` (request id, trace,
    body limit, access log), around FastAPI itself: every route, ``POST /v1/route`` included, goes
    through both and through any middleware added with ``add_middleware``. (In front of FastAPI's
    own stack rather than added to it, so that the 500 its ``ServerErrorMiddleware`` renders still
    carries the request id and gets its access line.)"""

    front: ASGIApp | None = None
    #: what every route uses (``router.service.services.Services``), set by the lifespan while serving, else None;
    #: a plain attribute rather than ``app.state.services`` (``State`` is a Python-level ``__getattr__``,
    #: read on every request by the dependency)
    services: Services | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        front = self.front
        if front is None or scope["type"] != "http":
            await super().__call__(scope, receive, send)
        else:
            await front(scope, receive, send)


def _document_security(app: FastAPI) -> None:
    """Declare the API-key schemes in the OpenAPI document (checked by ``router.http.deps.authenticate``,
    not by FastAPI security dependencies, which cost a dependency resolution each per request), and
    the schemas of the bodies a route validates itself."""

    built_for: list[Any] = [None]

    def openapi() -> dict[str, Any]:
        services = getattr(app, "services", None)
        catalog = ((tuple(services.engine.origins), tuple(services.engine.servable_models()),
                    tuple(services.engine.offering_ids)) if services is not None else None)
        if app.openapi_schema is None or built_for[0] != catalog:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=[*route.router.routes, *gateway_routes.docs.routes, *app.routes])
            # the bodies routes read themselves (``POST /v1/route``'s and the gateway's, documented by their
            # openapi_extra)
            _, defs = models_json_schema([(RouteRequest, "validation"), (ChatBody, "validation"),
                                          (CompletionBody, "validation"), (PoolEvent, "validation"),
                                          (CloudEventEnvelope, "validation")],
                                         ref_template="#/components/schemas/{model}")
            for name, definition in defs.get("$defs", {}).items():
                schema.setdefault("components", {}).setdefault("schemas", {}).setdefault(name, definition)
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "API key as a bearer token"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
            }
            schema["security"] = [{"bearer": []}, {"apiKey": []}]
            for path in PUBLIC_PATHS:
                for op in schema["paths"].get(path, {}).values():
                    op["security"] = []
            if catalog is not None:
                _document_catalog(schema, *catalog)
            app.openapi_schema = schema
            built_for[0] = catalog
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_catalog(schema: dict[str, Any], origins: tuple[str, ...], models: tuple[str, ...],
                      offerings: tuple[str, ...] = ()) -> None:
    """What the served telemetry accepts, as enums of ``RouteRequest``: an origin the catalog lacks
    or a model no pool holds is a 422 (``unknown_origin``, ``unknown_model``, ``model_unavailable``),
    so the document says
    which values are valid rather than leaving generated clients and fuzzers to guess. The document
    is rebuilt when the telemetry's origins or models change (a live refresh)."""
    props = schema.get("components", {}).get("schemas", {}).get("RouteRequest", {}).get("properties", {})
    if "origin" in props:
        props["origin"]["enum"] = list(origins)
    model = props.get("model")
    if model is not None:
        for branch in model.get("anyOf", [model]):
            if branch.get("type") == "string":
                branch["enum"] = list(models)
    for name, field in (("PoolEvent", "pool"), ("CloudEventEnvelope", "pool"), ("Verification", "target")):
        prop = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {}).get(field)
        if prop is not None and offerings:  # a pool the catalog lacks is a 422 (unknown_pool, wrong_target)
            prop["enum"] = list(offerings)


def app_from_environment() -> FastAPI:
    """The app with settings from the config file and the environment only: what each worker of
    ``xroute serve --workers N`` builds (``router.app.worker``; the command puts its options into
    ``XROUTE_ROUTER_*``). The worker dies with the command's process (``router.app.lifeline``)."""
    from router.app.lifeline import follow_supervisor

    CLOCK.mark("imports")
    follow_supervisor()
    settings = load_settings()
    CLOCK.mark("settings")
    return create_app(settings)


async def _open_control(stack: AsyncExitStack, settings: RouterSettings, engine: RoutingEngine
                        ) -> tuple[PolicySync, AccessSync, MigrationStore]:
    """The routing policies (the versioned store on the decision log's backend, its files applied and
    its head installed before the first decision: a store that cannot be opened, or a bad policy
    file, stops the start -- the router never decides without the policies it should have); then
    tenants, quotas, roles and bindings (the access store: the same backend and machinery), installed
    before the quota counters are rebuilt (they follow the tenants' quotas); then the pool events'
    and migrations' tables (``router.store.migrations``). Each store closed by ``stack``."""
    policy_store = await asyncio.to_thread(PolicyStore, settings.log_target)
    stack.callback(policy_store.close)
    policy_sync = PolicySync(engine, policy_store, settings.policy_files, settings.policy_poll_s)
    await policy_sync.start()
    stack.push_async_callback(_last_tallies, policy_sync)
    access_store = await asyncio.to_thread(AccessStore, settings.log_target)
    stack.callback(access_store.close)
    access_sync = AccessSync(engine, access_store, settings.tenants, settings.policy_poll_s)
    await access_sync.start()
    migration_store = await asyncio.to_thread(MigrationStore, settings.log_target)
    stack.push_async_callback(migration_store.close)
    return policy_sync, access_sync, migration_store


async def _last_tallies(policy_sync: PolicySync) -> None:
    """At shutdown, once nothing decides any more: the canary's last counts written to the store."""
    try:
        await policy_sync.flush_tallies()
    except Exception as e:
        LOG.warning("the canary's last counts could not be written", extra={"fields": {"error": one_line(e)}})


async def _restore_state(state: SharedState, store: GroupCommitLog, settings: RouterSettings,
                         engine: RoutingEngine) -> SharedStateSync:
    """The shared state restored before the first decision (``router.service.recovery``): an
    embedded one rebuilt from the decision log, a server's checked for a loss of its data when it
    answers now -- its sync, which the shared view's loop runs. The decisions' quota usage is exact in
    process, else read with the shared view."""
    engine.quota_usage = state.quota_reader or engine.quota_view.get
    sync = SharedStateSync(state, store, settings, engine)
    try:
        await sync.start()
    except StateUnavailable:
        pass  # (the shared view's loop tries again)
    return sync


async def _serving_parts(stack: AsyncExitStack, services: Services, migration_store: MigrationStore,
                         access_sync: AccessSync) -> None:
    """The parts built on :class:`Services`: the gateway, the migration webhooks' sender and the
    migrator, whose start installs the active pool events' masks before the first decision
    (unfinished migrations resume in its loop). The gateway closes before the decision log (its
    outcomes are still being recorded), the sender before the migration store."""
    gateway = Gateway(services)
    services.gateway = gateway
    stack.push_async_callback(gateway.close)
    gateway.tenant_cfg = {name: t.gateway for name, t in access_sync.tenants().items()}
    access_sync.on_install.append(lambda tenants: setattr(gateway, "tenant_cfg", {
        name: t.gateway for name, t in tenants.items()}))
    webhooks = services.webhooks = WebhookSender(services.settings, migration_store, services.metrics,
                                                 access_sync.tenants())
    stack.push_async_callback(webhooks.close)
    access_sync.on_install.append(webhooks.set_tenants)
    migrator = services.migrator = Migrator(services, migration_store)
    await migrator.start()


async def start_services(stack: AsyncExitStack, settings: RouterSettings, metrics: Metrics,
                         engine: RoutingEngine | None) -> tuple[Services, SharedStateSync]:
    """Open every part of a serving router, in order, each closed by ``stack`` in the reverse order
    (a start that fails closes what it had opened): the engine (unless built already), the keys,
    the decision log, the policy, access and migration stores, the model, the shared state (restored
    from the log), the readiness probe, the gateway and the migrator. Returns the services and the
    shared state's sync."""
    tracing.setup(settings.tracing)  # (off: nothing imported; on: the SDK, sending spans until shutdown)
    stack.callback(tracing.shutdown)
    if engine is None:
        engine = await asyncio.to_thread(RoutingEngine, settings)
    keys = KeyStore(settings.keys_file)
    if keys.empty:
        LOG.warning("no API keys: every keyed route answers 401; add one with xroute keys add",
                    extra={"fields": {"keys_file": str(settings.keys_file)}})
    store = await open_decision_log(settings, metrics, engine)
    stack.push_async_callback(store.close)
    CLOCK.mark("decision_log")
    policy_sync, access_sync, migration_store = await _open_control(stack, settings, engine)
    CLOCK.mark("policy_store")
    settle_gc()  # (router.core.startup)
    CLOCK.mark("gc")
    models = ModelManager(engine, settings, metrics)
    timer = metrics.stage_seconds.observe_as  # (every route's stages, timed; traced: a span each too)
    engine.stage_timer = tracing.stage_timer(timer) if tracing.ON else timer
    await models.initial()
    CLOCK.mark("model")
    state = await open_router_state(settings)
    stack.push_async_callback(state.close)
    sync = await _restore_state(state, store, settings, engine)
    CLOCK.mark("state")
    scraper = InferenceScraper(engine, settings) if settings.inference_servers else None
    readiness = Readiness(store, state, settings.ready_probe_s)
    await readiness.probe()
    services = Services(settings, engine, store, keys, metrics, models, state, scraper, policies=policy_sync,
                        readiness=readiness, access=access_sync)
    metrics.watch_pools(lambda: engine.pool_load(time.time()))
    metrics.watch_watchdog(engine.watchdog.describe)
    metrics.ready.set_function(lambda: float(readiness.decision_log_ok and readiness.state_ok))
    services.capacity = CapacityPlans(settings.capacity, engine)
    adm = settings.admission
    if adm.enabled:
        services.admission = AdmissionQueue(state, adm.queue_limit, adm.recheck_s, metrics)
    await _serving_parts(stack, services, migration_store, access_sync)
    await store.started()  # (the SQLite log's writer process, started with the other phases: serve once it commits)
    CLOCK.mark("services")
    return services, sync


def _background(services: Services, sync: SharedStateSync) -> list[asyncio.Task[Any]]:
    """The loops a serving router runs: the model watch, the readiness probe, the telemetry refresh,
    the shared view, the policy and access syncs, the migrations, the webhooks, the scrape."""
    svc, settings = services, services.settings
    assert svc.readiness is not None and svc.policies is not None and svc.access is not None
    assert svc.migrator is not None and svc.webhooks is not None
    loops = {"model-watch": svc.models.watch(), "readiness": svc.readiness.run(),
             "telemetry-refresh": _refresh_telemetry(svc.engine, svc.metrics, settings.telemetry_refresh_s),
             "shared-view": refresh_shared_view(svc.engine, svc.state, settings.state_view_refresh_s, sync,
                                                None if svc.admission is None else svc.admission.kick),
             "policy-sync": svc.policies.run(), "access-sync": svc.access.run(), "migrations": svc.migrator.run(),
             "webhooks": svc.webhooks.run(), "watchdog-sync": watchdog_sync.follow(svc, settings.watchdog.sync_s)}
    if svc.scraper is not None:
        loops["inference-scrape"] = svc.scraper.run()
    return [asyncio.create_task(coro, name=name) for name, coro in loops.items()]


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _ready(services: Services) -> None:
    engine, settings = services.engine, services.settings
    LOG.info("router ready", extra={"fields": {
        "offerings": engine.n, "origins": len(engine.origins), "telemetry": engine.source_name,
        "clock": engine.clock, "policy": (engine.slot.model or engine.slot.fallback).name,
        "routing_policies": engine.policy_version,
        "decision_log": services.store.describe().get("url") or str(settings.db_path), **CLOCK.report()}})


def _stopped(app: RouterApp, started: list[Services]) -> None:
    """The last step of a shutdown (after every part has closed)."""
    app.services = None
    if started:
        LOG.info("router stopped", extra={"fields": {"decisions": started[0].engine.decisions}})
    flush_logs()


def create_app(settings: RouterSettings | None = None, engine: RoutingEngine | None = None) -> FastAPI:
    """The app. ``settings`` default to :func:`router.core.settings.load_settings` (file + environment);
    ``engine`` (built from the same settings) lets a caller fail fast on bad telemetry before serving."""
    settings = settings or load_settings()
    prebuilt = [engine]
    configure_logging(settings.log_level)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: RouterApp) -> AsyncIterator[None]:
        """Everything opened on one exit stack, closed in the reverse order at shutdown (module docstring)."""
        CLOCK.mark("server")
        async with AsyncExitStack() as stack:
            started: list[Services] = []
            stack.callback(_stopped, app, started)
            services, sync = await start_services(stack, settings, metrics, prebuilt.pop() if prebuilt else None)
            started.append(services)
            app.services = services
            stack.push_async_callback(_cancel, _background(services, sync))
            stack.callback(sys.setswitchinterval, sys.getswitchinterval())
            sys.setswitchinterval(settings.gil_switch_interval_s)
            release_gc()  # start-up objects frozen: shorter GC pauses while serving (router.core.startup)
            CLOCK.mark("gc")
            _ready(services)
            yield

    app = RouterApp(title="xroute router", version=API_VERSION, lifespan=lifespan,
                  description="Routes LLM inference requests to cloud offerings (provider x region x instance "
                              "type x pricing mode) with the champion RL policy. Every route except /healthz and "
                              "/readyz needs an API key (Authorization: Bearer <key> or X-API-Key).")
    # POST /v1/route: a Starlette Route of this app (below FastAPI's middleware and exception handlers
    # like every route, cheaper than an APIRoute: docs/results.md); documented from its APIRoute
    app.router.routes.append(route.SERVED)
    app.router.routes.extend(gateway_routes.SERVED)  # the gateway's routes, the same way (router/gateway/routes.py)
    for r in (decisions.router, decisions.admin_router, offerings.router, feedback.router,
              health.router, admin.router, metrics_routes.router, policy_routes.router, policy_routes.explain_router, canary_routes.router,
              quotas.router, access_routes.router, access_routes.whoami_router, migration_routes.router,
              capacity.router, console_auth.router, console_pages.router, console_policies.router, console_canary.router):
        app.include_router(r)
    errors.install(app)
    _document_security(app)
    inner = functools.partial(FastAPI.__call__, app)
    app.front = RequestContext(inner, max_body_bytes=settings.max_body_bytes, metrics=metrics,
                               access_log=settings.access_log,
                               path_limits=dict.fromkeys(gateway_routes.PATHS, settings.gateway.max_body_bytes))
    return app
