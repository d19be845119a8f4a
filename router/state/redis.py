"""The router's state in Redis or Valkey (``state_backend: redis``): every router process and host
pointed at one server shares one view.

Every operation is one Lua script run server-side (``EVALSHA``; a server that lacks a script,
e.g. after a restart, gets it with ``SCRIPT LOAD`` and the call again), kept in ``router/state/lua/``
(package data): an entry script per operation, composed of the libraries its first line names
(``-- include: now reserve guard quota prefix``; :func:`lua`). ``admit`` is one script for every
combination of options -- the expiry of reservations past their hold, the check of the ranked
candidates, the quota guard and limits, then the pool's reservation, the quota booking and the
prefix record -- so a decision is one round trip whatever it carries; ``settle`` likewise releases,
folds the outcome into the statistics, settles or undoes the quotas and teaches the prefix
retention in one; ``view`` expires and reads what the decisions and status pages read. Time inside
the scripts is the server's (``TIME``), so routers whose clocks disagree still expire reservations
alike.

The script calls made during one event-loop iteration go to the server as one pipeline (redis-py's,
without a transaction: each script is atomic by itself), as the decision log groups its commits:
under load one round trip and one pass through the client's machinery serve every request of the
iteration (what a call alone would cost is mostly the client's; ``docs/results.md``).

Keys, all under ``<prefix>:{router}:`` (one hash tag, so a Redis Cluster keeps them in one slot,
as the multi-key scripts need): ``inflight`` (hash pool -> slots), ``held`` (hash reservation id ->
``slots:pool``), ``due`` (sorted set reservation id -> deadline in ms), ``expired`` (hash pool ->
count), ``stats:<pool>`` (hash of the estimator's fields), ``idem:<key>`` (string with a TTL; empty
while pending), ``epoch`` (this lifetime of the data: see below), ``restored:<epoch>:<log>`` (which
decision logs were restored into it); the prefix affinity index (``router.state.base``): ``pfx:b:<block
hash>`` (hash pool -> "stamp:ready ms", at most ``envs.prefix.VIEW_ENTRIES`` pools, expiring with
the age bound), ``pfx:sent`` / ``pfx:cap`` / ``pfx:ret`` (hashes per pool), ``pfx:pred:<decision>``
(the pool and the cached tokens predicted, until feedback or the age bound), ``sess:<session>``
(the pool its last request went to, or its committed migration's target, marked), ``fair`` (hash
tenant -> fairness counter, ``router.state.base``), ``ej`` (hash target -> its outlier ejection record:
``lua/lib/eject.lua``), ``restoring`` (the restores under way: below). Memory:
O(pools + reservations held + idempotency keys within their TTL).

A server that restarts without persistence (or is flushed) comes back empty: the ``epoch`` key is
gone. The routers notice within ``state_view_refresh_s`` (``router.app.factory``: each reads the epoch with
its shared view), one begins a new epoch (:meth:`RedisState.epoch`, recording the server's time), and
each decision log is replayed into it once (:meth:`RedisState.restore`, claimed per epoch and log):
the reservations of decisions made before the epoch began whose hold has not passed and whose
feedback has not come, and the idempotency keys still within their TTL. Decisions made after it
began were reserved in it live; a reservation already held is never booked twice.

A keyed request after a loss. Until the keys are back, a retry whose key the new epoch lacks would
be decided again -- a second placement for one Idempotency-Key, the case the key exists for (issue
21: 4 of 12 keys retried in the first half second). So the claim script refuses to claim a key the
state lacks -- answering ``{0}``/``{1}``, raised as :class:`router.state.base.StateRestoring`, the API's
503 ``state_restoring`` with ``Retry-After`` -- while (a) this router has not restored its log into
the current epoch (or there is none: the data is gone and nobody noticed yet), (b) the epoch is
younger than ``restore_window_s``, in which every live router notices it (each reads the epoch
every ``state_view_refresh_s``) and announces its restore, or (c) a restore announced for this
epoch has not ended (``restoring``: hash of ``<log>:<router>`` -> ``<epoch>|<deadline ms>``,
written before the log is read, removed after; the deadline, ``restore_lapse_s``, lets a router
that died restoring hold nobody back for long). A key the state holds is answered as ever (its
answer, or 409 while pending). The keys this process is deciding when a loss is noticed are put
back pending with the restore, so a retry elsewhere gets 409 until they are answered. What this
does not cover: a key answered by a router that is down while the data is lost (its log is
restored when it starts again: until then its keys within their TTL can be decided anew), or by
one that takes longer than the window to notice (an event loop stalled for a second).

A quota'd request after a loss. The same guard (``lua/lib/guard.lua``) holds back an admission that
charges a tenant quota (``admit.lua`` answers ``{2, 0|1}``, raised as
:class:`router.state.base.StateRestoring`): until every log is back the counters are not whole, and
a request admitted against them could exceed a limit. A reservation's record (``qr:<id>``) outlives
its settle, marked settled, for its record time, and ``quota_restore.lua`` books no id that has
one -- so a decision counted live in the new epoch is never counted a second time by a restore, whatever the routers' clocks say about when it was made.

Unreachable or slow server (a connection refused, or no answer within ``timeout_s``): every
operation raises :class:`router.state.base.StateUnavailable` (the API's 503; or the embedded view with
``state_fail_open``). One reconnect is tried per call, so a restarted server is picked up at once.
The URL may hold a password (``redis://:secret@host``, from the environment, not a config file);
it is only ever shown through :func:`redact`.
"""
from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Iterable, Sequence
from functools import cache
from importlib.resources import files
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from envs import prefix as px
from router.core.logs import iso
from router.core.settings import STATS_ALPHA
from router.state.base import (
    QUOTA_UNDO,
    Admission,
    Admitted,
    Affinity,
    Claim,
    Ejection,
    EjectionRule,
    Epoch,
    Released,
    Reserved,
    Settled,
    Settlement,
    StateRestoring,
    StateUnavailable,
    StateView,
    _check_reserve,
    _finite,
    check_rule,
)
from router.state.ledger import RECORD_S, QuotaReserved, QuotaSettled, QuotaUsage, QuotaVerdict
from xroute.schema.quota import WINDOW_S, day_index

