"""The pools' inference servers as the gateway reaches them: their base URLs per offering and
model (``upstreams`` in the router settings), their API keys, one pooled HTTP client, and the
guard that bounds each phase of a request.

API keys come from an environment variable (``api_key_env``) or a file (``api_key_file``, e.g. a
mounted secret), read once at start; a missing one is a config error naming the field, never the
value. They are sent as ``Authorization: Bearer`` and never logged (nothing here logs a header).

The HTTP client is ``aiohttp``'s (one ``ClientSession`` for every server): HTTP/1.1 keep-alive
connections pooled per server (``max_connections`` open in all, an idle one kept
``keepalive_s``), the connect phase -- and the wait for a pooled connection -- bounded by
``connect_timeout_s``, no proxies from the environment, no redirects, no compression
(``Accept-Encoding: identity``: the streams are relayed as they come). aiohttp rather than httpx:
a proxied request costs httpx's client several times aiohttp's CPU, and one worker's CPU is what
bounds the requests per second it forwards (``benchmarks/bench_gateway.py``, "client"; the figures:
``docs/results.md``, "Gateway"). The read phases are bounded by
:class:`Guard` rather than a per-read timeout, so the first token and the gaps between tokens
have their own limits: one timer per request, moved forward by a float assignment per chunk."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from router.core.settings import read_secret
from router.decision.ejections import SERVER, EjectionView
from xroute.errors import ConfigError
from xroute.schema.offering import TIER_SEP, parent_offering_id


@dataclass(slots=True, eq=False)
class Endpoint:
    """One inference server of one pool."""

    base_url: str
    served_model: str
    headers: dict[str, str]
    offering_id: str
    in_flight: int = 0
    down_until: float = 0.0
    urls: dict[str, str] = field(default_factory=dict)
    #: its outlier ejection target (``router.decision.ejections``)
    target: str = ""

    def url(self, kind: str) -> str:
        return self.urls[kind]


def api_key(upstream: Any, where: str) -> str | None:
    """The key an upstream's ``api_key_env`` / ``api_key_file`` names (None when it names none)."""
    return read_secret(upstream.api_key_env, upstream.api_key_file, f"{where}.api_key")


def upstream_pools(settings: Any, offering_ids: list[str], models: list[str]) -> dict[tuple[str, str], list[Endpoint]]:
    """The servers of ``settings.upstreams`` per (model, offering), checked against the catalog
    and the models, with their keys read (a ``ConfigError`` names the field at fault)."""
    import difflib

    pools: dict[tuple[str, str], list[Endpoint]] = {}
    seen: dict[str, set[str]] = {}
    default_model = models[0]
    for i, up in enumerate(settings.upstreams):
        where = f"router settings: field 'upstreams[{i}]"
        if up.offering_id not in offering_ids:
            close = difflib.get_close_matches(up.offering_id, offering_ids, n=3, cutoff=0.4)
            raise ConfigError(f"{where}.offering_id': unknown offering '{up.offering_id}'"
                              + (f" (did you mean {', '.join(close)}?)" if close else ""))
        model = up.model or default_model
        if model not in models:
            raise ConfigError(f"{where}.model': unknown model '{model}' (known: {', '.join(models)})")
        key = api_key(up, where)
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        pool = pools.setdefault((model, up.offering_id), [])
        for base in up.base_urls:
            _own_replicas(base, up.offering_id, f"{where}.base_urls'", seen)
            pool.append(Endpoint(base, up.served_model or model, headers, up.offering_id,
                                 urls={"chat": f"{base}/chat/completions", "completion": f"{base}/completions"},
                                 target=SERVER + base))
    return pools


