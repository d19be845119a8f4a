"""Adapters registered by name; a provider's module (and so its SDK) is imported on first use only."""

from __future__ import annotations

import importlib
from typing import Any

from cloud_adapters.base import CloudAdapter, Deadline
from cloud_adapters.errors import UnknownProviderError

#: name -> "module:Class"; the module is imported only when the adapter is asked for
_REGISTRY: dict[str, str] = {
    "aws": "cloud_adapters.aws:AwsAdapter",
    "azure": "cloud_adapters.azure:AzureAdapter",
    "gcp": "cloud_adapters.gcp:GcpAdapter",
    "replay": "cloud_adapters.replay:ReplayAdapter",
    "prometheus": "cloud_adapters.prometheus:PrometheusSource",
}


def register(name: str, target: str) -> None:
    """Register an adapter class under ``name`` as ``"package.module:ClassName"``."""
    _REGISTRY[name] = target


def names() -> list[str]:
    """The registered adapter names."""
    return sorted(_REGISTRY)


def cloud_names() -> list[str]:
    """Registered adapters that talk to a cloud (not ``replay`` nor the ``prometheus`` source)."""
    return [n for n in names() if n not in ("replay", "prometheus")]


def adapter_class(name: str) -> type[CloudAdapter]:
    """The adapter class registered as ``name`` (imports its module, not its SDK)."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise UnknownProviderError(f"unknown provider '{name}' (known: {', '.join(names())})") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def get_adapter(name: str, config: dict[str, Any] | None = None, *, deadline: Deadline | None = None) -> CloudAdapter:
    """A new adapter instance for provider ``name`` with its settings ``config``."""
    return adapter_class(name)(config, deadline=deadline)
