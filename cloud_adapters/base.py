"""The cloud adapter interface: one abstract class, the records it returns, retries and caching.

A provider module (``aws``, ``azure``, ``gcp``, ``replay``) subclasses :class:`CloudAdapter` and fills
in the ``_fetch_*`` hooks. The public methods here add what every provider shares, and their
docstrings are the contract: what each returns, what it caches and for how long, and whether it
fails *open* (returns no data, which downstream reads as "no constraint") or *closed* (raises a
:class:`~cloud_adapters.errors.CloudError`; the collector then keeps the last good snapshot and
marks the source stale — it never invents a value).

What a provider cannot give is data, not an ``if provider == ...``: :meth:`CloudAdapter.capabilities`
maps each :class:`Feature` to ``None`` (supported) or the reason it is not.
"""

from __future__ import annotations

import abc
import importlib
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum
from types import ModuleType
from typing import Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from cloud_adapters.errors import (
    CloudAuthError,
    CloudError,
    CloudNotSupportedError,
    CloudResponseError,
    CloudThrottledError,
    CloudUnavailableError,
    SdkMissingError,
)
from xroute.errors import ConfigError, XrouteError

T = TypeVar("T")


class Feature(StrEnum):
    """What an adapter can be asked for."""

    OFFERINGS = "offerings"
    ON_DEMAND_PRICES = "on_demand_prices"
    SPOT_PRICES = "spot_prices"
    SPOT_PRICE_HISTORY = "spot_price_history"
    SPOT_AVAILABILITY = "spot_availability"
    QUOTAS = "quotas"
    QUOTA_USAGE = "quota_usage"
    UTILIZATION = "utilization"
    #: the instances running per pool, from the group each pool maps to (``groups`` in the config)
    INVENTORY = "inventory"
    #: setting a group's desired capacity (``xroute capacity apply --apply``)
    ACTUATION = "actuation"


def offering_id(provider: str, region: str, instance_type: str, pricing_mode: str) -> str:
    """The bundle's offering id: ``provider:region:instance_type:pricing_mode``."""
    return f"{provider}:{region}:{instance_type}:{pricing_mode}"


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class InstanceOffer:
    """One instance type offered in one region (the pricing mode is added by the price rows)."""

    provider: str
    region: str
    instance_type: str
    accelerator: str
    accelerator_count: int
    vcpus: float
    memory_gib: float
    zones: tuple[str, ...] = ()

    def offering_id(self, pricing_mode: str) -> str:
        return offering_id(self.provider, self.region, self.instance_type, pricing_mode)


@dataclass(frozen=True)
class PricePoint:
    """A price in USD per hour, in force from ``ts`` (until the next point of the same offering).

    ``snapshot`` is True for a current list price (on-demand, current spot) and False for a
    point of a price history, whose ``ts`` is when the provider changed the price.
    """

    ts: datetime
    provider: str
    region: str
    instance_type: str
    pricing_mode: Literal["on_demand", "spot"]
    usd_per_hour: float
    snapshot: bool = True

    @property
    def offering_id(self) -> str:
        return offering_id(self.provider, self.region, self.instance_type, self.pricing_mode)


@dataclass(frozen=True)
class AvailabilitySignal:
    """Whether the spot offering of an instance type is obtainable now; ``detail`` says from what."""

    ts: datetime
    provider: str
    region: str
    instance_type: str
    available: bool
    detail: str = ""

    @property
    def offering_id(self) -> str:
        return offering_id(self.provider, self.region, self.instance_type, "spot")


@dataclass(frozen=True)
class QuotaRecord:
    """One capacity quota: ``limit`` and (where the provider tells) current ``usage`` in ``unit``."""

    ts: datetime
    provider: str
    region: str
    quota_name: str
    unit: Literal["vcpus", "gpus", "instances"]
    limit: float
    usage: float | None = None
    #: the offerings whose instances count against it: offering id patterns (``*``/``?`` wildcards;
    #: the bundle's ``quotas.covers``, ``envs.capacity``); empty when the adapter cannot tell
    covers: tuple[str, ...] = ()