def _own_replicas(base: str, offering_id: str, where: str, seen: dict[str, set[str]]) -> None:
    """A serving tier's servers are its own replicas (``env.tiers``): a base URL that is also a
    server of the tier's parent (or of a tier of the same parent: its other replicas) is a
    ``ConfigError`` naming ``where`` -- the tier's batch would be the parent's, and one ejection of
    the server would take out both."""
    parent = parent_offering_id(offering_id)
    for other in seen.setdefault(base, set()):
        if other != offering_id and parent_offering_id(other) == parent and TIER_SEP in other + offering_id:
            raise ConfigError(f"{where}: '{base}' is a server of '{other}' too; a serving tier's replicas are "
                              "its own (give each tier and its parent their own servers)")
    seen[base].add(offering_id)


class Upstreams:
    """The servers per (model, offering) (:func:`upstream_pools`) and the HTTP client."""

    def __init__(self, settings: Any, offering_ids: list[str], models: list[str],
                 ejection: EjectionView | None = None):
        gw = settings.gateway
        #: the servers ejected (None: none ever are)
        self.ejection = ejection
        self.pools = upstream_pools(settings, offering_ids, models)
        self._turn: dict[tuple[str, str], int] = {}
        #: model -> the offerings some server of it runs on
        self.offerings: dict[str, list[str]] = {}
        for model, offering in self.pools:
            self.offerings.setdefault(model, []).append(offering)
        self.down_s = gw.upstream_down_s
        self._draining: set[asyncio.Task[None]] = set()
        # (made in the running loop: the lifespan builds the gateway)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=gw.max_connections, limit_per_host=0, keepalive_timeout=gw.keepalive_s),
            timeout=aiohttp.ClientTimeout(total=None, connect=gw.connect_timeout_s, sock_connect=gw.connect_timeout_s),
            auto_decompress=False, trust_env=False)

    def pick(self, model: str, offering_id: str, probe: bool = False) -> Endpoint | None:
        """The server of the pool to send to: one whose half-open probe this process holds (the
        probe: ``router.gateway.health``), else the one with the fewest requests in flight from this
        gateway among those neither ejected nor marked down (all the unejected when every one is
        down), ties taken in turn. None when every server is ejected -- unless ``probe`` (the
        attempt is the pool's probe): then the one with the fewest in flight."""
        pool = self.pools[(model, offering_id)]
        ej = self.ejection
        if ej is not None and ej.health:
            live = self._unejected(pool, ej)
            if isinstance(live, Endpoint):
                return live
            if not live:
                return min(pool, key=lambda e: e.in_flight) if probe else None
            pool = live
        if len(pool) == 1:
            return pool[0]
        now = time.monotonic()
        up = [e for e in pool if e.down_until <= now] or pool
        turn = self._turn.get((model, offering_id), 0)
        self._turn[(model, offering_id)] = turn + 1
        n = len(up)
        return min((up[(turn + k) % n] for k in range(n)), key=lambda e: e.in_flight)

    @staticmethod
    def _unejected(pool: list[Endpoint], ej: EjectionView) -> Endpoint | list[Endpoint]:
        """A server whose probe this process holds (taken now), else the servers not ejected."""
        live = []
        for e in pool:
            if ej.ejected(e.target):
                if ej.take(e.target):
                    return e
            else:
                live.append(e)
        return live

    def other(self, model: str, offering_id: str, tried: list[Endpoint]) -> Endpoint | None:
        """The server of the pool to send to after those ``tried`` refused the connection: the one
        with the fewest requests in flight among the others neither ejected nor marked down; None
        when there is none."""
        now = time.monotonic()
        ej = self.ejection
        left = [e for e in self.pools[(model, offering_id)] if e not in tried and e.down_until <= now
                and (ej is None or not ej.ejected(e.target))]
        return min(left, key=lambda e: e.in_flight) if left else None

    def mark_down(self, ep: Endpoint) -> None:
        """A server that refused a connection: skipped for ``upstream_down_s`` while its pool has others."""
        ep.down_until = time.monotonic() + self.down_s

    def drain(self, response: aiohttp.ClientResponse, within_s: float) -> None:
        """A streamed response the gateway is done with (its ``[DONE]`` came) whose server has not
        ended it yet: read the rest in the background and put its connection back in the pool;
        closed when it has not ended within ``within_s`` (or breaks off)."""
        task = asyncio.get_running_loop().create_task(self._drain(response, within_s))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    @staticmethod
    async def _drain(response: aiohttp.ClientResponse, within_s: float) -> None:
        try:
            async with asyncio.timeout(within_s):
                while await response.content.readany():
                    pass
        except (TimeoutError, aiohttp.ClientError):
            response.close()
            return
        except BaseException:
            response.close()
            raise
        response.release()

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        if self._draining:
            await asyncio.wait(list(self._draining), timeout=5.0)
        await self.session.close()


