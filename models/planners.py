"""Capacity planners for the provisioning world (``envs.provisioning``): the baselines a user would
otherwise pick, and the hindsight oracle.

Every planner gets the world's :class:`~envs.provisioning.PlanContext` at reset and returns, at each
epoch, a target number of instances per pool from the :class:`~envs.provisioning.PlanView` alone
(decision-time information: ``tests/test_no_foresight.py``). Only :class:`HindsightOracle` reads the
world's :meth:`~envs.provisioning.ProvisionWorld.hindsight` -- the true load and availability of the
whole window -- and says so in its name.

The capacity model they share (:func:`capacity_table`): one instance of a pool serves a request
class at its SLO with at most ``k*`` requests per replica, the largest ``k`` whose time per output
token, at the 99th percentile of the service-time noise, stays within the class's TPOT objective and
whose TTFT (RTT + prefill + one token, same percentile) within its TTFT objective; by Little's law a
replica then completes ``k* / service(k*)`` requests a second, an instance ``per_inst`` times that,
of which ``planners.headroom`` is planned (queueing margin). A pool that cannot meet a class's SLO
even alone has no capacity for it.

The baselines (sources and the rules implemented: ``docs/capacity.md``):

* :class:`StaticOnDemand` -- static peak provisioning: the on-demand pool with the lowest price per
  unit of capacity for the class mix, sized once for the busiest ``forecast.peak_s`` window of the
  history before the window (plus ``forecast.margin``), never changed.
* :class:`ReactiveAutoscaler` -- Kubernetes HPA's rule on that pool: ``desired = ceil(ready x
  observed / target)`` with the observed metric the mean requests in flight per replica (Knative
  KPA's concurrency) and the target ``target_utilization`` x the replica's SLO-feasible
  concurrency; no change within ``tolerance``; scale-up stabilization 0 s and scale-down 300 s
  (HPA's defaults: the highest recommendation of the last five minutes).
* :class:`SpotHedge` -- SkyServe's policy as SkyPilot implements it (``sky/serve/autoscalers.py``
  ``FallbackRequestRateAutoscaler``, ``sky/serve/spot_placer.py`` ``DynamicFallbackSpotPlacer``).
* :class:`Melange` -- a Mélange-style mix: every epoch an ILP (``scipy.optimize.milp``) over the
  pools for the forecast load and the classes' SLOs.
* :class:`HindsightOracle` -- the same ILP over the whole window and every epoch at once, with the
  true load and availability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from envs.provisioning import Hindsight, PlanContext, PlanView
from xroute.config import PlannersConfig
from xroute.errors import ConfigError

#: the quantile of the lognormal service-time noise the capacity model plans for
_Z99 = 2.3263478740408408


class Planner(Protocol):
    name: str

    def reset(self, ctx: PlanContext) -> None: ...

    def plan(self, view: PlanView) -> np.ndarray: ...


@dataclass
class ClassProfile:
    """Per request class: mean input and output tokens, and each origin's share (from the history
    and, where given, the window's requests so far -- what a planner knows)."""

    mean_in: np.ndarray
    mean_out: np.ndarray
    origin_share: np.ndarray  # (C, origins)


def class_profile(ctx: PlanContext, view: PlanView | None = None) -> ClassProfile:
    """Mean input, mean output and origin mix per class from the history (and the window's
    arrivals so far, and the outputs completed so far, when ``view`` is given)."""
    C, n_org = len(ctx.class_names), ctx.rtt_ms.shape[0]
    cls, inp, org = ctx.hist_class, ctx.hist_in, ctx.hist_origin
    if view is not None and view.arr_t.size:
        cls = np.concatenate([cls, view.arr_class])
        inp = np.concatenate([inp, view.arr_in])
        org = np.concatenate([org, view.arr_origin])
    n = np.bincount(cls, minlength=C).astype(float)
    mean_in = np.bincount(cls, weights=inp, minlength=C) / np.maximum(n, 1.0)
    done = np.isfinite(ctx.hist_out)  # (NaN: a request whose output is not known yet)
    hn = np.bincount(ctx.hist_class[done], minlength=C).astype(float)
    mean_out = np.where(hn > 0, np.bincount(ctx.hist_class[done], weights=ctx.hist_out[done], minlength=C)
                        / np.maximum(hn, 1.0), np.nan)
    if view is not None:
        mean_out = np.where(np.isfinite(view.out_mean), view.out_mean, mean_out)
    mean_in = np.where(n > 0, mean_in, 1000.0)  # (a class nothing is known of: a nominal request)
    mean_out = np.where(np.isfinite(mean_out), mean_out, 200.0)
    share = np.zeros((C, n_org))
    ok = org >= 0
    np.add.at(share, (cls[ok], org[ok]), 1.0)
    tot = share.sum(axis=1, keepdims=True)
    share = np.where(tot > 0, share / np.maximum(tot, 1.0), 1.0 / max(n_org, 1))
    return ClassProfile(mean_in, mean_out, share)