_INCLUDE = "-- include:"


@cache
def _lua_file(name: str) -> str:
    return (files("router.state") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def lua(name: str, window_ms: int = round(WINDOW_S * 1000)) -> str:
    """The Lua script ``lua/<name>.lua``, its libraries (``lua/lib/<lib>.lua``, named on its first
    line: ``-- include: now reserve``) put in front, in that order; ``@WINDOW_MS@`` (the quota
    window, ``lua/lib/quota.lua``) replaced by ``window_ms``."""
    text = _lua_file(name)
    head, _, body = text.partition("\n")
    if head.startswith(_INCLUDE):
        text = "".join(_lua_file(f"lib/{lib}") for lib in head[len(_INCLUDE):].split()) + body
    return text.replace("@WINDOW_MS@", str(int(window_ms)))


#: the entry scripts (one per operation)
SCRIPTS = ("admit", "settle", "lookup", "view", "claim", "abandon", "epoch", "begin_restore", "restore",
           "quota_restore", "session_put", "fairness", "eject_report", "ejections")


def redact(url: str) -> str:
    """``url`` as it may be shown or logged: scheme, host, port and database, never a password."""
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "redis://(unparsable URL)"
    return f"{u.scheme}://{host}{port}{u.path}"


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _hash(flat: list[Any]) -> dict[str, int]:
    return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}


