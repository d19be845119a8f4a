"""Where the router's live features come from: a telemetry source, a clock, and their freshness.

The router computes features exactly as the environment does (``CloudRouteEnv.observe_live``), so
what it needs from telemetry is a :class:`~xroute.bundle.Bundle` (catalog, prices, availability,
utilization, RTT) and a mapping from wall-clock time onto telemetry time.

* :class:`ReplaySource` serves a recorded bundle (the default). Its clock *replays*: telemetry time
  = window start + ((wall - start of serving) x ``speed`` + offset) modulo the window, where the
  window is the bundle's workload span. When the clock wraps to the window's start, the router's
  pool-load view is reset (the recorded prices and preemptions start over). Every response says
  which telemetry time it used.
* :class:`LiveSource` serves a directory that ``xroute telemetry collect`` keeps current (the cloud
  adapters behind one interface; ``--every`` for a schedule): telemetry time is the wall clock, and
  each poll that finds a new commit of the collector hands the new tables to the engine, which swaps
  them in between two decisions. The directory needs no ``workload`` table: the router routes live
  requests, so the environment is given one placeholder request per origin.

Freshness: :meth:`TelemetrySource.poll` is called every ``telemetry_refresh_s``; the *age* reported
with each decision is the wall-clock time since the data's :meth:`~TelemetrySource.as_of` at the
last successful poll: the poll itself for the replay (a poll checks that the bundle's files are
still readable; the recording never changes), the collector's last commit for the live source.
"""

from __future__ import annotations

import abc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from router.core.logs import iso
from xroute.bundle import DEFAULT_BUNDLE, Bundle, load_bundle, origins_reaching, read_table, rtt_lookup, to_seconds
from xroute.errors import ConfigError
from xroute.schema.telemetry import TABLES, WORKLOAD


class TelemetrySource(abc.ABC):
    """Telemetry for the router: a bundle, a clock onto its time, and a freshness check."""

    name: str

    @abc.abstractmethod
    def bundle(self) -> Bundle:
        """The telemetry the router's environment reads."""

    @abc.abstractmethod
    def telemetry_time(self, wall: float) -> tuple[float, int]:
        """Telemetry time (epoch seconds) for wall-clock ``wall``, and a generation number that
        changes when time jumps backwards (a replay wrap), so the load view can be reset."""

    @abc.abstractmethod
    def poll(self) -> Bundle | None:
        """Refresh from the source: a new bundle when the telemetry changed, else ``None``; raise
        if it cannot be reached (the cache then grows stale). Runs on a worker thread."""

    def accept(self) -> None:  # noqa: B027 -- optional hook: only sources that return bundles need it
        """The bundle the last poll returned is in use now (until then, polls keep offering it)."""

    def as_of(self) -> float:
        """Wall-clock time the data in use describes (default: now)."""
        return time.time()

    @abc.abstractmethod
    def describe_clock(self) -> str: ...


class ReplaySource(TelemetrySource):
    """A recorded bundle replayed in a loop (see the module docstring)."""

    def __init__(self, path: Path | str | None = None, speed: float = 1.0, offset_s: float = 0.0,
                 start_wall: float | None = None):
        self.path = Path(path) if path is not None else DEFAULT_BUNDLE
        self._bundle = load_bundle(self.path)
        t = to_seconds(self._bundle.workload["ts"])
        self.start, self.end = float(t[0]), float(t[-1])
        self.span = max(self.end - self.start, 1.0)
        self.speed = speed
        self.offset_s = offset_s % self.span
        self.start_wall = time.time() if start_wall is None else start_wall
        self.name = f"replay:{self.path.name}"

    def bundle(self) -> Bundle:
        return self._bundle

    def telemetry_time(self, wall: float) -> tuple[float, int]:
        pos = max(wall - self.start_wall, 0.0) * self.speed + self.offset_s
        gen, within = divmod(pos, self.span)
        return self.start + within, int(gen)

    def poll(self) -> None:
        for name in ("offerings", "prices", "rtt"):
            if not any((self.path / f"{name}{s}").is_file() for s in (".csv", ".csv.gz", ".parquet")):
                raise FileNotFoundError(f"{self.path}: table '{name}' is gone")
        return None

    def describe_clock(self) -> str:
        return (f"replay x{self.speed:g} of {iso(self.start)}..{iso(self.end)} "
                f"(wraps every {self.span / self.speed:.0f} s; load view reset on wrap)")