def capacity_table(ctx: PlanContext, prof: ClassProfile, headroom: float) -> tuple[np.ndarray, np.ndarray]:
    """(requests/s one instance of each pool serves of each class at its SLO x ``headroom``, the
    SLO-feasible requests per replica ``k*``), both (P, C) (module docstring)."""
    pl = ctx.pools
    P, C = pl.n, len(ctx.class_names)
    cap = np.zeros((P, C))
    kstar = np.zeros((P, C))
    f99 = np.exp(_Z99 * pl.sigma - 0.5 * pl.sigma ** 2)
    for c in range(C):
        fit = pl.model == ctx.class_model[c]
        rtt = prof.origin_share[c] @ ctx.rtt_ms  # (P,) ms
        tpot_slo = ctx.class_tpot_ms[c] / 1000.0
        ttft_slo = ctx.class_ttft_ms[c] / 1000.0
        # largest k with tpot * (1 + growth (k - 1)) * f99 <= tpot_slo
        with np.errstate(divide="ignore", invalid="ignore"):
            kmax = np.where(pl.growth > 0, 1.0 + (tpot_slo / (pl.tpot_s * f99) - 1.0) / pl.growth, np.inf)
        k = np.minimum(np.floor(kmax), pl.conc)
        tp = pl.tpot_s * (1.0 + pl.growth * (np.maximum(k, 1.0) - 1.0))
        pf = prof.mean_in[c] / pl.prefill_tok_s
        ttft_ok = rtt / 1000.0 + (pf + tp) * f99 <= ttft_slo
        ok = fit & (k >= 1) & ttft_ok
        svc = pf + prof.mean_out[c] * tp
        cap[:, c] = np.where(ok, pl.per_inst * k / svc * headroom, 0.0)
        kstar[:, c] = np.where(ok, k, 0.0)
    return cap, kstar


def mix_capacity(cap: np.ndarray, share: np.ndarray) -> np.ndarray:
    """Requests/s of the class mix ``share`` one instance of each pool serves (0 where a class with
    a share cannot be served there): the harmonic combination."""
    need = share[None, :] > 0
    with np.errstate(divide="ignore"):
        inv = np.where(need, share[None, :] / np.where(cap > 0, cap, np.nan), 0.0)
    tot = np.nansum(inv, axis=1)
    bad = np.any(need & (cap <= 0), axis=1)
    return np.where(bad | (tot <= 0), 0.0, 1.0 / np.where(tot > 0, tot, 1.0))


