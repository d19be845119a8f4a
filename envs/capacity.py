"""Cloud capacity quotas: which offerings can take one more instance, from the bundle's ``quotas``
table (``xroute.schema.telemetry.QUOTAS``; collected by the adapters, ``docs/telemetry.md``).

Each quota -- a (provider, region, quota name) step function of ``limit`` and ``usage`` in its
``unit`` -- counts the instances of the offerings its ``covers`` patterns match (offering ids,
``fnmatch`` wildcards). One instance of an offering takes its ``vcpus`` of a ``vcpus`` quota, its
``accelerator_count`` of a ``gpus`` quota, 1 of an ``instances`` quota. At time ``t`` (the quota's
last row at or before ``t``; before its first row it is not known and masks nothing) an offering is
**blocked** when some quota covering it has less room (``limit - usage``; usage not reported: 0)
than one instance takes: the deployment could not start the instance a request sent there may
need, so the environment and the router mask it (reason ``quota``). A quota without ``covers``
(an adapter that cannot tell which offerings it counts) masks nothing.
"""

from __future__ import annotations

import fnmatch

import numpy as np

from xroute.bundle import Bundle, to_seconds
from xroute.schema.offering import Offering


class CapacityQuotas:
    """The quotas of one bundle over time (module docstring)."""

    def __init__(self, bundle: Bundle, catalog: list[Offering]):
        self.n = len(catalog)
        #: per quota: its row times, room (limit - usage), the offerings it covers, what one instance of each takes
        self.quotas: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        q = bundle.quotas
        if q is None or len(q) == 0 or "covers" not in q.columns:
            self.event_times = np.zeros(0)
            return
        ids = [o.offering_id for o in catalog]
        times = []
        for _, rows in q.groupby(["provider", "region", "quota_name"], sort=True):
            patterns = sorted({p.strip() for c in rows["covers"].dropna() for p in str(c).split(";") if p.strip()})
            covered = np.array(sorted({i for p in patterns for i, oid in enumerate(ids) if fnmatch.fnmatchcase(oid, p)}),
                               dtype=np.int64)
            if covered.size == 0:
                continue
            unit = str(rows["unit"].iloc[-1]).strip().lower()
            if unit == "vcpus":
                take = np.array([catalog[i].vcpus for i in covered], dtype=float)
            elif unit == "gpus":
                take = np.array([float(catalog[i].accelerator_count) for i in covered])
            else:
                take = np.ones(covered.size)
            rows = rows.sort_values("ts", kind="stable")
            t = to_seconds(rows["ts"])
            usage = rows["usage"].to_numpy(dtype=float) if "usage" in rows.columns else np.zeros(len(rows))
            room = rows["limit"].to_numpy(dtype=float) - np.nan_to_num(usage, nan=0.0)
            self.quotas.append((t, room, covered, take))
            times.append(t)
        self.event_times = np.unique(np.concatenate(times)) if times else np.zeros(0)

    @property
    def active(self) -> bool:
        return bool(self.quotas)

    def blocked(self, t: float) -> np.ndarray:
        """Which offerings no quota leaves room for one more instance of at ``t``."""
        out = np.zeros(self.n, dtype=bool)
        for ts, room, covered, take in self.quotas:
            k = int(np.searchsorted(ts, t, side="right")) - 1
            if k >= 0:
                out[covered[room[k] < take]] = True
        return out