@dataclass(frozen=True)
class UtilizationSample:
    """Mean load of a pool at ``ts``, as fractions 0-1 (``cpu_util`` may be unknown)."""

    ts: datetime
    offering_id: str
    gpu_util: float
    cpu_util: float | None = None


class PoolSelector(BaseModel):
    """A pool of the user's own instances, and how to find its metrics.

    ``tags`` select the instances (AWS tags, Azure tags, GCP labels); ``query``/``cpu_query`` are
    PromQL for a Prometheus source, where the text ``{selector}`` is replaced by ``selector``
    (so ``DCGM_FI_DEV_GPU_UTIL{{selector}}`` becomes ``DCGM_FI_DEV_GPU_UTIL{pool="a"}``).
    """

    model_config = ConfigDict(extra="forbid")

    offering_id: str
    source: str
    region: str | None = None
    tags: dict[str, str] = {}
    url: str | None = None
    selector: str = ""
    query: str = "avg(DCGM_FI_DEV_GPU_UTIL{{selector}}) / 100"
    cpu_query: str | None = None


class PoolGroup(BaseModel):
    """One pool (offering x model) and the cloud group that holds its instances.

    ``group`` names the group -- an AWS Auto Scaling group, an Azure VM scale set, a GCP managed
    instance group; ``tags`` (AWS only, instead of ``group``) find the pool's instances by tag, for
    the inventory alone (no group to resize). The provider and region come from ``offering_id``
    (``provider:region:instance_type:pricing_mode``); each provider's config checks the fields it
    needs (``resource_group`` on Azure, ``zone`` on GCP), an error naming the field.
    """

    model_config = ConfigDict(extra="forbid")

    offering_id: str
    #: the model the pool's instances serve (empty: the default model)
    model: str = ""
    group: str | None = None
    tags: dict[str, str] = {}
    #: Azure: the VM scale set's resource group
    resource_group: str | None = None
    #: GCP: the managed instance group's zone
    zone: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.offering_id, self.model)

    @property
    def region(self) -> str:
        parts = self.offering_id.split(":")
        return parts[1] if len(parts) == 4 else ""

    @property
    def label(self) -> str:
        return f"{self.offering_id}@{self.model}" if self.model else self.offering_id


def check_groups(provider: str, groups: list[PoolGroup], need: tuple[str, ...] = ()) -> list[PoolGroup]:
    """The ``groups`` of a provider's config, checked: offering ids of this provider
    (``provider:region:type:mode``), a ``group`` or ``tags``, the provider's own fields in ``need``,
    no pool twice. Raises ``ValueError`` (pydantic then names ``groups.<i>.<field>``)."""
    seen: dict[tuple[str, str], int] = {}
    for i, g in enumerate(groups):
        parts = g.offering_id.split(":")
        if len(parts) != 4 or parts[0] != provider or not all(parts):
            raise ValueError(f"groups[{i}].offering_id: '{g.offering_id}' is not a {provider} offering id "
                             f"({provider}:REGION:INSTANCE_TYPE:on_demand|spot)")
        if parts[3] not in ("on_demand", "spot"):
            raise ValueError(f"groups[{i}].offering_id: pricing mode '{parts[3]}' is not on_demand or spot")
        if not g.group and not g.tags:
            raise ValueError(f"groups[{i}].group: give the group's name (or, AWS only, tags)")
        for f in need:
            if not getattr(g, f):
                raise ValueError(f"groups[{i}].{f}: required for a {provider} group")
        if g.key in seen:
            raise ValueError(f"groups[{i}]: pool {g.label} is already groups[{seen[g.key]}]")
        seen[g.key] = i
    return groups


@dataclass(frozen=True)
class GroupState:
    """What a pool's group holds now: the desired capacity it is set to, the instances running
    (serving) and launching (asked for, not running yet), and the group's own bounds (None: none
    or not told)."""

    pool: PoolGroup
    desired: int
    running: int
    launching: int = 0
    min_size: int | None = None
    max_size: int | None = None