def peak_rate(t: np.ndarray, cls: np.ndarray, C: int, t_lo: float, t_hi: float, peak_s: float) -> np.ndarray:
    """Per class, the busiest ``peak_s`` sub-window's arrival rate among arrivals in [t_lo, t_hi)."""
    sel = (t >= t_lo) & (t < t_hi)
    if not sel.any() or t_hi <= t_lo:
        return np.zeros(C)
    nb = max(1, math.ceil((t_hi - t_lo) / peak_s))
    b = np.minimum(((t[sel] - t_lo) // peak_s).astype(np.int64), nb - 1)
    grid = np.zeros((nb, C))
    np.add.at(grid, (b, cls[sel]), 1.0)
    return grid.max(axis=0) / peak_s  # type: ignore[no-any-return]


def forecast(ctx: PlanContext, view: PlanView, cfg: PlannersConfig) -> np.ndarray:
    """Per class: the busiest ``peak_s`` window's rate over the last ``window_s`` seconds before the
    epoch (the history's requests included), times ``1 + margin`` -- the past only."""
    fc = cfg.forecast
    t = np.concatenate([ctx.hist_t, view.arr_t])
    c = np.concatenate([ctx.hist_class, view.arr_class])
    return peak_rate(t, c, len(ctx.class_names), view.t - fc.window_s, view.t, fc.peak_s) * (1.0 + fc.margin)


def _price_now(ctx: PlanContext, view: PlanView | None, price0: np.ndarray) -> np.ndarray:
    return view.price_h if view is not None else price0


def best_on_demand_pool(ctx: PlanContext, prof: ClassProfile, cap: np.ndarray, price_h: np.ndarray,
                        share: np.ndarray) -> int:
    """The on-demand pool with the lowest price per request/s of the class mix."""
    mix = mix_capacity(cap, share)
    cost = np.where((~ctx.pools.is_spot) & (mix > 0) & np.isfinite(price_h), price_h / np.where(mix > 0, mix, 1.0),
                    np.inf)
    if not np.isfinite(cost).any():
        raise ConfigError("planners: no on-demand pool can serve every request class at its SLO")
    return int(np.argmin(cost))


def _history_share(ctx: PlanContext) -> np.ndarray:
    C = len(ctx.class_names)
    n = np.bincount(ctx.hist_class, minlength=C).astype(float)
    return n / n.sum() if n.sum() > 0 else np.full(C, 1.0 / C)


def _pool_index(ctx: PlanContext, offering: str) -> int:
    hits = [p for p, pid in enumerate(ctx.pools.ids) if pid == offering or pid.split("@", 1)[1] == offering]
    if not hits:
        raise ConfigError(f"planners.static: field 'offering': unknown offering '{offering}'")
    return hits[0]


class _Base:
    name = "planner"
    display_name = "planner"

    def __init__(self, cfg: PlannersConfig | None = None):
        self.cfg = cfg or PlannersConfig()

    def reset(self, ctx: PlanContext) -> None:
        self.ctx = ctx
        if ctx.hist_t.size == 0:
            raise ConfigError(f"{self.name}: needs the requests before the window (its history); evaluate a window "
                              "with requests before it (--window validation or test)")
        self.prof = class_profile(ctx)
        self.cap, self.kstar = capacity_table(ctx, self.prof, self.cfg.headroom)
        self.share = _history_share(ctx)

    def _targets(self) -> np.ndarray:
        return np.zeros(self.ctx.pools.n, dtype=np.int64)


class StaticOnDemand(_Base):
    """Static peak provisioning on demand (module docstring)."""

    name = display_name = "static-ondemand"

    def reset(self, ctx: PlanContext) -> None:
        super().reset(ctx)
        self._n: int | None = None

    def plan(self, view: PlanView) -> np.ndarray:
        if self._n is None:  # sized once, at the first epoch, from the history
            ctx, cfg = self.ctx, self.cfg
            p = _pool_index(ctx, cfg.static.offering) if cfg.static.offering else \
                best_on_demand_pool(ctx, self.prof, self.cap, view.price_h, self.share)
            peak = peak_rate(ctx.hist_t, ctx.hist_class, len(ctx.class_names), float(ctx.hist_t.min()), view.t,
                             cfg.forecast.peak_s) * (1.0 + cfg.forecast.margin)
            need = float(np.sum(np.where(self.cap[p] > 0, peak / np.where(self.cap[p] > 0, self.cap[p], 1.0), 0.0)))
            self._p, self._n = p, min(max(1, math.ceil(need)), ctx.max_instances)
        out = self._targets()
        out[self._p] = self._n
        return out


class ReactiveAutoscaler(_Base):
    """HPA's rule with KPA's concurrency metric on the static pool (module docstring)."""

    name = display_name = "autoscaler"

    def reset(self, ctx: PlanContext) -> None:
        super().reset(ctx)
        self._static = StaticOnDemand(self.cfg)
        self._static.reset(ctx)
        self._recs: list[tuple[float, int]] = []
        self._cur: int | None = None
        self._p = 0

    def plan(self, view: PlanView) -> np.ndarray:
        a = self.cfg.autoscaler
        if self._cur is None:  # starts where static peak provisioning would (a service already running)
            self._static.plan(view)
            self._p, self._cur = self._static._p, int(self._static._n or 1)
        p = self._p
        ready = int(view.ready[p])
        reps = ready * float(self.ctx.pools.per_inst[p])
        k_slo = float(np.min(self.kstar[p][self.share > 0])) if np.any(self.share > 0) else 1.0
        target = a.target_utilization * max(k_slo, 1.0)
        held = int(view.held[p])
        if reps > 0:  # requests in flight per replica (the epoch's mean), with those the router's queue holds
            queued = float(view.queued[self.ctx.class_model == self.ctx.pools.model[p]].sum())
            observed = (float(view.work_s[p]) / self.ctx.epoch_s + queued) / reps
            ratio = observed / target
            desired = held if abs(ratio - 1.0) <= a.tolerance else math.ceil(ready * ratio)
        else:  # no metric (nothing ready yet): HPA keeps the current count
            desired = int(self._cur)
        desired = max(desired, a.min_replicas)
        self._recs.append((view.t, desired))
        # stabilization (HPA): scaling down takes the highest recommendation of the window, scaling up the lowest
        down = [d for t, d in self._recs if t > view.t - a.scale_down_stabilization_s] or [desired]
        up = [d for t, d in self._recs if t > view.t - a.scale_up_stabilization_s] or [desired]
        horizon = max(a.scale_down_stabilization_s, a.scale_up_stabilization_s)
        self._recs = [(t, d) for t, d in self._recs if t > view.t - horizon - self.ctx.epoch_s]
        cur = int(self._cur)
        if desired > cur:
            new = max(cur, min(up))
        elif desired < cur:
            new = min(cur, max(down))
        else:
            new = cur
        self._cur = int(min(new, self.ctx.max_instances))
        out = self._targets()
        out[p] = self._cur
        return out


class SpotHedge(_Base):
    """SkyServe's SpotHedge as SkyPilot implements it (``docs/capacity.md`` lists the rules):

    * the target ``N_tar = ceil(qps / target_qps_per_replica)`` over the last 60 s (SkyServe's QPS
      window), with hysteresis: raised after ``upscale_delay_s`` of consecutive higher targets,
      lowered after ``downscale_delay_s`` of lower ones (at once from zero);
    * spot replicas ``N_tar + num_overprovision - base_ondemand_fallback_replicas``, each new one in
      the *active* location (pool) holding the fewest, ties to the cheapest; a location where a
      replica was preempted or failed to launch becomes *preempted*, one where a replica is ready
      *active* again, and all are active again when at most one is left active;
    * on-demand replicas ``base + max(0, spot target - ready spot)`` (dynamic fallback), at most
      ``N_tar``, in the cheapest on-demand pool of the replica's accelerators;
    * scale-down removes launching replicas before ready ones (SkyPilot's status order).
    """

    name = display_name = "spothedge"

    def reset(self, ctx: PlanContext) -> None:
        super().reset(ctx)
        s = self.cfg.spothedge
        static = StaticOnDemand(self.cfg)
        static.reset(ctx)
        p0 = _pool_index(ctx, self.cfg.static.offering) if self.cfg.static.offering else None
        self._static, self._p0 = static, p0
        self._accs = set(s.accelerators) if s.accelerators else None
        self._n_tar: int | None = None
        self._up = self._down = 0

    def _setup(self, view: PlanView) -> None:
        pl, s = self.ctx.pools, self.cfg.spothedge
        if self._accs is None:
            self._static.plan(view)
            self._accs = {pl.accelerator[self._static._p]}
        acc = np.array([a in self._accs for a in pl.accelerator])
        mix = mix_capacity(self.cap, self.share)
        self.spot = np.flatnonzero(acc & pl.is_spot & (mix > 0))
        od = np.flatnonzero(acc & ~pl.is_spot & (mix > 0))
        if od.size == 0:
            raise ConfigError(f"planners.spothedge: field 'accelerators': no on-demand pool of {sorted(self._accs)} can "
                              "serve the request classes at their SLO")
        self.od = od
        self.qps_per = s.target_qps_per_replica or float(np.median(mix[od]))
        self.active = np.ones(self.spot.size, dtype=bool)
        self._n_tar = self._target(view, first=True)

    def _qps(self, view: PlanView) -> float:
        t = np.concatenate([self.ctx.hist_t, view.arr_t])
        return float(((t >= view.t - 60.0) & (t < view.t)).sum()) / 60.0

    def _target(self, view: PlanView, first: bool = False) -> int:
        raw = max(1, min(self.ctx.max_instances, math.ceil(self._qps(view) / self.qps_per)))
        if first or not self._n_tar:
            return raw
        s, dt = self.cfg.spothedge, self.ctx.epoch_s
        up_n, down_n = int(s.upscale_delay_s / dt), int(s.downscale_delay_s / dt)
        cur = self._n_tar
        if raw > cur:
            self._up, self._down = self._up + 1, 0
            if self._up >= up_n:
                self._up = 0
                return raw
        elif raw < cur:
            self._down, self._up = self._down + 1, 0
            if self._down >= down_n:
                self._down = 0
                return raw
        else:
            self._up = self._down = 0
        return cur

    def plan(self, view: PlanView) -> np.ndarray:
        s = self.cfg.spothedge
        if self._n_tar is None:
            self._setup(view)
        else:
            self._n_tar = self._target(view)
        n_tar = int(self._n_tar or 1)
        spot = self.spot
        # the placer's state: preempted where a replica was noticed or failed to launch, active where one is ready
        bad = (view.noticed_last[spot] > 0) | (view.failed_launches[spot] > 0)
        self.active[bad] = False
        self.active[(view.ready[spot] > 0) & ~bad] = True
        if self.active.sum() <= 1 and (~self.active).any():
            self.active[:] = True
        held = view.held[spot].astype(np.int64).copy()
        want = max(0, n_tar + s.num_overprovision - s.base_ondemand_fallback_replicas)
        have = int(held.sum())
        price = np.nan_to_num(view.price_h[spot], nan=np.inf)
        if have < want:
            for _ in range(want - have):
                cand = np.flatnonzero(self.active)
                if cand.size == 0:
                    break
                k = cand[np.lexsort((cand, price[cand], held[cand]))[0]]
                held[k] += 1
        elif have > want:
            extra = have - want
            launching = view.launching[spot].astype(np.int64).copy()
            for _ in range(extra):  # launching replicas first, from the location holding most
                src = np.flatnonzero(launching > 0)
                if src.size == 0:
                    src = np.flatnonzero(held > 0)
                k = src[np.argmax(held[src])]
                held[k] -= 1
                launching[k] = max(launching[k] - 1, 0)
        ready_spot = int(view.ready[spot].sum())
        od_n = s.base_ondemand_fallback_replicas
        if s.dynamic_ondemand_fallback:
            od_n += max(0, want - ready_spot)
        od_n = min(od_n, n_tar)
        out = self._targets()
        out[spot] = held
        price_od = np.nan_to_num(view.price_h[self.od], nan=np.inf)
        keep = self.od[view.held[self.od] > 0]
        od_pool = int(keep[0]) if keep.size else int(self.od[int(np.argmin(price_od))])
        out[od_pool] = od_n
        return np.minimum(out, self.ctx.max_instances)


def _solve_milp(c: np.ndarray, A: Any, lo: np.ndarray, hi: np.ndarray, integrality: np.ndarray, lb: np.ndarray,
                ub: np.ndarray, time_limit: float, gap: float) -> np.ndarray:
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality, bounds=Bounds(lb, ub),
               options={"time_limit": time_limit, "mip_rel_gap": gap, "disp": False})
    if res.x is None:
        raise RuntimeError(f"capacity ILP: no solution ({res.message})")
    return np.asarray(res.x)


class Melange(_Base):
    """A Mélange-style cost-optimal mix, re-solved every epoch (module docstring): minimize
    ``sum_p price_p (horizon_s x_p + launch_s_p new_p)`` (``melange.horizon_s``) subject to ``sum_p cap[p,c] y[p,c] >=
    forecast_c`` per class and ``sum_c y[p,c] <= x_p`` per pool, ``new_p >= x_p - held_p``, x
    integer within the quotas and the cap; ``y`` are the shares of each pool's instances serving each
    class (Mélange's slices, made continuous). Over the on-demand pools (``melange.include_spot``
    adds the spot pools recorded available now)."""

    name = display_name = "melange"

    def plan(self, view: PlanView) -> np.ndarray:
        ctx, cfg = self.ctx, self.cfg
        pl = ctx.pools
        prof = class_profile(ctx, view)
        cap, _ = capacity_table(ctx, prof, cfg.headroom)
        f = forecast(ctx, view, cfg)
        price = view.price_h
        use = (cap.sum(axis=1) > 0) & np.isfinite(price)
        use &= ~pl.is_spot | (cfg.melange.include_spot & view.available & (view.noticed_last == 0))
        pools = np.flatnonzero(use)
        held = view.held[pools].astype(float)
        ub = np.minimum(held + np.maximum(view.quota_room[pools], 0), ctx.max_instances).astype(float)
        x = solve_mix(cap[pools][None], f[None], price[pools][None], pl.launch_s[pools], held, ub, cfg.melange.horizon_s,
                      cfg.melange.switch_cost, None, cfg.melange.time_limit_s, 1e-4)
        out = self._targets()
        out[pools] = np.round(x[0]).astype(np.int64)
        return out


def solve_mix(cap: np.ndarray, rate: np.ndarray, price: np.ndarray, launch_s: np.ndarray, held0: np.ndarray,
              ub: np.ndarray, epoch_s: float, switch_cost: bool, alive: np.ndarray | None, time_limit: float,
              gap: float, launchable: np.ndarray | None = None, lead: np.ndarray | None = None,
              warm: bool = False) -> np.ndarray:
    """The capacity ILP over E epochs (E = 1: Mélange's per-epoch mix; E > 1: the oracle's window).
    Shapes: ``cap`` (E, P, C) requests/s per instance, ``rate`` (E, C), ``price`` (E, P) USD per
    instance-hour, ``launch_s`` (P,), ``held0`` (P,) instances held before the first epoch, ``ub``
    (P,). Variables per epoch and pool: ``x`` (integer, instances serving), ``n`` (launched to serve
    from that epoch, billed ``launch_s`` more), ``y`` per class. With ``alive`` (E, P) 0/1 an
    instance can serve only where 1; with ``launchable`` (E, P) and ``lead`` (P,) epochs of launch
    delay, ``n[e]`` needs a launch at ``e - lead`` that finds capacity and instances alive through
    the boot (and none before the window's start beyond ``held0``). ``warm``: the first epoch's
    instances were launched before the window (their launch is not charged). Returns x (E, P)."""
    E, P, C = cap.shape
    nx = E * P
    ix = lambda e, p: e * P + p  # noqa: E731
    inn = lambda e, p: nx + e * P + p  # noqa: E731
    iy = lambda e, p, c: 2 * nx + (e * P + p) * C + c  # noqa: E731
    nv = 2 * nx + nx * C
    cost = np.zeros(nv)
    pr = np.nan_to_num(price, nan=0.0) / 3600.0
    for e in range(E):
        cost[e * P:(e + 1) * P] = pr[e] * epoch_s
        if switch_cost and not (warm and e == 0):
            cost[nx + e * P:nx + (e + 1) * P] = pr[e] * launch_s
    rows, cols, vals = [], [], []
    lo, hi = [], []
    r = 0
    for e in range(E):
        for c in range(C):  # demand
            ps = np.flatnonzero(cap[e, :, c] > 0)
            if rate[e, c] <= 0:
                continue
            if ps.size == 0:
                raise ConfigError("capacity ILP: a request class no pool can serve at its SLO")
            rows += [r] * ps.size
            cols += [iy(e, p, c) for p in ps.tolist()]
            vals += cap[e, ps, c].tolist()
            lo.append(rate[e, c])
            hi.append(np.inf)
            r += 1
        for p in range(P):  # sum_c y <= x
            rows += [r] * (C + 1)
            cols += [iy(e, p, c) for c in range(C)] + [ix(e, p)]
            vals += [1.0] * C + [-1.0]
            lo.append(-np.inf)
            hi.append(0.0)
            r += 1
            # n[e] >= x[e] - x[e-1]  (x[-1] = held0)
            rows += [r, r] + ([r] if e > 0 else [])
            cols += [inn(e, p), ix(e, p)] + ([ix(e - 1, p)] if e > 0 else [])
            vals += [1.0, -1.0] + ([1.0] if e > 0 else [])
            lo.append(-held0[p] if e == 0 else 0.0)
            hi.append(np.inf)
            r += 1
    A = coo_array((vals, (rows, cols)), shape=(r, nv)).tocsr()
    lb = np.zeros(nv)
    ubv = np.full(nv, np.inf)
    for e in range(E):
        ubx = ub.copy()
        if alive is not None:
            ubx = np.where(alive[e] > 0, ubx, 0.0)
        ubv[e * P:(e + 1) * P] = ubx
        ubn = ubx.copy()
        if launchable is not None and lead is not None:
            for p in range(P):
                s = e - int(lead[p])
                if e == 0:
                    continue  # the window's first epoch: held0 and warm-started instances
                if s < 0 or not launchable[s, p] or (alive is not None and not np.all(alive[s:e, p] > 0)):
                    ubn[p] = 0.0
        ubv[nx + e * P:nx + (e + 1) * P] = ubn
    integrality = np.zeros(nv)
    integrality[:nx] = 1
    x = _solve_milp(cost, A, np.array(lo), np.array(hi), integrality, lb, ubv, time_limit, gap)
    return np.round(x[:nx].reshape(E, P))


class HindsightOracle(_Base):
    """HINDSIGHT -- it sees the future: the capacity ILP (:func:`solve_mix`) over the whole window at
    once, with every epoch's true peak load (``forecast.peak_s`` windows, no margin), the classes'
    true mean sizes, the pools' true availability (no instance where a notice or preemption falls in
    the epoch; launches only where capacity is found and survives the boot) and the launch delays
    (an instance serving from epoch ``e`` is launched ``ceil(launch_s / epoch_s)`` epochs before and
    billed for its boot). Its plan is then played in the same world as every planner's."""

    name = "oracle"
    display_name = "oracle (hindsight)"

    def __init__(self, cfg: PlannersConfig | None = None, hindsight: Any = None):
        super().__init__(cfg)
        self._hs = hindsight

    def bind(self, world: Any) -> None:
        """Give it the world whose future it reads (``ProvisionWorld.hindsight``)."""
        self._hs = world.hindsight

    def reset(self, ctx: PlanContext) -> None:
        super().reset(ctx)
        if self._hs is None:
            raise ConfigError("oracle: bind it to the world first (HindsightOracle.bind)")
        hs: Hindsight = self._hs(self.cfg.forecast.peak_s)
        pl, E = ctx.pools, ctx.n_epochs
        prof = class_profile(ctx)
        with np.errstate(invalid="ignore"):
            tot = np.nansum(hs.count, axis=0)
            mi = np.nansum(np.nan_to_num(hs.mean_in) * hs.count, axis=0) / np.maximum(tot, 1.0)
            mo = np.nansum(np.nan_to_num(hs.mean_out) * hs.count, axis=0) / np.maximum(tot, 1.0)
        prof = ClassProfile(np.where(tot > 0, mi, prof.mean_in), np.where(tot > 0, mo, prof.mean_out),
                            prof.origin_share)
        cap, _ = capacity_table(ctx, prof, self.cfg.headroom)
        use = (cap.sum(axis=1) > 0) & np.all(np.isfinite(hs.price_h), axis=0) & hs.launchable.any(axis=0)
        pools = np.flatnonzero(use)
        lead = np.ceil(pl.launch_s[pools] / ctx.epoch_s).astype(np.int64)
        x = solve_mix(np.repeat(cap[pools][None], E, axis=0), hs.peak_rate, hs.price_h[:, pools],
                      pl.launch_s[pools], np.zeros(pools.size), np.full(pools.size, float(ctx.max_instances)),
                      ctx.epoch_s, True, hs.alive[:, pools].astype(float), self.cfg.oracle.time_limit_s,
                      self.cfg.oracle.mip_rel_gap, launchable=hs.launchable[:, pools], lead=lead, warm=True)
        # targets: what serves in epoch e plus what must already be launching for the epochs ahead
        tg = x.copy()
        for j in range(pools.size):
            L = int(lead[j])
            for e in range(1, E):
                add = max(x[e, j] - x[e - 1, j], 0.0)
                if add > 0:
                    for s in range(max(e - L, 0), e):
                        tg[s, j] += add
        self._plan = np.zeros((E, pl.n), dtype=np.int64)
        self._plan[:, pools] = np.minimum(tg, ctx.max_instances).astype(np.int64)
        #: the instances it plans to have serving in each epoch, per pool (E, P): what the learned planner imitates
        self.planned_x = np.zeros((E, pl.n))
        self.planned_x[:, pools] = x

    def plan(self, view: PlanView) -> np.ndarray:
        return self._plan[min(view.epoch, self._plan.shape[0] - 1)].copy()


#: the planners ``xroute evaluate --capacity`` knows by name
PLANNERS = ("static-ondemand", "autoscaler", "spothedge", "melange", "oracle")


def make_planner(name: str, cfg: PlannersConfig | None = None) -> Any:
    """A planner by name (:data:`PLANNERS`)."""
    cls = {"static-ondemand": StaticOnDemand, "autoscaler": ReactiveAutoscaler, "spothedge": SpotHedge,
           "melange": Melange, "oracle": HindsightOracle}.get(name)
    if cls is None:
        raise ConfigError(f"--policy: unknown planner '{name}' (planners: {', '.join(PLANNERS)})")
    return cls(cfg)