class Guard:
    """Cancels the task it watches when a phase's deadline passes or the client goes away, and
    says why (``reason``). Code awaiting the upstream catches ``CancelledError``: with a reason it
    is this guard's (``uncancel`` and handle it), without one the cancellation is someone else's
    (let it go). ``deadline`` may be moved forward by assignment (the timer re-arms itself when it
    fires early); one timer handle per request."""

    __slots__ = ("_gone", "_handle", "_loop", "deadline", "disconnected", "phase", "reason", "task")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.task: asyncio.Task[Any] | None = None
        self.deadline = math.inf
        self.phase: str | None = None
        self.reason: str | None = None
        self.disconnected = False
        self._handle: asyncio.TimerHandle | None = None
        self._gone: asyncio.Event | None = None  # (made by the first ``left``: most requests never wait)

    def arm(self, seconds: float, phase: str, task: asyncio.Task[Any] | None = None) -> None:
        """Watch ``task`` (default: the current one) until :meth:`stop`; ``phase`` times out in ``seconds``."""
        self.task = task or asyncio.current_task()
        self.phase = phase
        self.deadline = self._loop.time() + seconds
        if self.disconnected:
            self._cancel("client_disconnected")
            return
        if self._handle is None or self._handle.when() > self.deadline:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._loop.call_at(self.deadline, self._fire)

    def extend(self, seconds: float) -> None:
        """The current phase's deadline, ``seconds`` from now (the timer catches up when it fires)."""
        self.deadline = self._loop.time() + seconds

    def stop(self) -> None:
        """Watch nothing (between phases, and at the end)."""
        self.task = None
        self.phase = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def client_gone(self) -> None:
        """The client disconnected: cancel the watched phase now, or the next one as it starts."""
        self.disconnected = True
        if self._gone is not None:
            self._gone.set()
        if self.task is not None:
            self._cancel("client_disconnected")

    async def left(self) -> None:
        """Return when the client has gone away (:meth:`client_gone`, told by ``watch_disconnect``
        from the ASGI ``http.disconnect``): a request waiting for admission leaves the queue
        (``AdmissionQueue.wait``'s ``left``). Cancelling it is safe; it may be awaited again."""
        if self.disconnected:
            return
        if self._gone is None:
            self._gone = asyncio.Event()
        await self._gone.wait()

    def take(self) -> str | None:
        """The reason of this guard's cancellation, once (the caller has caught the CancelledError):
        the current task is uncancelled; None when the cancellation was not this guard's."""
        reason, self.reason = self.reason, None
        if reason is not None:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        return reason

    def _fire(self) -> None:
        self._handle = None
        if self.task is None or self.phase is None:
            return
        if self._loop.time() < self.deadline:  # moved forward since: wait for the new deadline
            self._handle = self._loop.call_at(self.deadline, self._fire)
            return
        self._cancel(f"{self.phase}_timeout")

    def _cancel(self, reason: str) -> None:
        task = self.task
        self.stop()
        if task is not None and not task.done() and self.reason is None:
            self.reason = reason
            task.cancel()


async def watch_disconnect(receive: Any, guard: Guard) -> None:
    """Wait for the client's ``http.disconnect`` (the body has been read) and tell ``guard``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            guard.client_gone()
            return