class AdapterConfig(BaseModel):
    """Settings every adapter shares. Provider modules subclass it.

    Endpoints default to the real services; ``XROUTE_<PROVIDER>_...`` environment variables
    override them (tests point them at local servers). ``credentials='anonymous'`` sends no
    credentials and is refused unless the endpoint is overridden.
    """

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = 20.0
    max_attempts: int = 4
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 20.0
    credentials: Literal["default", "anonymous"] = "default"
    #: keep only instance types with at least one accelerator
    gpu_only: bool = True
    #: if given, only these instance types
    instance_types: list[str] | None = None
    #: the pools whose groups this adapter reads (inventory) and resizes (actuation)
    groups: list[PoolGroup] = []


def env_override(*names: str) -> str | None:
    """The first non-empty environment variable of ``names``."""
    for n in names:
        v = os.environ.get(n, "").strip()
        if v:
            return v
    return None


def host_port(url: str, default_port: int = 443) -> tuple[str, int]:
    """Host and port of an endpoint URL (for the RTT prober)."""
    parts = urlsplit(url if "://" in url else f"https://{url}")
    port = parts.port or (80 if parts.scheme == "http" else default_port)
    return parts.hostname or "", port


def require_sdk(provider: str, module: str) -> ModuleType:
    """Import an SDK module lazily; a missing one becomes :class:`SdkMissingError` with the install hint."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SdkMissingError(provider, module) from e


class Deadline:
    """A point in monotonic time after which a collection run stops retrying."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float:
        return float("inf") if self.end is None else max(0.0, self.end - time.monotonic())

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0.0


class _TTLCache:
    def __init__(self) -> None:
        self._data: dict[tuple[Any, ...], tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], ttl: float) -> Any:
        with self._lock:
            hit = self._data.get(key)
        if hit is None or time.monotonic() - hit[0] > ttl:
            return None
        return hit[1]

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        with self._lock:
            self._data[key] = (time.monotonic(), value)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


