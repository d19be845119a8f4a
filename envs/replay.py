"""Replay of a bundle's step-function telemetry (prices, availability, utilization) over time.

Everything is turned into float seconds since the epoch and per-offering sorted arrays once, so the
environment only does ``searchsorted`` on small arrays when its history features are refreshed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from xroute.bundle import Bundle, to_seconds

DAY = 86_400.0
WEEK = 7 * DAY


@dataclass
class Series:
    """Per-offering step functions, concatenated: rows ``off[i]:off[i+1]`` belong to offering i."""

    t: np.ndarray
    v: np.ndarray
    off: np.ndarray

    @classmethod
    def from_table(cls, df: pd.DataFrame | None, ids: list[str], column: str) -> Series:
        n = len(ids)
        if df is None or len(df) == 0:
            return cls(np.zeros(0), np.zeros(0), np.zeros(n + 1, dtype=np.int64))
        idx = pd.Index(ids).get_indexer(df["offering_id"])
        t = to_seconds(df["ts"])
        v = df[column].to_numpy(dtype=float)
        keep = ~np.isnan(v)
        idx, t, v = idx[keep], t[keep], v[keep]
        order = np.lexsort((t, idx))
        idx, t, v = idx[order], t[order], v[order]
        counts = np.bincount(idx, minlength=n)
        off = np.concatenate([[0], np.cumsum(counts)])
        return cls(t, v, off)

    def values_at(self, t: float, default: float) -> np.ndarray:
        """Every offering's value at time t: its last row at or before t, else its first row;
        ``default`` for offerings without rows. One ``searchsorted`` over all offerings' rows."""
        n = len(self.off) - 1
        if self.t.size == 0:
            return np.full(n, default)
        if not hasattr(self, "_key"):
            self._t0 = float(self.t.min())
            self._span = float(self.t.max() - self._t0) + 4 * WEEK + 1.0
            owner = np.repeat(np.arange(n), np.diff(self.off))
            self._key = owner * self._span + (self.t - self._t0)
        lo, hi = self.off[:-1], self.off[1:]
        q = np.arange(n) * self._span + np.clip(t - self._t0, -1.0, self._span - 1.0)
        k = np.searchsorted(self._key, q, side="right") - 1
        k = np.clip(k, lo, np.maximum(hi - 1, lo))
        out = np.full(n, default, dtype=float)
        has = hi > lo
        out[has] = self.v[k[has]]
        return out

    def changes_between(self, i: int, t0: float, t1: float) -> int:
        a, b = self.off[i], self.off[i + 1]
        if b - a < 2:
            return 0
        ts = self.t[a + 1:b]  # the first row is a start, not a change
        return int(np.searchsorted(ts, t1, side="right") - np.searchsorted(ts, t0, side="right"))

    def last_times(self, t: float) -> np.ndarray:
        """Each offering's last row time at or before ``t`` (-inf where none)."""
        n = len(self.off) - 1
        out = np.full(n, -np.inf)
        for i in range(n):
            a, b = self.off[i], self.off[i + 1]
            if b > a:
                k = int(np.searchsorted(self.t[a:b], t, side="right"))
                if k > 0:
                    out[i] = self.t[a + k - 1]
        return out

    def first_times(self) -> np.ndarray:
        """Each offering's first row time (+inf for offerings without rows)."""
        if not hasattr(self, "_first"):
            lo, hi = self.off[:-1], self.off[1:]
            self._first = np.where(hi > lo, self.t[np.minimum(lo, max(self.t.size - 1, 0))] if self.t.size else np.inf,
                                   np.inf)
        return self._first

    def all_times(self) -> np.ndarray:
        return np.unique(self.t)


class TelemetryReplay:
    """Prices, availability and external utilization of each offering at any time.

    ``down_times[i]`` lists the instants where offering i flips from available to not available
    (preemptions); the environment uses the past ones for features and — for outcomes only — the
    next one after a request starts, since a preemption in the replayed telemetry really happens.
    """

    def __init__(self, bundle: Bundle, replicas_per_instance: np.ndarray):
        ids = bundle.offering_ids
        self.n = len(ids)
        self.prices = Series.from_table(bundle.prices, ids, "usd_per_hour")
        self.avail = Series.from_table(bundle.availability, ids, "available")
        self.util = Series.from_table(bundle.utilization, ids, "gpu_util")
        self.replicas_per_instance = replicas_per_instance.astype(float)
        self.down_times: list[np.ndarray] = []
        self.up_times: list[np.ndarray] = []
        for i in range(self.n):
            a, b = self.avail.off[i], self.avail.off[i + 1]
            v, t = self.avail.v[a:b], self.avail.t[a:b]
            prev = np.concatenate([[1.0], v[:-1]])
            self.down_times.append(t[(prev > 0.5) & (v < 0.5)])
            self.up_times.append(t[(prev < 0.5) & (v > 0.5)])
        self.event_times = np.unique(np.concatenate(
            [self.prices.all_times(), self.avail.all_times(), self.util.all_times()]))

    def next_event_after(self, t: float) -> float:
        k = int(np.searchsorted(self.event_times, t, side="right"))
        return float(self.event_times[k]) if k < len(self.event_times) else np.inf

    def snapshot(self, t: float, lookback_s: float) -> dict[str, np.ndarray]:
        """State of every offering at time t, using only telemetry at or before t."""
        n = self.n
        price = self.prices.values_at(t, default=np.nan) / self.replicas_per_instance
        price_24h = self.prices.values_at(t - DAY, default=np.nan) / self.replicas_per_instance
        vol = np.array([self.prices.changes_between(i, t - WEEK, t) for i in range(n)], dtype=float)
        available = self.avail.values_at(t, default=1.0)
        util = self.util.values_at(t, default=0.0)
        count = np.zeros(n)
        recency = np.zeros(n)
        # how long each offering's availability has been watched within the lookback (0: never)
        first = self.avail.first_times()
        observed = np.clip(t - first, 0.0, lookback_s)
        for i, d in enumerate(self.down_times):
            if d.size == 0:
                continue
            k = int(np.searchsorted(d, t, side="right"))
            count[i] = k - int(np.searchsorted(d, t - lookback_s, side="right"))
            if k > 0:
                recency[i] = np.exp(-(t - d[k - 1]) / lookback_s)
        return {"price": price, "price_24h": price_24h, "volatility": vol, "available": available,
                "util": util, "preempt_count": count, "preempt_recency": recency, "observed_s": observed}

    def next_down(self, t: float) -> np.ndarray:
        """For each offering, the first preemption strictly after t (inf if none)."""
        out = np.full(self.n, np.inf)
        for i, d in enumerate(self.down_times):
            if d.size:
                k = int(np.searchsorted(d, t, side="right"))
                if k < d.size:
                    out[i] = d[k]
        return out


