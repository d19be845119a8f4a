"""Which state backend: :func:`open_state` opens the one the settings name (embedded, Redis/Valkey,
either failing open), so the backends never pick each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from router.core.settings import STATS_ALPHA
from router.state.embedded import EmbeddedState
from router.state.failopen import FailOpenState
from router.state.ledger import RECORD_S

if TYPE_CHECKING:
    from router.state.redis import RedisState


@dataclass
class StateSettings:
    """What :func:`open_state` needs (``router.core.settings.RouterSettings`` has these fields)."""

    backend: Literal["embedded", "redis"] = "embedded"
    url: str | None = None
    fail_open: bool = False
    timeout_s: float = 0.5
    prefix: str = "xroute"
    alpha: float = STATS_ALPHA
    #: how long after its hold a tenant quota reservation's record waits for its feedback
    record_ttl_s: float = RECORD_S
    restore_window_s: float = 1.0


def open_state(cfg: StateSettings, on_failover: Callable[[str], None] | None = None
               ) -> EmbeddedState | RedisState | FailOpenState:
    """The backend ``cfg`` names (a Redis one wrapped in :class:`FailOpenState` with ``fail_open``)."""
    if cfg.backend == "embedded":
        return EmbeddedState(cfg.alpha, record_ttl_s=cfg.record_ttl_s)
    from router.state.redis import RedisState

    if not cfg.url:
        raise ValueError("the redis state backend needs a URL (state_url)")
    shared = RedisState(cfg.url, prefix=cfg.prefix, timeout_s=cfg.timeout_s, alpha=cfg.alpha,
                        record_ttl_s=cfg.record_ttl_s, restore_window_s=cfg.restore_window_s)
    return (FailOpenState(shared, EmbeddedState(cfg.alpha, record_ttl_s=cfg.record_ttl_s), on_failover=on_failover)
            if cfg.fail_open else shared)