@dataclass
class CallStats:
    """API calls made by an adapter (attempts, including retries), by operation."""

    calls: Counter[str] = field(default_factory=Counter)
    retries: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, op: str, retry: bool) -> None:
        with self._lock:
            self.calls[op] += 1
            if retry:
                self.retries[op] += 1

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class CloudAdapter(abc.ABC):
    """One cloud provider (or a recorded bundle) behind one interface.

    Adapters are thread-safe: the collector calls one adapter from several threads, one region per
    thread. Every network call goes through :meth:`call`, which counts it, retries transient
    failures (5xx, timeouts, throttling) with exponential backoff and jitter, honours a Retry-After,
    and never waits past the run's :class:`Deadline`.
    """

    #: registry name, e.g. ``"aws"``
    name: ClassVar[str] = ""
    #: region names this provider uses (to assign unqualified ``--regions``)
    REGION_PATTERN: ClassVar[re.Pattern[str]] = re.compile(r"^$")
    #: features this adapter cannot give, with the reason (overridden per provider)
    UNSUPPORTED: ClassVar[dict[Feature, str]] = {}
    #: cache lifetime per feature, seconds (0 = not cached)
    CACHE_TTL_S: ClassVar[dict[Feature, float]] = {
        Feature.OFFERINGS: 24 * 3600.0,
        Feature.ON_DEMAND_PRICES: 6 * 3600.0,
        Feature.SPOT_PRICES: 0.0,
        Feature.SPOT_AVAILABILITY: 600.0,
        Feature.QUOTAS: 300.0,
        Feature.UTILIZATION: 0.0,
        Feature.INVENTORY: 0.0,
    }
    config_class: ClassVar[type[AdapterConfig]] = AdapterConfig

    def __init__(self, config: AdapterConfig | dict[str, Any] | None = None, *, deadline: Deadline | None = None):
        if isinstance(config, dict) or config is None:
            config = self.config_class(**(config or {}))
        self.config = config
        self.deadline = deadline or Deadline(None)
        self.stats = CallStats()
        self._cache = _TTLCache()

    # -- capability map -------------------------------------------------------------------------

    def capabilities(self) -> dict[Feature, str | None]:
        """Each feature mapped to ``None`` when supported, else the reason it is not."""
        caps = {f: self.UNSUPPORTED.get(f) for f in Feature}
        cls = type(self)
        if cls._fetch_group is CloudAdapter._fetch_group and caps[Feature.INVENTORY] is None:
            caps[Feature.INVENTORY] = "no cloud groups to read instances from"
        if cls._set_group_capacity is CloudAdapter._set_group_capacity and caps[Feature.ACTUATION] is None:
            caps[Feature.ACTUATION] = "no cloud groups to resize"
        return caps

    def supports(self, feature: Feature) -> bool:
        return self.capabilities()[feature] is None

    def _require(self, feature: Feature, region: str | None = None) -> None:
        reason = self.capabilities()[feature]
        if reason is not None:
            raise CloudNotSupportedError(self.name, reason, region=region, operation=feature.value)

    def knows_region(self, region: str) -> bool:
        """Whether ``region`` is spelled like one of this provider's regions."""
        return bool(self.REGION_PATTERN.match(region))

    # -- the interface ----------------------------------------------------------------------------

    def offerings(self, region: str) -> list[InstanceOffer]:
        """Instance types offered in ``region`` with accelerators, vCPUs and memory.

        Filtered by ``config.gpu_only`` and ``config.instance_types``. Cached for
        ``CACHE_TTL_S[OFFERINGS]`` (24 h: catalogs change rarely). Fails closed.
        """
        self._require(Feature.OFFERINGS, region)
        found = self._guard(Feature.OFFERINGS, region, lambda: self._cached(
            Feature.OFFERINGS, (region,), lambda: self._fetch_offerings(region)))
        return [o for o in found if self._wanted(o)]

    def on_demand_prices(self, region: str, instance_types: Iterable[str]) -> list[PricePoint]:
        """Current on-demand (pay-as-you-go, Linux, shared tenancy) prices of ``instance_types``.

        A type with no price is left out (the collector then leaves its on-demand offering out).
        ``ts`` is the provider's effective date where it gives one. Cached 6 h (list prices change
        monthly at most). Fails closed.
        """
        self._require(Feature.ON_DEMAND_PRICES, region)
        types = tuple(sorted(set(instance_types)))
        if not types:
            return []
        return self._guard(Feature.ON_DEMAND_PRICES, region, lambda: self._cached(
            Feature.ON_DEMAND_PRICES, (region, types), lambda: self._fetch_on_demand_prices(region, types)))

    def spot_prices(self, region: str, instance_types: Iterable[str], since: datetime | None = None) -> list[PricePoint]:
        """Spot prices of ``instance_types``: the history since ``since`` where the provider keeps
        one (``SPOT_PRICE_HISTORY`` supported, points with ``snapshot=False``), else the current
        price. Region-level: where prices are per zone, the cheapest zone at each moment.

        Not cached (spot prices are the point of polling). Fails closed.
        """
        self._require(Feature.SPOT_PRICES, region)
        types = tuple(sorted(set(instance_types)))
        if not types:
            return []
        return self._guard(Feature.SPOT_PRICES, region, lambda: self._fetch_spot_prices(region, types, since))

    def spot_availability(self, region: str, instance_types: Iterable[str]) -> list[AvailabilitySignal]:
        """Whether spot capacity of each type is obtainable now, where the provider gives a signal.

        Fails open: a type without a signal gets no row, and the bundle reads "no row" as
        available; a provider without any signal raises :class:`CloudNotSupportedError` (check
        :meth:`supports` first). Cached 10 min.
        """
        self._require(Feature.SPOT_AVAILABILITY, region)
        types = tuple(sorted(set(instance_types)))
        if not types:
            return []
        return self._guard(Feature.SPOT_AVAILABILITY, region, lambda: self._cached(
            Feature.SPOT_AVAILABILITY, (region, types), lambda: self._fetch_spot_availability(region, types)))

    def quotas(self, region: str) -> list[QuotaRecord]:
        """Accelerator and vCPU quotas in ``region`` (limit, and usage where the provider tells).

        Fails closed: an error raises, and the collector keeps the last snapshot marked stale —
        a quota is never guessed. Usage that cannot be read is left empty (``usage=None``) rather
        than failing the limits. Cached 5 min.
        """
        self._require(Feature.QUOTAS, region)
        return self._guard(Feature.QUOTAS, region, lambda: self._cached(
            Feature.QUOTAS, (region,), lambda: self._fetch_quotas(region)))

    def utilization(self, pool: PoolSelector, start: datetime, end: datetime) -> list[UtilizationSample]:
        """GPU (and CPU) utilization of the user's pool between ``start`` and ``end``, averaged over
        the pool's instances at each sample time. Instances are found by ``pool.tags``.

        Not cached. Fails open: a pool with no running instances or no metrics gives no samples.
        """
        self._require(Feature.UTILIZATION, pool.region)
        return self._guard(Feature.UTILIZATION, pool.region, lambda: self._fetch_utilization(pool, start, end))

    def group(self, offering_id: str, model: str = "") -> PoolGroup | None:
        """The configured group of the pool: the one naming this offering and model, else the
        offering's group that names no model (``None``: the config maps no group to it)."""
        exact = next((g for g in self.config.groups if g.key == (offering_id, model)), None)
        return exact or next((g for g in self.config.groups if g.key == (offering_id, "")), None)

    def inventory(self) -> list[GroupState]:
        """What every configured pool's group holds now (``config.groups``), one state per pool.

        Not cached. Fails closed: an error raises (the collector keeps the last rows, stale)."""
        return [self.group_state(g) for g in self.config.groups]

    def group_state(self, pool: PoolGroup) -> GroupState:
        """What ``pool``'s group holds now (desired, running, launching, its bounds). Not cached;
        fails closed."""
        self._require(Feature.INVENTORY, pool.region)
        return self._guard(Feature.INVENTORY, pool.region, lambda: self._fetch_group(pool))

    def set_capacity(self, pool: PoolGroup, desired: int) -> None:
        """Set ``pool``'s group's desired capacity to ``desired`` (one mutating call, retried only
        when the provider throttled it -- a throttled request was not carried out; a timeout or 5xx
        is not retried, its outcome being unknown). Fails closed."""
        self._require(Feature.ACTUATION, pool.region)
        if not pool.group:
            raise ConfigError(f"groups: pool {pool.label} is found by tags, not a group: there is no group to resize "
                              "(give its group's name)")
        self._guard(Feature.ACTUATION, pool.region, lambda: self._set_group_capacity(pool, desired))

    @abc.abstractmethod
    def api_endpoint(self, region: str) -> tuple[str, int]:
        """Host and port of the provider's public API endpoint for ``region`` (the RTT probe target)."""

    # -- provider hooks ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _fetch_offerings(self, region: str) -> list[InstanceOffer]: ...

    @abc.abstractmethod
    def _fetch_on_demand_prices(self, region: str, instance_types: tuple[str, ...]) -> list[PricePoint]: ...

    @abc.abstractmethod
    def _fetch_spot_prices(self, region: str, instance_types: tuple[str, ...], since: datetime | None) -> list[PricePoint]: ...

    @abc.abstractmethod
    def _fetch_quotas(self, region: str) -> list[QuotaRecord]: ...

    def _fetch_spot_availability(self, region: str, instance_types: tuple[str, ...]) -> list[AvailabilitySignal]:
        raise CloudNotSupportedError(self.name, "no spot availability signal", region=region)

    def _fetch_utilization(self, pool: PoolSelector, start: datetime, end: datetime) -> list[UtilizationSample]:
        raise CloudNotSupportedError(self.name, "no utilization source", region=pool.region)

    def _fetch_group(self, pool: PoolGroup) -> GroupState:
        raise CloudNotSupportedError(self.name, "no inventory of groups", region=pool.region)

    def _set_group_capacity(self, pool: PoolGroup, desired: int) -> None:
        raise CloudNotSupportedError(self.name, "no actuation of groups", region=pool.region)

    def _translate(self, exc: BaseException, operation: str, region: str | None) -> CloudError | None:
        """Turn an SDK/HTTP exception into one of ours (``None``: not recognised, re-raise as is)."""
        return None

    # -- shared machinery -------------------------------------------------------------------------

    def _wanted(self, o: InstanceOffer) -> bool:
        if self.config.gpu_only and o.accelerator_count <= 0:
            return False
        return self.config.instance_types is None or o.instance_type in self.config.instance_types

    def _cached(self, feature: Feature, key: tuple[Any, ...], fetch: Callable[[], T]) -> T:
        ttl = self.CACHE_TTL_S.get(feature, 0.0)
        if ttl > 0:
            hit = self._cache.get((feature, *key), ttl)
            if hit is not None:
                return hit  # type: ignore[no-any-return]
        value = fetch()
        if ttl > 0:
            self._cache.put((feature, *key), value)
        return value

    def _guard(self, feature: Feature, region: str | None, fn: Callable[[], T]) -> T:
        """Run a fetch so that no SDK exception escapes, even one raised outside :meth:`call`
        (building a client, reading a profile): each becomes a :class:`CloudError`."""
        try:
            return fn()
        except XrouteError:
            raise
        except Exception as e:
            err = self._translate(e, feature.value, region) or _sdk_error(self.name, e, feature.value, region)
            if err is None:
                raise
            raise err from e

    def clear_cache(self) -> None:
        self._cache.clear()

    def call(self, operation: str, region: str | None, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Call ``fn(*args, **kwargs)`` (one API request) with translation, retries and the deadline.

        Retries :class:`CloudThrottledError` and :class:`CloudUnavailableError` up to
        ``config.max_attempts`` attempts in all, waiting ``backoff_initial_s * 2**n`` plus up to
        50 % jitter (capped at ``backoff_max_s``), or the provider's Retry-After when longer; gives
        up at once when the wait would pass the deadline.
        """
        return self._call(operation, region, False, fn, *args, **kwargs)

    def call_mutation(self, operation: str, region: str | None, fn: Callable[..., T], /, *args: Any,
                      **kwargs: Any) -> T:
        """:meth:`call` for a request that changes something: retried only when throttled (the
        request was refused, not carried out); a timeout, broken connection or 5xx is not retried,
        since the change may have been made -- the caller reads the state back instead."""
        return self._call(operation, region, True, fn, *args, **kwargs)

    def _call(self, operation: str, region: str | None, mutating: bool, fn: Callable[..., T], /, *args: Any,
              **kwargs: Any) -> T:
        cfg = self.config

        def attempt() -> T:
            if self.deadline.expired:
                raise CloudUnavailableError(self.name, "the collection deadline passed", region=region, operation=operation)
            n = attempt_no[0]
            attempt_no[0] += 1
            self.stats.count(operation, retry=n > 0)
            try:
                return fn(*args, **kwargs)
            except CloudError:
                raise
            except Exception as e:
                err = self._translate(e, operation, region) or _sdk_error(self.name, e, operation, region)
                if err is None:
                    raise
                raise err from e

        attempt_no = [0]

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            backoff = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2 ** (state.attempt_number - 1))
            backoff += random.uniform(0, backoff / 2)
            if isinstance(exc, CloudThrottledError) and exc.retry_after is not None:
                backoff = max(backoff, exc.retry_after)
            return backoff

        def stop(state: RetryCallState) -> bool:
            if stop_after_attempt(cfg.max_attempts)(state):
                return True
            return wait(state) >= self.deadline.remaining()

        retryable = _throttled if mutating else (lambda e: isinstance(e, CloudError) and e.retryable)
        retrying = Retrying(
            retry=retry_if_exception(retryable),
            wait=wait,
            stop=stop,
            reraise=True,
        )
        return retrying(attempt)


def _throttled(e: BaseException) -> bool:
    return isinstance(e, CloudThrottledError)


#: top-level packages whose exceptions must not leave cloud_adapters untranslated
SDK_PACKAGES = frozenset({"boto3", "botocore", "azure", "msal", "google", "grpc", "requests", "urllib3", "httpx",
                          "httpcore"})


def _sdk_error(provider: str, exc: BaseException, operation: str, region: str | None) -> CloudError | None:
    """A generic :class:`CloudError` for an SDK exception no provider module recognised."""
    if type(exc).__module__.split(".")[0] not in SDK_PACKAGES:
        return None
    return CloudError(provider, f"{type(exc).__name__}: {str(exc)[:200]}", region=region, operation=operation)


class Reader:
    """Reads fields out of a decoded response; a missing or mistyped field raises
    :class:`CloudResponseError` naming the provider, region, operation and the field's path."""

    def __init__(self, provider: str, region: str | None, operation: str):
        self.provider, self.region, self.operation = provider, region, operation

    def error(self, problem: str, field: str | None = None) -> CloudError:
        from cloud_adapters.errors import CloudResponseError

        return CloudResponseError(self.provider, problem, region=self.region, operation=self.operation, field=field)

    def get(self, obj: Any, *path: str | int, cast: Callable[[Any], T] | None = None, prefix: str = "",
            default: Any = ...) -> Any:
        cur, name = obj, prefix
        for p in path:
            name += f"[{p}]" if isinstance(p, int) else (f".{p}" if name else p)
            try:
                cur = cur[p]
            except (KeyError, IndexError, TypeError):
                if default is not ...:
                    return default
                raise self.error("missing in the response", name) from None
        if cast is not None:
            try:
                return cast(cur)
            except (TypeError, ValueError):
                raise self.error(f"{str(cur)[:40]!r} is not a valid {getattr(cast, '__name__', 'value')}", name) from None
        return cur


def normalize_accelerator(name: str) -> str:
    """A shared accelerator name from a provider's: 'NVIDIA A10G' -> 'A10G'."""
    n = re.sub(r"^(nvidia|amd|intel|aws)\s+", "", name.strip(), flags=re.I)
    n = re.sub(r"^tesla\s+", "", n, flags=re.I)
    return n.replace(" ", "-").upper() if n else ""


def retry_after_seconds(value: Any) -> float | None:
    """Seconds from a Retry-After header (a number or an HTTP date)."""
    if value is None or value == "":
        return None
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        pass
    try:
        when = parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - utcnow()).total_seconds())


