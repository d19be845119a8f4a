"""The telemetry bundle schema — the one place that defines it.

A *bundle* is a directory of tables (CSV, gzipped CSV or Parquet), one file per table, named
``<table>.csv``, ``<table>.csv.gz`` or ``<table>.parquet``. Every other module (the loader, the
environment, the adapters' writers, the router's cache) imports the table specs from here.

See ``docs/telemetry.md`` for the prose version of this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ColumnKind = Literal["str", "float", "int", "ts", "flag", "ints"]

PROVIDERS: tuple[str, ...] = ("aws", "azure", "gcp")
PRICING_MODES: tuple[str, ...] = ("on_demand", "spot")
TABLE_SUFFIXES: tuple[str, ...] = (".csv", ".csv.gz", ".parquet")


@dataclass(frozen=True)
class Column:
    """One column of a table.

    ``kind``: ``str`` (non-empty text), ``float``/``int`` (finite numbers), ``ts`` (ISO-8601 UTC
    timestamp), ``flag`` (0 or 1), ``ints`` (a list of signed 64-bit integers: in CSV one cell of
    ids separated by spaces, in Parquet a list column or that text). ``minimum``/``maximum`` bound numbers inclusively;
    ``choices`` restricts text. An optional column may be absent or hold empty cells.
    """

    name: str
    kind: ColumnKind
    required: bool = True
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    doc: str = ""


@dataclass(frozen=True)
class Table:
    """One table of a bundle: its columns, and whether the bundle may omit it."""

    name: str
    columns: tuple[Column, ...]
    required: bool = True
    time_column: str | None = None
    #: rows must be ordered by ``time_column`` within each group of these columns
    order_within: tuple[str, ...] = ()
    doc: str = ""
    unique: tuple[str, ...] = field(default=())

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def required_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.required)


OFFERINGS = Table(
    name="offerings",
    doc="The catalog: one row per offering (provider x region x instance type x pricing mode).",
    unique=("offering_id",),
    columns=(
        Column("offering_id", "str", doc="unique id, e.g. aws:us-east-1:g5.xlarge:spot"),
        Column("provider", "str", choices=PROVIDERS),
        Column("region", "str", doc="provider region; provider:region is the location id"),
        Column("zone", "str", required=False),
        Column("instance_type", "str"),
        Column("accelerator", "str", required=False, doc="shared accelerator name (T4, A10G, ...)"),
        Column("accelerator_count", "int", minimum=0),
        Column("vcpus", "float", minimum=0),
        Column("memory_gib", "float", minimum=0),
        Column("pricing_mode", "str", choices=PRICING_MODES),
        Column("capacity_replicas", "int", required=False, minimum=0,
               doc="model replicas we hold in that pool"),
        Column("notice_s", "float", required=False, minimum=0.0, maximum=3600.0,
               doc="seconds of notice the cloud gives before a spot instance of this offering stops (AWS 120, "
               "Azure and GCP about 30; 0 = none); written by the bundle builder from cloud_adapters.events; "
               "absent or empty = the environment's migration.default_notice_s; read for spot offerings only"),
    ),
)

PRICES = Table(
    name="prices",
    doc="Step function per offering: each row holds until the next row of the same offering.",
    time_column="ts",
    order_within=("offering_id",),
    columns=(
        Column("ts", "ts"),
        Column("offering_id", "str"),
        Column("usd_per_hour", "float", minimum=0.0),
    ),
)

AVAILABILITY = Table(
    name="availability",
    doc="Spot availability per offering: 1 = obtainable/running, a flip to 0 preempts the pool. "
    "Offerings with no rows are always available.",
    required=False,
    time_column="ts",
    order_within=("offering_id",),
    columns=(
        Column("ts", "ts"),
        Column("offering_id", "str"),
        Column("available", "flag"),
    ),
)

RTT = Table(
    name="rtt",
    doc="Round-trip time between location ids (provider:region).",
    unique=("src", "dst"),
    columns=(
        Column("src", "str"),
        Column("dst", "str"),
        Column("rtt_ms", "float", minimum=0.0),
    ),
)

THROUGHPUT = Table(
    name="throughput",
    doc="Measured network throughput between location ids (provider:region), for moving a session's "
    "KV cache when it migrates; pairs it does not name use the environment's "
    "migration.default_throughput_gbps.",
    required=False,
    unique=("src", "dst"),
    columns=(
        Column("src", "str"),
        Column("dst", "str"),
        Column("gbps", "float", minimum=0.001, doc="median received throughput, Gbit/s"),
    ),
)

WORKLOAD = Table(
    name="workload",
    doc="The request stream, in arrival order. Every column but ``output_tokens`` is what a client "
    "sends with the request (what a router knows when it decides); ``output_tokens`` is the realized "
    "outcome, read only by the simulation of service (and the hindsight oracle).",
    time_column="ts",
    unique=("request_id",),
    columns=(
        Column("ts", "ts"),
        Column("request_id", "str"),
        Column("origin", "str", doc="location id the request comes from"),
        Column("input_tokens", "int", minimum=0),
        Column("max_output_tokens", "int", required=False, minimum=1,
               doc="the client's output budget (max_tokens); when the column is absent it is derived "
               "per tenant: the smallest power of two >= the longest output of that tenant in the bundle"),
        Column("ttft_ms", "float", minimum=1.0, doc="SLO: time to first token, ms"),
        Column("tpot_ms", "float", minimum=0.01, doc="SLO: mean time per output token after the first, ms"),
        Column("deadline_ms", "float", required=False, minimum=1.0,
               doc="SLO: optional end-to-end deadline, ms"),
        Column("model", "str", required=False,
               doc="model the request is for (configs/models.yaml); absent or empty = the default model"),
        Column("output_tokens", "int", minimum=0,
               doc="REALIZED tokens generated: the outcome, for simulating service only"),
        Column("session_id", "str", required=False,
               doc="requests of one conversation or agent session, when known (what the client sends)"),
        Column("tenant", "str", required=False),
        Column("priority", "str", required=False,
               doc="the request's priority band (critical, standard, sheddable), when the client names one; "
               "absent or empty = its tenant's default (docs/env.md, \"Admission under load\")"),
        Column("request_class", "str", required=False,
               doc="the request's class as the client names it (e.g. an SLO tier); policies may target it"),
        Column("prefix_hashes", "ints", required=False,
               doc="the prompt's KV-cache block hashes, one signed 64-bit id per block of "
               "BundleMeta.prefix_block_tokens tokens, in prompt order (the last block may be partial): "
               "the same id = the same block with the same prefix before it, so a request's ids are a "
               "chain (vLLM's block hashes, Mooncake's hash_ids); at most ceil(input_tokens / block) ids. "
               "Known before the answer exists (the prompt is), so a router may read it; absent or empty = "
               "no prefix information (no prefix caching for that request)"),
    ),
)

#: columns of earlier bundle formats and what replaced them (named in the error for a stale bundle)
REPLACED_COLUMNS: dict[str, dict[str, str]] = {
    "workload": {"sla_ms": "the SLO is now ttft_ms + tpot_ms (and an optional deadline_ms); rebuild the bundle "
                           "(tools/build_default_bundle.py) or add those columns"},
}

UTILIZATION = Table(
    name="utilization",
    doc="Load on each pool from outside xroute (0-1); feeds the pool-load features.",
    required=False,
    time_column="ts",
    order_within=("offering_id",),
    columns=(
        Column("ts", "ts"),
        Column("offering_id", "str"),
        Column("gpu_util", "float", minimum=0.0, maximum=1.0),
        Column("cpu_util", "float", required=False, minimum=0.0, maximum=1.0),
    ),
)

QUOTAS = Table(
    name="quotas",
    doc="Capacity quotas per provider, region and family, as collected (snapshots).",
    required=False,
    time_column="ts",
    order_within=("provider", "region", "quota_name"),
    columns=(
        Column("ts", "ts"),
        Column("provider", "str", choices=PROVIDERS),
        Column("region", "str"),
        Column("quota_name", "str", doc="e.g. a GPU family or vCPU quota name, as the provider calls it"),
        Column("unit", "str", doc="vcpus | gpus | instances"),
        Column("limit", "float", minimum=0.0),
        Column("usage", "float", required=False, minimum=0.0),
        Column("covers", "str", required=False,
               doc="the offerings whose instances count against it: ';'-separated offering_id patterns with * "
               "and ? wildcards (written by the adapter that collected it); empty: not known, the quota masks "
               "nothing"),
    ),
)

INVENTORY = Table(
    name="inventory",
    doc="The instances running in each pool, as the clouds report them (snapshots; each row holds until the "
    "next of the same offering and model). From its first row on, a pool holds the model replicas its running "
    "instances hold (envs.replay.PoolInventory); a pool without rows keeps the offering's capacity_replicas.",
    required=False,
    time_column="ts",
    order_within=("offering_id", "model"),
    columns=(
        Column("ts", "ts"),
        Column("offering_id", "str"),
        Column("model", "str", required=False, doc="the model the instances serve (empty: the default model)"),
        Column("running", "int", minimum=0, doc="instances running and serving"),
        Column("launching", "int", required=False, minimum=0, doc="instances requested, not serving yet"),
    ),
)

#: the bundle's own metadata file (optional): what is not a table
META_FILE = "bundle.yaml"


class BundleMeta(BaseModel):
    """``bundle.yaml``: facts about the bundle as a whole (unknown keys are errors).

    ``prefix_block_tokens`` -- the KV-cache block size, in tokens, the workload's ``prefix_hashes``
    were computed with (required when any row has them): a request's cached prefix is a whole
    number of blocks."""

    model_config = ConfigDict(extra="forbid")

    prefix_block_tokens: int | None = Field(None, ge=1, le=1_048_576,
                                            description="tokens per prefix block of prefix_hashes")
    description: str = ""


TABLES: dict[str, Table] = {
    t.name: t for t in (OFFERINGS, PRICES, AVAILABILITY, RTT, WORKLOAD, UTILIZATION, QUOTAS, THROUGHPUT, INVENTORY)
}


def location_id(provider: str, region: str) -> str:
    """The location id of a provider region: ``provider:region``."""
    return f"{provider}:{region}"
