"""The offering — what every routing decision chooses. Defined here only."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Offering:
    """provider x region x instance type x pricing mode, with its hardware.

    ``replicas_per_instance`` is how many single-accelerator model replicas one instance hosts
    (one per accelerator; at least one).
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
