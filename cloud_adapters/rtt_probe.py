"""Round-trip time from here to any location id, by TCP connect time.

A probe resolves the target once (DNS time is not counted), then opens ``count`` TCP connections
one after another, each with ``timeout_s``, and reports the median connect time in milliseconds.
A TCP handshake is one round trip, needs no credentials, and every cloud region's public API
endpoint answers it. Targets are probed concurrently; one slow or dead target does not hold up
the others beyond its own timeouts.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of probing one target. ``rtt_ms`` is None when no connection succeeded."""

    location: str
    host: str
    port: int
    rtt_ms: float | None
    samples_ms: tuple[float, ...]
    failures: int
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.rtt_ms is not None


def probe(host: str, port: int, *, count: int = 5, timeout_s: float = 2.0, location: str = "") -> ProbeResult:
    """Median TCP connect time to ``host:port`` over ``count`` attempts (failures are left out)."""
    if count < 1:
        raise ValueError("count must be at least 1")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return ProbeResult(location, host, port, None, (), count, f"cannot resolve {host}: {e.strerror or e}")
    family, stype, proto, _, addr = infos[0]
    samples: list[float] = []
    errors: list[str] = []
    for _ in range(count):
        s = socket.socket(family, stype, proto)
        s.settimeout(timeout_s)
        t0 = time.perf_counter()
        try:
            s.connect(addr)
            samples.append((time.perf_counter() - t0) * 1000.0)
        except TimeoutError:
            errors.append(f"timed out after {timeout_s:g} s")
        except OSError as e:
            errors.append(e.strerror or type(e).__name__)
        finally:
            s.close()
    rtt = statistics.median(samples) if samples else None
    return ProbeResult(location, host, port, rtt, tuple(samples), len(errors), "; ".join(sorted(set(errors))))


def probe_all(targets: Mapping[str, tuple[str, int]], *, count: int = 5, timeout_s: float = 2.0,
              concurrency: int = 16) -> dict[str, ProbeResult]:
    """Probe each ``location -> (host, port)`` concurrently; results by location."""
    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(targets))), thread_name_prefix="rtt") as pool:
        futs = {loc: pool.submit(probe, h, p, count=count, timeout_s=timeout_s, location=loc)
                for loc, (h, p) in targets.items()}
        return {loc: f.result() for loc, f in futs.items()}


def parse_target(text: str, default_port: int = 443) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest.lstrip(":") or default_port)
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port)
    return text, default_port