class RedisState:
    """The shared state on one Redis/Valkey server (module docstring); the operations of
    ``router.service.ports``."""

    backend = "redis"
    #: (no in-process quota counters: the decisions read the quotas with the shared view)
    quota_reader = None

    def __init__(self, url: str, prefix: str = "xroute", timeout_s: float = 0.5, alpha: float = STATS_ALPHA,
                 max_connections: int = 64, record_ttl_s: float = RECORD_S, quota_window_s: float = WINDOW_S,
                 restore_window_s: float | None = None, restore_lapse_s: float = 120.0):
        """``restore_window_s``: guard the idempotency keys and the quotas across a loss of the
        server's data (module docstring, "A keyed request after a loss"), as the app does
        (``state_restore_window_s``); None, for a process that restores no decision log into the
        state (a benchmark, a test of the operations): no guard."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.where = redact(url)
        self.alpha = alpha
        self.timeout_s = timeout_s
        #: the server's failure as last seen (an operation or :meth:`healthy`; None: it answered)
        self.error: str | None = None
        self._r = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=max_connections,
            retry=Retry(NoBackoff(), 1), client_name="xroute-router")
        base = f"{prefix}:{{router}}:"
        self.base = base
        self._keys = [base + "inflight", base + "held", base + "due", base + "expired"]
        self._pfx_keys = [base + "pfx:sent", base + "pfx:cap", base + "pfx:ret"]
        window = max(1, round(quota_window_s * 1000))  # (60 s; tests shorten it to watch it slide)
        scripts = {name: self._r.register_script(lua(name, window)) for name in SCRIPTS}
        self._admit, self._settle, self._lookup, self._view = (scripts[n] for n in ("admit", "settle", "lookup", "view"))
        self._claim, self._abandon, self._epoch = scripts["claim"], scripts["abandon"], scripts["epoch"]
        self._begin_restore, self._restore = scripts["begin_restore"], scripts["restore"]
        self._q_restore, self._sess_put = scripts["quota_restore"], scripts["session_put"]
        self._fairness = scripts["fairness"]
        self._ej_report, self._ej_read = scripts["eject_report"], scripts["ejections"]
        self._ej_key = [base + "ej"]
        self.record_ttl_ms = _ms(record_ttl_s)
        #: idempotency and quotas across a loss (module docstring): the epoch this router has restored
        #: its log into ('*': no guard), the window after an epoch begins, how long an announced restore
        #: holds the others back at most, this process's name in the ``restoring`` hash, and the keys it
        #: has claimed and not yet completed or abandoned (claimed again, pending, in a new epoch)
        self._restored_epoch = "*" if restore_window_s is None else ""
        self.restore_window_s = restore_window_s or 0.0
        self.restore_lapse_s = restore_lapse_s
        self._instance = secrets.token_hex(6)
        self._claimed: dict[str, float] = {}
        #: the script calls of the current event-loop iteration, and the pipelines in flight
        self._batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]] = []
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[None]] = set()

    # -------------------------------------------------------------- the pipeline of an iteration
    def _down(self, e: BaseException) -> StateUnavailable:
        self.error = f"shared state {self.where}: {type(e).__name__}: {' '.join(str(e).split())}"[:300]
        return StateUnavailable(self.error)

    def _run(self, script: Any, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        """Queue one script call with this event-loop iteration's (module docstring); its future."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._batch.append((script, keys, args, fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)  # after every request of this iteration has queued its call
        return fut

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._batch = self._batch, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]]) -> None:
        """The batch as one pipeline (one round trip; no transaction: each script is atomic on its
        own). A script the server lacks (restarted) is loaded and its calls sent again."""
        try:
            results = await self._pipeline(batch)
            self.error = None
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                for script in {id(batch[i][0]): batch[i][0] for i in missing}.values():
                    await self._r.script_load(script.script)
                again = await self._pipeline([batch[i] for i in missing])
                for i, r in zip(missing, again):
                    results[i] = r
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            results = [self._down(e)] * len(batch)
        except Exception as e:  # anything else: never leave a request waiting
            results = [e] * len(batch)
        for (script, keys, args, fut), r in zip(batch, results):
            if fut.done():  # the request went away meanwhile: what it took is given back --
                if script is self._admit and isinstance(r, list) and r and r[0] == 1:  # its pool, quotas, counter
                    fair = (args[-2], -float(args[-1])) if args[-2] else None
                    self._undo(self._settle, self._keys, self._settle_args(Settlement(args[1], quota=QUOTA_UNDO,
                                                                                      fair=fair)))
                elif script is self._claim and r is None:  # an idempotency key it claimed (else 409s for the TTL)
                    self._undo(self._abandon, keys, [])
            elif isinstance(r, BaseException):
                fut.set_exception(r)
            else:
                fut.set_result(r)

    def _undo(self, script: Any, keys: list[str], args: list[Any]) -> None:
        """Queue ``script`` with the next pipeline, its answer awaited by nobody."""
        self._run(script, keys, args).add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _pipeline(self, batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]]) -> list[Any]:
        async with self._r.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return await pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

    # -------------------------------------------------------------- the decision path
    def _admit_args(self, a: Admission) -> list[Any]:
        _check_reserve(a.candidates, a.hold_s, a.slots)
        args: list[Any] = [self.base, a.reservation_id, _ms(a.hold_s), a.slots, len(a.candidates)]
        for pool, capacity in a.candidates:
            args += (pool, int(capacity))
        q = a.quota
        if q is None:
            args.append(0)
        else:
            args += [1, int(q.tokens), repr(float(q.usd)), self.record_ttl_ms, len(q.buckets), self._restored_epoch,
                     max(0, math.ceil(self.restore_window_s * 1000))]
            for b in q.buckets:
                args += [b.key, *b.limits]
        p = a.prefix
        if p is None:
            args.append(0)
        else:
            hashes = p.hashes.tolist()
            args += [1, _ms(p.ttl_s), 0 if p.session is None else 1, p.session or "", px.VIEW_ENTRIES, len(hashes),
                     *hashes, len(p.candidates)]
            for pool, (cap, predicted, ready_in) in p.candidates.items():
                args += (pool, int(cap), repr(float(predicted)), max(0, math.ceil(ready_in * 1000)))
        f = a.fair
        args += ("", 0) if f is None else (f[0], repr(float(f[1])))
        return args

    async def admit(self, a: Admission) -> Admitted:
        """One script, one round trip, whatever ``a`` carries (``lua/admit.lua``). A caller
        cancelled before the answer comes gets nothing taken: what the script took is given back
        when the answer arrives (``_send``)."""
        got = await self._run(self._admit, self._keys, self._admit_args(a))
        kind = int(got[0])
        if kind == 1:
            return Admitted(got[1].decode())
        if kind == 0:
            return Admitted(None)
        if kind == 2:
            raise StateRestoring(
                f"shared state {self.where}: it lost its data and is being restored from the routers' decision "
                "logs; a request that counts against a tenant quota is not admitted until every log is back, so the "
                "counters are whole")
        retry = float(got[6])
        return Admitted(None, QuotaVerdict(False, int(got[1]), got[2].decode(), float(got[3]), float(got[4]),
                                           float(got[5]), math.inf if retry < 0 else retry / 1000.0))

    async def report(self, outcomes: Sequence[tuple[str, bool]], rule: EjectionRule) -> list[Ejection]:
        """Attempts' outcomes folded into their targets' ejection records (``lua/eject_report.lua``;
        the arithmetic: ``router.state.base.ejection_step``), one script."""
        check_rule(rule)
        args: list[Any] = [rule.after, round(rule.base_s * 1000), round(rule.max_s * 1000)]
        for target, failed in outcomes:
            args += (target, 1 if failed else 0)
        got = await self._run(self._ej_report, self._ej_key, args)
        return [Ejection(target, int(got[5 * i]), int(got[5 * i + 1]),
                         int(got[5 * i + 3]) / 1000.0 if int(got[5 * i + 2]) else None, False, bool(int(got[5 * i + 4])))
                for i, (target, _) in enumerate(outcomes)]

    async def ejections(self, probe: Sequence[str] = (), lease_s: float = 0.0) -> list[Ejection]:
        """Every target ejected, half-open or with failures counted; the free probes of the
        half-open ones of ``probe`` taken for ``lease_s`` (``lua/ejections.lua``)."""
        got = await self._run(self._ej_read, self._ej_key, [max(1, round(lease_s * 1000)), *probe])
        return [Ejection(got[i].decode(), int(got[i + 1]), int(got[i + 2]),
                         int(got[i + 4]) / 1000.0 if int(got[i + 3]) else None, bool(int(got[i + 5])))
                for i in range(0, len(got), 6)]

    def _settle_args(self, s: Settlement) -> list[Any]:
        o, q = s.outcome, s.quota
        args: list[Any] = [self.base, s.reservation_id, 1 if s.release else 0]
        if o is None:
            args += ["", "", "", "", 0]
        else:
            _finite(o.ttft_ms, "ttft_ms")
            _finite(o.duration_ms, "duration_ms")
            args += [o.pool, repr(self.alpha), "" if o.ttft_ms is None else repr(float(o.ttft_ms)),
                     "" if o.duration_ms is None else repr(float(o.duration_ms)), 1 if o.failed else 0]
        if q is None:
            args += ["", "", ""]
        elif q.undo:
            args += ["u", "", ""]
        else:
            args += ["s", "" if q.tokens is None else int(q.tokens), "" if q.usd is None else repr(float(q.usd))]
        args += ["" if s.cached_tokens is None else repr(float(s.cached_tokens)), repr(float(s.retention_alpha))]
        f = s.fair
        args += ("", 0) if f is None else (f[0], repr(float(f[1])))
        return args

    async def settle(self, s: Settlement) -> Settled:
        """One script, one round trip, whatever ``s`` carries (``lua/settle.lua``)."""
        released, quota, learned = await self._run(self._settle, self._keys, self._settle_args(s))
        return Settled(released.decode() or None, bool(quota), learned.decode() or None)

    async def lookup(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        b = self.base + "pfx:b:"
        keys = [*self._pfx_keys, self.base + "sess:" + (session or ""), *(b + str(h) for h in hashes.tolist())]
        flat, sess = await self._run(self._lookup, keys, [_ms(ttl_s), 0 if session is None else 1])
        runs, ret = {}, {}
        for i in range(0, len(flat), 3):
            pool = flat[i].decode()
            runs[pool] = int(flat[i + 1])
            ret[pool] = float(flat[i + 2])
        return Affinity(runs, ret, None if not sess else sess.decode())

    async def view(self, quota_keys: Sequence[str] = (), durations: bool = False) -> StateView:
        inflight, expired, durs, q = await self._run(self._view, self._keys,
                                                     [self.base, 1 if durations else 0, *quota_keys])
        usage = {k: QuotaUsage(int(q[4 * i]), int(float(q[4 * i + 1])), int(float(q[4 * i + 2])), float(q[4 * i + 3]))
                 for i, k in enumerate(quota_keys)}
        return StateView({p: n for p, n in _hash(inflight).items() if n}, _hash(expired),
                         {durs[i].decode(): float(durs[i + 1]) for i in range(0, len(durs), 2)}, usage)

    async def fairness(self, tenants: Sequence[str], lift: Sequence[str] = ()) -> dict[str, float]:
        """The fairness counters of ``tenants``, ``lift`` lifted first (``lua/fairness.lua``; the
        admission queue's, one round trip, never on the decision path)."""
        lifting = set(lift)
        names = [*lift, *(t for t in tenants if t not in lifting)]
        got = await self._run(self._fairness, [self.base + "fair"], [len(lift), *names])
        counters = {t: float(v) for t, v in zip(names, got)}
        return {t: counters[t] for t in tenants}

    async def put_session(self, session_id: str, value: bytes, ttl_s: float) -> None:
        await self._run(self._sess_put, [self.base + "sess:" + session_id], [bytes(value), _ms(ttl_s)])

    # -------------------------------------------------------------- idempotency
    async def claim(self, key: str, ttl_s: float) -> Claim:
        got = await self._run(self._claim, [self.base + "idem:" + key, self.base + "epoch", self.base + "restoring"],
                              [_ms(ttl_s), self._restored_epoch, max(0, math.ceil(self.restore_window_s * 1000))])
        if got is None:
            now = time.monotonic()
            if len(self._claimed) > 4096:  # (each is dropped by complete or abandon; this only bounds a leak)
                self._claimed = {k: u for k, u in self._claimed.items() if u > now}
            self._claimed[key] = now + ttl_s
            return Claim("new")
        if isinstance(got, list):  # ({0}: this router's own restore is still to come; {1}: others')
            raise StateRestoring(
                f"shared state {self.where}: it lost its data and is being restored from the routers' decision "
                "logs; an Idempotency-Key it does not hold yet may have been answered before, so the request is not "
                "decided anew until every log is back")
        return Claim("pending") if got == b"" else Claim("done", bytes(got))

    async def complete(self, key: str, answer: bytes, ttl_s: float) -> None:
        if not answer:
            raise ValueError("an idempotent answer must not be empty")
        self._claimed.pop(key, None)
        try:
            await self._r.set(self.base + "idem:" + key, bytes(answer), px=_ms(ttl_s))
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise self._down(e) from None

    async def abandon(self, key: str) -> None:
        self._claimed.pop(key, None)
        await self._run(self._abandon, [self.base + "idem:" + key], [])

    # -------------------------------------------------------------- recovery
    async def epoch(self) -> Epoch:
        got = (await self._run(self._epoch, [self.base + "epoch"], [secrets.token_hex(8)])).decode()
        return Epoch(got, float(got.partition(":")[0]))

    async def begin_restore(self, epoch: Epoch, log_id: str) -> None:
        await self._run(self._begin_restore, [self.base + "restoring"],
                        [f"{log_id}:{self._instance}", epoch.id, _ms(self.restore_lapse_s)])

    async def end_restore(self, epoch: Epoch, log_id: str, restored: bool) -> None:
        try:
            await self._r.hdel(self.base + "restoring", f"{log_id}:{self._instance}")
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise self._down(e) from None
        if restored and self._restored_epoch != "*":
            self._restored_epoch = epoch.id

    async def _quota_restore(self, events: list[QuotaReserved | QuotaSettled], now_wall: float) -> dict[str, int]:
        """The quota events of a decision log, booked (``lua/quota_restore.lua``; limits are not checked)."""
        args: list[Any] = []
        for ev in events:
            if isinstance(ev, QuotaReserved):
                if ev.keys:
                    args += ["R", ev.reservation_id, "\n".join(ev.keys), int(ev.tokens), repr(float(ev.usd)),
                             max(0, int((now_wall - ev.at) * 1000)), day_index(ev.at),
                             int((ev.until - now_wall) * 1000)]
            else:
                args += ["S", ev.reservation_id, "", int(ev.tokens), repr(float(ev.usd)), 0, 0, 0]
        out = {"quota_reserved": 0, "quota_settled": 0}
        for i in range(0, len(args), 800):  # 100 events a script call, in order
            booked, settled = await self._run(self._q_restore, self._keys[:1],
                                              [self.base, self.record_ttl_ms, *args[i:i + 800]])
            out["quota_reserved"] += int(booked)
            out["quota_settled"] += int(settled)
        return out

    async def _pending_again(self) -> None:
        """The keys this process is deciding now: pending in the new epoch too (a retry elsewhere gets 409)."""
        now_mono = time.monotonic()
        pending = [(k, until) for k, until in list(self._claimed.items()) if until > now_mono]
        if pending:
            async with self._r.pipeline(transaction=False) as pipe:
                for key, until in pending:
                    pipe.set(self.base + "idem:" + key, b"", px=_ms(until - now_mono), nx=True)
                await pipe.execute()

    async def restore(self, epoch: Epoch | None, log_id: str,
                      events: Iterable[Reserved | Released | QuotaReserved | QuotaSettled],
                      answers: Iterable[tuple[str, bytes, float]], now_wall: float | None = None
                      ) -> dict[str, int] | None:
        """Put back into ``epoch`` what the server lost and one decision log knows
        (``router.service.ports.Recovery.restore``), once per epoch and log: None when another
        router restored this log into this epoch already."""
        if epoch is None:
            raise ValueError("a shared state restores into an epoch (RedisState.epoch)")
        now_wall = time.time() if now_wall is None else now_wall
        done = f"{self.base}restored:{epoch.id}:{log_id}"
        try:
            await self._pending_again()
            if not await self._r.set(done, iso(time.time()), nx=True, ex=7 * 86400):
                return None
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise self._down(e) from None
        try:
            return await self._restore_log(events, answers, now_wall)
        except BaseException as e:  # let the next try do it all again (it books nothing twice)
            try:
                await self._r.delete(done)
            except (RedisError, OSError):
                pass
            if isinstance(e, (RedisConnectionError, RedisTimeoutError, OSError)):
                raise self._down(e) from None
            raise

    async def _restore_log(self, events: Iterable[Reserved | Released | QuotaReserved | QuotaSettled],
                           answers: Iterable[tuple[str, bytes, float]], now_wall: float) -> dict[str, int]:
        out = {"reserved": 0, "released": 0, "idempotency_keys": 0}
        args: list[Any] = []
        quota: list[QuotaReserved | QuotaSettled] = []
        for ev in events:
            if isinstance(ev, (QuotaReserved, QuotaSettled)):
                quota.append(ev)
            elif isinstance(ev, Reserved) and ev.until > now_wall:
                args += ["R", ev.reservation_id, ev.pool, ev.slots, _ms(ev.until - now_wall)]
            elif isinstance(ev, Released):
                args += ["X", ev.reservation_id, "", 0, 0]
        for i in range(0, len(args), 1000):  # 200 events a script call, in order
            r, x = await self._run(self._restore, self._keys[:3], args[i:i + 1000])
            out["reserved"] += int(r)
            out["released"] += int(x)
        if quota:
            out.update(await self._quota_restore(quota, now_wall))
        async with self._r.pipeline(transaction=False) as pipe:
            for key, answer, until in answers:
                if until > now_wall and answer:
                    pipe.set(self.base + "idem:" + key, bytes(answer), px=_ms(until - now_wall), nx=True)
            got = await pipe.execute()
        out["idempotency_keys"] = sum(1 for g in got if g)
        return out

    # -------------------------------------------------------------- life
    async def healthy(self) -> bool:
        """A ``PING`` within ``timeout_s`` (the readiness probe; its verdict goes into ``error``)."""
        try:
            ok = bool(await self._r.ping())
        except (RedisError, OSError) as e:
            self._down(e)
            return False
        if ok:
            self.error = None
        return ok

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "url": self.where, "prefix": self.base, "timeout_s": self.timeout_s}

    async def close(self) -> None:
        await self._r.aclose()
