"""The router's FastAPI app: :func:`create_app` (factory) and its lifespan.

At start the lifespan loads the telemetry and the live environment, opens the decision log, loads
the model (within ``model_load_timeout_s``; otherwise it serves the fallback and keeps trying), then
starts two background tasks: the telemetry refresher and the model watcher. At shutdown it stops
them and lets the decision log commit what it holds.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Receive, Scope, Send

from router import errors
from router.access_store import AccessStore, AccessSync
from router.backends import StateSettings, decision_events, open_state
from router.deps import Services
from router.engine import RoutingEngine
from router.gateway import routes as gateway_routes
from router.gateway.openai_api import ChatBody, CompletionBody
from router.gateway.service import Gateway
from router.keys import KeyStore
from router.logs import LOG, configure_logging, flush_logs, iso
from router.metrics import Metrics
from router.middleware import RequestContext
from router.migration import Migrator
from router.migration_store import MigrationStore
from router.policies import ActivePolicy, import_loader, resolve
from router.policy_store import PolicyStore, PolicyStoreError
from router.policy_sync import PolicySync
from router.quotas import quota_events
from router.readiness import Readiness
from router.routes import access as access_routes
from router.routes import admin, decisions, feedback, health, offerings, quotas, route
from router.routes import metrics as metrics_routes
from router.routes import migration as migration_routes
from router.routes import policies as policy_routes
from router.scrape import InferenceScraper
from router.settings import RouterSettings, load_settings
from router.startup import CLOCK, release_gc, settle_gc
from router.state import EmbeddedState, RouterState, StateUnavailable
from router.store import DecisionStore, GroupCommitLog
from router.webhooks import WebhookSender
from xroute.schema.decision import RouteRequest
from xroute.schema.migration import CloudEventEnvelope, PoolEvent
from xroute.schema.quota import DAY_S, day_index

API_VERSION = "1.0.0"


class ModelManager:
    """Loads the configured model, validates it, and swaps it in; never raises to its caller."""

    def __init__(self, engine: RoutingEngine, settings: RouterSettings, metrics: Metrics):
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self._lock = asyncio.Lock()

    def _fail(self, stage: str, error: BaseException | str) -> str:
        msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        msg = f"{stage}: {msg}"[:500]
        self.engine.slot.failed(msg)
        self.metrics.model_errors.labels(stage).inc()
        LOG.warning("model not loaded; keeping the current policy", extra={"fields": {
            "stage": stage, "error": msg, "serving": (self.engine.slot.model or self.engine.slot.fallback).name}})
        self._publish()
        return "error"

    def _publish(self) -> None:
        m = self.engine.slot.model or self.engine.slot.fallback
        self.metrics.set_model(m.name, m.kind, m.version)

    def _prepare(self, policy: Any, version: str, uri: str) -> ActivePolicy:
        """Reset against the live env and answer one decision on a sampled observation."""
        env = self.engine.env
        policy.reset(env, 0)
        name = str(getattr(policy, "name", "") or uri)
        active = ActivePolicy.make(policy, name, "model", version, uri)
        space = env.observation_space
        space.seed(0)
        obs = space.sample()
        mask = np.zeros(env.N, dtype=bool)
        mask[: env.n] = True
        obs["mask"] = mask.astype(np.float32)
        idx = np.flatnonzero(mask)
        if active.scorer is not None:
            s = np.asarray(active.scorer(obs["offerings"].reshape(env.N, -1)[idx], obs["request"]))
            if s.shape != idx.shape or not np.isfinite(s).all():
                raise ValueError(f"smoke decision: scores of shape {s.shape}, finite={np.isfinite(s).all()}")
        else:
            a = policy.act(obs, {"action_mask": mask})
            if not (0 <= int(a) < env.n):
                raise ValueError(f"smoke decision: action {a} outside 0..{env.n - 1}")
        return active

    async def check(self, force: bool = False) -> str:
        """Resolve the model URI; load, validate and install a new version. Returns
        ``"swapped"``, ``"unchanged"``, ``"disabled"`` or ``"error"``."""
        uri = self.settings.model_uri
        if not uri:
            return "disabled"
        async with self._lock:
            try:
                load_uri, version = await asyncio.to_thread(resolve, uri)
            except Exception as e:
                return self._fail("resolve", e)
            slot = self.engine.slot
            if version == slot.loaded_version and not force:
                return "unchanged"
            try:
                loader = import_loader(self.settings.model_loader)
                policy = await asyncio.to_thread(loader, load_uri)
            except Exception as e:
                return self._fail("load", e)
            try:
                active = self._prepare(policy, version, uri)
            except Exception as e:
                return self._fail("validate", e)
            old = slot.model.version if slot.model else None
            slot.install(active)
            self.metrics.model_swaps.inc()
            self._publish()
            LOG.info("model installed", extra={"fields": {"uri": uri, "version": version, "previous": old}})
            return "swapped"

    async def initial(self) -> None:
        self._publish()
        if not self.settings.model_uri:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.check()), self.settings.model_load_timeout_s)
        except TimeoutError:
            self._fail("load", f"timed out after {self.settings.model_load_timeout_s:g} s; serving the fallback "
                               "and retrying in the background")

    async def watch(self) -> None:
        poll = self.settings.model_poll_s
        if poll <= 0 or not self.settings.model_uri:
            return
        while True:
            await asyncio.sleep(poll)
            await self.check()


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
        from router.store_pg import PostgresLog

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


async def open_router_state(settings: RouterSettings) -> RouterState:
    """The shared state the settings name (``router.state``). A server that cannot be reached at
    start is logged, not fatal: each operation raises ``StateUnavailable`` (or answers locally with
    ``state_fail_open``) until it is back."""

    def failover(why: str) -> None:
        LOG.warning("shared state unreachable; answering from this process's own view (state_fail_open)",
                    extra={"fields": {"error": why}})

    url = settings.state_url.get_secret_value() if settings.state_url is not None else None
    state = open_state(StateSettings(settings.state_backend, url, settings.state_fail_open, settings.state_timeout_s,
                                     settings.state_prefix, settings.state_stats_alpha,
                                     settings.state_restore_window_s), on_failover=failover)
    if not await state.healthy():
        LOG.warning("shared state unreachable at start", extra={"fields": state.describe()})
    return state


async def _logged_answers(store: GroupCommitLog, settings: RouterSettings, now: float,
                          before: float | None = None) -> list[tuple[str, bytes, float]]:
    """The idempotency keys the decision log holds that are still within their TTL at ``now``,
    with their answers -- the same bytes -- and until when (wall clock); ``before``: only those
    answered before that wall time."""
    from router.routes.feedback import feedback_answer
    from router.routes.route import idempotency_digest
    from xroute.schema.decision import FeedbackRequest

    ttl = settings.idempotency_ttl_s
    cut = math.inf if before is None else before
    decisions, feedback = await store.keyed_since(now - ttl)
    answers = [(key, idempotency_digest(request_json) + answer.encode(), created + ttl)
               for key, request_json, answer, created in decisions if created < cut]
    for key, fid, did, at, latency, ttft, cost, out, failed, error in feedback:
        if at >= cut:
            continue
        body = FeedbackRequest(decision_id=did, latency_ms=latency, ttft_ms=ttft, cost_usd=cost, output_tokens=out,
                               failed=bool(failed), error=error)
        answers.append((key, idempotency_digest(body.model_dump_json()) + feedback_answer(fid, did, at), at + ttl))
    return answers


async def logged_quota_events(engine: RoutingEngine, settings: RouterSettings, now: float,
                              before: float | None = None) -> list[Any]:
    """The tenant quota reservations (and settles) of the decision log that still count at
    ``now``: those of the current UTC day, and of the last ``state_hold_max_s`` (a concurrency
    slot or a window may reach back past midnight); none when no tenant has quotas
    (``router.quotas.quota_events``)."""
    plan = engine.quota_plan
    if not plan:
        return []
    since = min(now - settings.state_hold_max_s, day_index(now) * DAY_S)
    target = settings.log_target
    return await asyncio.to_thread(lambda: list(quota_events(
        target, since, lambda tenant, model: [b.key for b in plan.buckets(tenant, model)], before)))


async def rebuild_embedded_state(state: EmbeddedState, store: GroupCommitLog, settings: RouterSettings,
                                 engine: RoutingEngine | None = None) -> None:
    """After a restart, the embedded state from the decision log: the reservations whose hold has
    not passed and whose feedback has not come (``router.backends.decision_events``), the tenant
    quota counters (``logged_quota_events``), and the idempotency keys still within their TTL with
    their answers, the same bytes."""
    now = time.time()
    target = settings.log_target
    events = await asyncio.to_thread(lambda: list(decision_events(target, since=now - settings.state_hold_max_s)))
    if engine is not None:
        events += await logged_quota_events(engine, settings, now)
    counts = state.rebuild(events, now_wall=now)
    counts["idempotency_keys"] = state.restore_answers(await _logged_answers(store, settings, now), now_wall=now)
    LOG.info("shared state rebuilt from the decision log", extra={"fields": counts})


def log_identity(settings: RouterSettings) -> str:
    """Which decision log this router writes, as the shared state's restore claims it: a
    PostgreSQL log by its server and database (every router writing it restores it once), a
    SQLite file by this host and its path (each router its own)."""
    if settings.db_url is not None:
        from router.store_pg import redact

        who = "postgresql:" + redact(settings.db_url.get_secret_value())
    else:
        who = f"sqlite:{socket.gethostname()}:{settings.db_path.resolve()}"
    return hashlib.blake2b(who.encode(), digest_size=8).hexdigest()


class SharedStateSync:
    """Notices a shared state that lost its data (a new :class:`router.state.Epoch`) and restores
    this router's decision log into it (``RouterState.restore``: the reservations made before the
    epoch began whose hold has not passed and whose feedback has not come, and the idempotency
    keys within their TTL). Run at start and with every refresh of the shared view
    (``state_view_refresh_s``); a restore that fails is tried again a second later.

    The restore is announced (``RouterState.begin_restore``) before the log is read and this
    router's part is marked done after (``end_restore``): until every router that noticed the
    epoch has put its log back -- and for ``state_restore_window_s`` after the epoch began, in
    which every live router notices -- a keyed request whose key the state lacks is answered 503
    ``state_restoring`` instead of being decided anew, and so is a request that counts against a
    tenant quota (the counters are not whole until then; ``router.state_redis``, "A keyed request
    after a loss"). A router starting on a server whose epoch is that young (a server new to the
    routers looks exactly like one that lost its data) waits the rest of the window before it
    serves (:meth:`settle_start`), so its first requests are not refused."""

    #: after a restore failed (the log unreadable), the next try waits this long (seconds)
    RETRY_S = 1.0

    def __init__(self, state: RouterState, store: GroupCommitLog, settings: RouterSettings,
                 engine: RoutingEngine | None = None):
        self.state, self.store, self.settings, self.engine = state, store, settings, engine
        self.known: str | None = None
        self.log_id = log_identity(settings)
        self._retry_at = 0.0
        self._started: float | None = None  # (the known epoch's start, server wall seconds)

    async def settle_start(self) -> None:
        """At start, after :meth:`check`: wait until the epoch is older than
        ``state_restore_window_s`` (at most that long), so the first requests are decided."""
        if self._started is not None:
            left = min(self._started + self.settings.state_restore_window_s - time.time(),
                       self.settings.state_restore_window_s)
            if left > 0:
                await asyncio.sleep(left)

    async def check(self) -> None:
        epoch = await self.state.epoch()
        if epoch is None or epoch.id == self.known or time.monotonic() < self._retry_at:
            return
        now = time.time()
        if epoch.started <= now - max(self.settings.state_hold_max_s, self.settings.idempotency_ttl_s):
            # (the usual case at start: a server up for longer than any hold or key lost nothing a
            # log could give back -- skip reading it)
            await self.state.end_restore(epoch, self.log_id, True)
            self.known, self._started = epoch.id, epoch.started
            return
        # announced before the log is read, so no router decides a keyed request anew meanwhile
        await self.state.begin_restore(epoch, self.log_id)
        restored = False
        try:
            target = self.settings.log_target
            events: list[Any] = await asyncio.to_thread(lambda: list(decision_events(
                target, since=now - self.settings.state_hold_max_s, before=epoch.started)))
            if self.engine is not None:
                events += await logged_quota_events(self.engine, self.settings, now, before=epoch.started)
            answers = await _logged_answers(self.store, self.settings, now, before=epoch.started)
            counts = await self.state.restore(epoch, self.log_id, events, answers, now)
            restored = True
        except BaseException:
            self._retry_at = time.monotonic() + self.RETRY_S
            raise
        finally:
            try:
                await self.state.end_restore(epoch, self.log_id, restored)
            except StateUnavailable:
                if restored:
                    raise
        self.known, self._started = epoch.id, epoch.started
        if counts is not None:
            LOG.info("shared state restored from the decision log", extra={"fields": {
                **counts, "epoch": epoch.id, "epoch_began": iso(epoch.started)}})


async def _refresh_shared_view(engine: RoutingEngine, state: RouterState, every: float,
                               sync: SharedStateSync | None = None) -> None:
    """Read the shared state's in-flight work (every ``every`` s) and observed durations (about
    once a second) into the engine's view (``RoutingEngine.apply_shared_view``). While the state
    cannot be read the last view stays (logged once per outage). ``sync``: checked every time
    (:class:`SharedStateSync`: the epoch is one short script), so a state that lost its data is
    noticed within ``every`` -- well inside ``state_restore_window_s``."""
    durations: dict[str, float] = {}
    tick, down, failing = 0, False, False
    durations_every = max(1, round(1.0 / every))
    while True:
        try:
            if sync is not None:  # (one short script: a loss is noticed within a tick)
                await sync.check()
            counts = await state.in_flight()
            if tick % durations_every == 0:
                durations = await state.durations(sorted(counts))
            engine.apply_shared_view(counts, durations)
            quota_keys = engine.quota_plan.keys()  # (the plan changes with the access store: router.access_store)
            if quota_keys:  # the tenant quotas' usage, for the decisions' budgets (router.quotas.QuotaView)
                engine.quota_view.apply(await state.quota_usage(quota_keys))
            down = failing = False
        except StateUnavailable as e:
            if not down:
                LOG.warning("shared state unreadable; the decisions keep its last view", extra={"fields": {
                    "error": str(e)}})
            down = True
        except Exception as e:  # e.g. the log unreadable during a restore: tried again next time
            if not failing:  # (logged once until a refresh succeeds)
                LOG.warning("shared view not refreshed (or the state not restored); trying again", extra={"fields": {
                    "error": f"{type(e).__name__}: {e}"[:300]}})
            failing = True
        tick += 1
        await asyncio.sleep(every)


PUBLIC_PATHS = ("/healthz", "/readyz")


class RouterApp(FastAPI):
    """The FastAPI app behind one pure-ASGI front, :class:`RequestContext` (request id, trace,
    body limit, access log), around FastAPI itself: every route, ``POST /v1/route`` included, goes
    through both and through any middleware added with ``add_middleware``. (In front of FastAPI's
    own stack rather than added to it, so that the 500 its ``ServerErrorMiddleware`` renders still
    carries the request id and gets its access line.)"""

    front: ASGIApp | None = None
    #: what every route uses (``router.deps.Services``), set by the lifespan while serving, else None;
    #: a plain attribute rather than ``app.state.services`` (``State`` is a Python-level ``__getattr__``,
    #: read on every request by the dependency)
    services: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        front = self.front
        if front is None or scope["type"] != "http":
            await super().__call__(scope, receive, send)
        else:
            await front(scope, receive, send)


def _document_security(app: FastAPI) -> None:
    """Declare the API-key schemes in the OpenAPI document (checked by ``router.deps.authenticate``,
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
    ``xroute serve --workers N`` builds (``router.worker``; the command puts its options into
    ``XROUTE_ROUTER_*``). The worker dies with the command's process (``router.lifeline``)."""
    from router.lifeline import follow_supervisor

    CLOCK.mark("imports")
    follow_supervisor()
    settings = load_settings()
    CLOCK.mark("settings")
    return create_app(settings)


def create_app(settings: RouterSettings | None = None, engine: RoutingEngine | None = None) -> FastAPI:
    """The app. ``settings`` default to :func:`router.settings.load_settings` (file + environment);
    ``engine`` (built from the same settings) lets a caller fail fast on bad telemetry before serving."""
    settings = settings or load_settings()
    prebuilt = [engine]
    configure_logging(settings.log_level)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: RouterApp) -> AsyncIterator[None]:
        CLOCK.mark("server")
        built = prebuilt.pop() if prebuilt else None
        engine: RoutingEngine = built if built is not None else await asyncio.to_thread(RoutingEngine, settings)
        keys = KeyStore(settings.keys_file)
        if keys.empty:
            LOG.warning("no API keys: every keyed route answers 401; add one with python -m router.keys add",
                        extra={"fields": {"keys_file": str(settings.keys_file)}})
        store = await open_decision_log(settings, metrics, engine)
        CLOCK.mark("decision_log")
        # the routing policies: the versioned store on the decision log's backend, its files applied
        # and its head installed before the first decision (a store that cannot be opened, or a bad
        # policy file, stops the start: the router never decides without the policies it should have)
        try:
            policy_store = await asyncio.to_thread(PolicyStore, settings.log_target)
        except PolicyStoreError:
            await store.close()
            raise
        policy_sync = PolicySync(engine, policy_store, settings.policy_files, settings.policy_poll_s)
        access_store = None
        try:
            await policy_sync.start()
            # tenants, quotas, roles and bindings: the access store (the same backend and machinery),
            # installed before the quota counters are rebuilt (they follow the tenants' quotas)
            access_store = await asyncio.to_thread(AccessStore, settings.log_target)
            access_sync = AccessSync(engine, access_store, settings.tenants, settings.policy_poll_s)
            await access_sync.start()
        except BaseException:
            await store.close()
            policy_store.close()
            if access_store is not None:
                access_store.close()
            raise
        try:  # pool events and migrations: tables on the same backend (router.migration_store)
            migration_store = await asyncio.to_thread(MigrationStore, settings.log_target)
        except Exception:
            await store.close()
            policy_store.close()
            access_store.close()
            raise
        CLOCK.mark("policy_store")
        settle_gc()  # (router.startup)
        CLOCK.mark("gc")
        models = ModelManager(engine, settings, metrics)
        await models.initial()
        CLOCK.mark("model")
        state = await open_router_state(settings)
        sync = None
        if isinstance(state, EmbeddedState):
            await rebuild_embedded_state(state, store, settings, engine)
            engine.quota_usage = state.quota_usage_now  # (exact, in process)
        else:
            engine.quota_usage = engine.quota_view.get  # (read with the shared view)
            sync = SharedStateSync(state, store, settings, engine)
            try:
                await sync.check()  # before the first decision, when the server answers now
                await sync.settle_start()
            except StateUnavailable:
                pass  # (the shared view's loop tries again)
        CLOCK.mark("state")
        scraper = InferenceScraper(engine, settings) if settings.inference_servers else None
        readiness = Readiness(store, state, settings.ready_probe_s)
        await readiness.probe()
        services = Services(settings, engine, store, keys, metrics, models, state, scraper, policies=policy_sync,
                            readiness=readiness, access=access_sync)
        gateway = services.gateway = Gateway(services)
        gateway.tenant_cfg = {name: t.gateway for name, t in access_sync.tenants().items()}
        access_sync.on_install.append(lambda tenants: setattr(gateway, "tenant_cfg", {
            name: t.gateway for name, t in tenants.items()}))
        webhooks = services.webhooks = WebhookSender(settings, migration_store, metrics, access_sync.tenants())
        access_sync.on_install.append(webhooks.set_tenants)
        migrator = services.migrator = Migrator(services, migration_store, route.route_decision, route.release,
                                                route.best_effort)
        try:  # the active events' masks before the first decision; unfinished migrations resume in the loop
            await migrator.start()
        except BaseException:
            await gateway.close()
            await migration_store.close()
            await store.close()
            await state.close()
            policy_store.close()
            access_store.close()
            raise
        CLOCK.mark("services")
        app.services = services
        tasks = [asyncio.create_task(models.watch(), name="model-watch"),
                 asyncio.create_task(readiness.run(), name="readiness"),
                 asyncio.create_task(_refresh_telemetry(engine, metrics, settings.telemetry_refresh_s),
                                     name="telemetry-refresh"),
                 asyncio.create_task(_refresh_shared_view(engine, state, settings.state_view_refresh_s, sync),
                                     name="shared-view"),
                 asyncio.create_task(policy_sync.run(), name="policy-sync"),
                 asyncio.create_task(access_sync.run(), name="access-sync"),
                 asyncio.create_task(migrator.run(), name="migrations"),
                 asyncio.create_task(webhooks.run(), name="webhooks")]
        if scraper is not None:
            tasks.append(asyncio.create_task(scraper.run(), name="inference-scrape"))
        switch = sys.getswitchinterval()
        sys.setswitchinterval(settings.gil_switch_interval_s)
        release_gc()  # start-up objects frozen: shorter GC pauses while serving (router.startup)
        CLOCK.mark("gc")
        LOG.info("router ready", extra={"fields": {
            "offerings": engine.n, "origins": len(engine.origins), "telemetry": engine.source_name,
            "clock": engine.clock, "policy": (engine.slot.model or engine.slot.fallback).name,
            "routing_policies": engine.policy_version,
            "decision_log": store.describe().get("url") or str(settings.db_path), **CLOCK.report()}})
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gateway.close()  # its outcomes still being recorded, before the log closes
            await webhooks.close()
            await migration_store.close()
            await store.close()
            await state.close()
            policy_store.close()
            access_store.close()
            sys.setswitchinterval(switch)
            app.services = None
            LOG.info("router stopped", extra={"fields": {"decisions": engine.decisions}})
            flush_logs()

    app = RouterApp(title="xroute router", version=API_VERSION, lifespan=lifespan,
                  description="Routes LLM inference requests to cloud offerings (provider x region x instance "
                              "type x pricing mode) with the champion RL policy. Every route except /healthz and "
                              "/readyz needs an API key (Authorization: Bearer <key> or X-API-Key).")
    # POST /v1/route: a Starlette Route of this app (below FastAPI's middleware and exception handlers
    # like every route, ~60 us a request cheaper than an APIRoute); documented from its APIRoute
    app.router.routes.append(route.SERVED)
    app.router.routes.extend(gateway_routes.SERVED)  # the gateway's routes, the same way (router/gateway/routes.py)
    for r in (decisions.router, decisions.admin_router, offerings.router, feedback.router,
              health.router, admin.router, metrics_routes.router, policy_routes.router, policy_routes.explain_router,
              quotas.router, access_routes.router, access_routes.whoami_router, migration_routes.router):
        app.include_router(r)
    errors.install(app)
    _document_security(app)
    inner = functools.partial(FastAPI.__call__, app)
    app.front = RequestContext(inner, max_body_bytes=settings.max_body_bytes, metrics=metrics,
                               access_log=settings.access_log,
                               path_limits=dict.fromkeys(gateway_routes.PATHS, settings.gateway.max_body_bytes))
    return app