def parse_ts(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        t = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def frac(percent: float) -> float:
    """A percentage as a fraction clipped to 0-1."""
    return min(1.0, max(0.0, percent / 100.0))


def error_for_status(provider: str, status: int, problem: str, retry_after: Any, kw: dict[str, Any],
                     auth_hint: str) -> CloudError:
    """Our error for an HTTP status: 429 throttled (honouring Retry-After), 401/403 auth (with what
    to grant), 5xx/408 unavailable (retried), anything else a plain error."""
    if status == 429:
        return CloudThrottledError(provider, problem, retry_after=retry_after_seconds(retry_after), **kw)
    if status in (401, 403):
        return CloudAuthError(provider, problem, hint=auth_hint, **kw)
    if status >= 500 or status == 408:
        return CloudUnavailableError(provider, problem, **kw)
    return CloudError(provider, problem, **kw)


def translate_http_error(provider: str, exc: BaseException, kw: dict[str, Any], auth_hint: str) -> CloudError | None:
    """Errors of plain-HTTP calls (httpx) and their bodies, the same for every provider; ``None``
    when ``exc`` is none of those (the caller goes on with its SDK's own errors)."""
    import json

    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        return error_for_status(provider, exc.response.status_code, f"HTTP {exc.response.status_code}",
                                exc.response.headers.get("retry-after"), kw, auth_hint)
    if isinstance(exc, httpx.TransportError):
        return CloudUnavailableError(provider, f"{type(exc).__name__}: {str(exc)[:160]}", **kw)
    if isinstance(exc, json.JSONDecodeError):
        return CloudResponseError(provider, f"the response body is not JSON ({exc.msg} at {exc.pos})", **kw)
    return None


def anonymous_credentials(provider: str, env_var: str, configured: str, endpoint: str, real_endpoint: str) -> bool:
    """Whether to call ``endpoint`` without credentials (``credentials: anonymous``, for local API
    stand-ins only): refused against the provider's real endpoint, where the standard credential
    chain must be used."""
    mode = env_override(env_var) or configured
    if mode == "anonymous" and endpoint == real_endpoint:
        raise ConfigError(f"{provider}: credentials 'anonymous' is only for a local endpoint "
                          f"(XROUTE_{provider.upper()}_ENDPOINT)")
    return mode == "anonymous"