class LiveSource(TelemetrySource):
    """A bundle directory kept current by ``xroute telemetry collect`` (see the module docstring).

    A poll compares the directory's table files and manifest (name, size, mtime) with the last
    load; when they changed it loads and validates the new tables (a commit of the collector is
    atomic, so a poll never sees half of one) and returns them. ``as_of`` is the manifest's
    ``updated`` time (the collector's last commit), else the newest table file's mtime.
    """

    MANIFEST = "collect_log.json"

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.name = f"live:{self.path.name}"
        self._signature = self._files()
        self._bundle = self._load(self._signature)
        self._as_of = self._read_as_of()
        self._pending: tuple[tuple[tuple[str, int, int], ...], Bundle, float] | None = None

    def _files(self) -> tuple[tuple[str, int, int], ...]:
        if not self.path.is_dir():
            raise ConfigError(f"--telemetry: '{self.path}' is not a directory (the --out of xroute telemetry collect)")
        out = []
        for f in sorted(self.path.iterdir()):
            if f.is_file() and (f.name == self.MANIFEST or f.name.split(".")[0] in TABLES):
                st = f.stat()
                out.append((f.name, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def _load(self, signature: tuple[tuple[str, int, int], ...]) -> Bundle:
        has_workload = any(name.split(".")[0] == WORKLOAD.name for name, _, _ in signature)
        return load_bundle(self.path, workload=None if has_workload else self._placeholder_workload())

    def _placeholder_workload(self) -> pd.DataFrame:
        """One zero-token request per origin (an RTT source that reaches every offering's
        location), at the newest telemetry time: the environment needs a stream to start from,
        the live router never replays it."""
        offerings, rtt = read_table(self.path, "offerings"), read_table(self.path, "rtt")
        if offerings is None or rtt is None:
            raise ConfigError(f"--telemetry: '{self.path}' has no 'offerings' and 'rtt' tables "
                              "(run xroute telemetry collect --out on it first)")
        lookup = rtt_lookup(rtt)
        origins = origins_reaching(lookup, offerings["provider"] + ":" + offerings["region"], rtt["src"])
        if not origins:
            raise ConfigError(f"--telemetry: '{self.path}': no RTT source reaches every offering's location "
                              "(the collector's --origin and RTT probes provide them)")
        prices = read_table(self.path, "prices")
        ts = prices["ts"].max() if prices is not None and len(prices) else pd.Timestamp.now(tz="UTC")
        return pd.DataFrame({"ts": [ts.isoformat()] * len(origins), "request_id": [f"live:{o}" for o in origins],
                             "origin": origins, "input_tokens": "0", "max_output_tokens": "1", "ttft_ms": "1000",
                             "tpot_ms": "100", "output_tokens": "0"},
                            dtype=str)

    def _read_as_of(self) -> float:
        manifest = self.path / self.MANIFEST
        if manifest.is_file():
            try:
                return float(pd.Timestamp(json.loads(manifest.read_text())["updated"]).timestamp())
            except (ValueError, KeyError, TypeError):
                pass  # an unreadable manifest: fall back to the files' age
        return max((m / 1e9 for _, _, m in self._signature), default=time.time())

    def bundle(self) -> Bundle:
        return self._bundle

    def telemetry_time(self, wall: float) -> tuple[float, int]:
        return wall, 0

    def poll(self) -> Bundle | None:
        sig = self._files()
        if sig == self._signature:
            return None
        bundle = self._load(sig)  # raises on a bad commit: the previous tables stay in use
        self._pending = (sig, bundle, self._read_as_of())
        return bundle

    def accept(self) -> None:
        if self._pending is not None:
            self._signature, self._bundle, self._as_of = self._pending
            self._pending = None

    def as_of(self) -> float:
        return self._as_of

    def describe_clock(self) -> str:
        return f"live (wall clock; tables of {self.path} reloaded when the collector commits)"


@dataclass
class Freshness:
    """When the source last answered, and the last error (for /readyz and the logs)."""

    last_ok_wall: float
    last_error: str | None = None

    def age(self, wall: float) -> float:
        return max(0.0, wall - self.last_ok_wall)
