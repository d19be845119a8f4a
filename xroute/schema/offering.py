"""The offering — what every routing decision chooses. Defined here only."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: between a parent offering's id and its tier's name (``PROVIDER:REGION:TYPE:MODE#hot``)
TIER_SEP = "#"


def tier_offering_id(parent: str, tier: str) -> str:
    """The id of the tier ``tier`` of offering ``parent``."""
    return f"{parent}{TIER_SEP}{tier}"


def parent_offering_id(offering_id: str) -> str:
    """``offering_id`` without a tier suffix (the id a cloud knows the pool by)."""
    return offering_id.split(TIER_SEP, 1)[0]


@dataclass(frozen=True)
class Offering:
    """provider x region x instance type x pricing mode, with its hardware.

    ``replicas_per_instance`` is how many single-accelerator model replicas one instance hosts
    (one per accelerator; at least one).

    A **serving tier** (``tiers:`` of the env settings, ``xroute.catalog_tools.split_tiers``) is a
    part of a pool split off as its own offering: the same hardware, price and telemetry as its
    parent, ``tier`` its name, its id the parent's with ``#<tier>`` appended (:func:`tier_offering_id`;
    :func:`parent_offering_id` takes it off), and ``max_batch`` the request slots per replica it is
    held at (vLLM's ``max_num_seqs``; 0: the serving profile's, as every untiered offering).
    """

    offering_id: str
    provider: str
    region: str
    instance_type: str
    pricing_mode: str
    accelerator: str
    accelerator_count: int
    vcpus: float
    memory_gib: float
    zone: str = ""
    capacity_replicas: int = 0
    tier: str = ""
    max_batch: int = 0

    @property
    def parent_id(self) -> str:
        """The offering this tier was split from (its own id when it is no tier)."""
        return parent_offering_id(self.offering_id) if self.tier else self.offering_id

    @property
    def location(self) -> str:
        return f"{self.provider}:{self.region}"

    @property
    def is_spot(self) -> bool:
        return self.pricing_mode == "spot"

    @property
    def replicas_per_instance(self) -> int:
        return max(1, int(self.accelerator_count))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["location"] = self.location
        return d