class PoolInventory:
    """The bundle's ``inventory`` table (``xroute.schema.telemetry.INVENTORY``): the instances
    running in each pool -- one (model, offering) pair -- over time, as the clouds report them.

    Each row holds until the next of the same pool. A pool with rows has, from its first row on,
    the replicas its running instances hold (``running`` x the offering's accelerators, over the
    accelerators one replica of the model spans: ``envs.serving.place``); before its first row, and
    a pool without rows, keeps the catalog's capacity (``capacity_replicas``). Rows of a model the
    environment does not serve are ignored. The routing environment, the router and the baselines
    read it through ``CloudRouteEnv`` (its pools' slots follow it); ``xroute plan`` reads
    ``running`` as the plan's ``current``. ``active`` is False without the table.
    """

    def __init__(self, bundle: Bundle, model_names: tuple[str, ...] | list[str], default_model: str):
        ids = bundle.offering_ids
        self.M, self.n = len(model_names), len(ids)
        #: per pool (m * n + i): row times, running and launching instances (empty: no rows)
        self._t: dict[int, np.ndarray] = {}
        self._run: dict[int, np.ndarray] = {}
        self._launch: dict[int, np.ndarray] = {}
        inv = bundle.inventory
        self.event_times = np.zeros(0)
        if inv is None or len(inv) == 0:
            return
        mi = {m: k for k, m in enumerate(model_names)}
        models = (inv["model"].fillna("").astype(str).str.strip() if "model" in inv.columns
                  else pd.Series([""] * len(inv), index=inv.index)).replace("", default_model)
        m_idx = models.map(mi)
        o_idx = pd.Index(ids).get_indexer(inv["offering_id"])
        keep = m_idx.notna().to_numpy() & (o_idx >= 0)
        if not keep.any():
            return
        t = to_seconds(inv["ts"])[keep]
        key = (m_idx.to_numpy()[keep].astype(np.int64) * self.n + o_idx[keep])
        run = inv["running"].to_numpy(dtype=float)[keep]
        launch = (inv["launching"].to_numpy(dtype=float)[keep] if "launching" in inv.columns
                  else np.zeros(int(keep.sum())))
        order = np.lexsort((t, key))
        t, key, run, launch = t[order], key[order], run[order], np.nan_to_num(launch[order], nan=0.0)
        for k in np.unique(key).tolist():
            sel = key == k
            self._t[k], self._run[k], self._launch[k] = t[sel], run[sel], launch[sel]
        self.event_times = np.unique(t)

    @property
    def active(self) -> bool:
        return bool(self._t)

    def has_rows(self) -> np.ndarray:
        """(M, n): the pools the table has rows for."""
        out = np.zeros((self.M, self.n), dtype=bool)
        for k in self._t:
            out[k // self.n, k % self.n] = True
        return out

    def _at(self, series: dict[int, np.ndarray], t: float) -> np.ndarray:
        out = np.full((self.M, self.n), np.nan)
        for k, ts in self._t.items():
            j = int(np.searchsorted(ts, t, side="right")) - 1
            if j >= 0:
                out[k // self.n, k % self.n] = series[k][j]
        return out

    def running_at(self, t: float) -> np.ndarray:
        """(M, n): the instances running in each pool at ``t`` (its last row at or before ``t``);
        NaN where not known (no rows, or before the pool's first row)."""
        return self._at(self._run, t)

    def launching_at(self, t: float) -> np.ndarray:
        """(M, n): the instances launching (requested, not serving yet) at ``t``; NaN where not known."""
        return self._at(self._launch, t)

    def max_running(self) -> np.ndarray:
        """(M, n): the most instances each pool's rows ever report running (0 where no rows)."""
        out = np.zeros((self.M, self.n))
        for k, r in self._run.items():
            out[k // self.n, k % self.n] = float(r.max()) if r.size else 0.0
        return out

    def next_event_after(self, t: float) -> float:
        k = int(np.searchsorted(self.event_times, t, side="right"))
        return float(self.event_times[k]) if k < self.event_times.size else np.inf
