"""The routing decision — what the router is asked, what it answers, and the feedback on it.

Defined here only: the HTTP API (``router/``), the decision log and ``xroute export-feedback``
all use these models. Requests are strict (unknown fields are errors, numbers must be finite) so
every bad field comes back as a 4xx naming it -- and take exactly what their published JSON Schema
says: an ``integer`` is a JSON number without a fractional part (``12``; ``12.0`` is the same
integer in JSON Schema 2020-12, which OpenAPI 3.1 uses), a ``number`` a JSON number, a ``boolean``
``true`` or ``false``; never a string or a boolean read as a number (``"12"``, ``true``) as
pydantic's lax mode would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    Strict,
    StringConstraints,
    model_validator,
)
from pydantic_core import PydanticCustomError

from xroute.admission_rules import Band
from xroute.schema.policy_ir import Constraints

Id = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@/+=-]+$")]
#: the most block hashes one request may carry
MAX_PREFIX_BLOCKS = 16384


def prefix_block_hashes(token_ids: Sequence[int], block_tokens: int = 512, salt: bytes = b"") -> list[int]:
    """A prompt's ``prefix_hashes`` from its token ids, as a client computes them before it sends
    the request: the ids cut into blocks of ``block_tokens`` (the router's ``prefix_block_tokens``;
    the last block may be partial), each block's id the first 8 bytes of BLAKE2b over the previous
    block's id and the block's token ids (little-endian uint32), as a signed 64-bit integer -- so an
    id names the block *and everything before it*, like vLLM's chained block hashes, and two prompts
    share exactly the leading ids of the blocks they share. ``salt`` starts the chain (a tenant that
    wants its prefixes kept apart from others' salts them, as vLLM's ``cache_salt``)."""
    import hashlib
    import struct

    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    out: list[int] = []
    prev = hashlib.blake2b(salt, digest_size=8).digest()
    ids = list(token_ids)
    for i in range(0, len(ids), block_tokens):
        block = ids[i:i + block_tokens]
        prev = hashlib.blake2b(prev + struct.pack(f"<{len(block)}I", *block), digest_size=8).digest()
        out.append(int.from_bytes(prev, "little", signed=True))
    return out


def _json_integer(v: object) -> object:
    """JSON Schema's ``integer``: a number with no fractional part (an int, or a float such as
    12.0), never a string or a boolean."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    if isinstance(v, float):
        if not v.is_integer():
            raise PydanticCustomError("int_from_float", "Input should be a valid integer, got a number with a "
                                                        "fractional part")
        return int(v)
    return v


#: request fields, as their JSON Schema types say (module docstring)
JsonInt = Annotated[int, BeforeValidator(_json_integer)]
#: JsonInt's validator, for an integer with bounds: ``Annotated[int, Field(ge=..., le=...),
#: BeforeValidator(json_integer)]`` (the bounds before it, so the published schema says
#: ``minimum`` / ``maximum``; after it, pydantic writes them as ``ge`` / ``le``, which JSON Schema ignores)
json_integer = _json_integer
JsonNumber = Annotated[float, Strict()]
JsonBool = Annotated[bool, Strict()]
#: one KV-cache block's id: a signed 64-bit integer (:func:`prefix_block_hashes`). The published
#: maximum is the largest double below 2**63 (JSON Schema tools read numbers as doubles: 2**63 - 1
#: reads as 2**63, so a generator took 2**63 for valid); the server accepts up to 2**63 - 1.
# the documented bounds sit 1024 inside the accepted ones: a client generating from the document in
# doubles (a JSON Schema validator, schemathesis) rounds 2**63 - 1 up and -(2**63) - 1 onto -(2**63)
BlockHash = Annotated[int, Field(ge=-(2**63), le=2**63 - 1,
                                 json_schema_extra={"maximum": 2**63 - 1024, "minimum": -(2**63) + 1024}),
                      BeforeValidator(_json_integer)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RouteRequest(_Strict):
    """``POST /v1/route``: one LLM inference request to place -- what a client knows before the
    answer exists (the same fields as a bundle's workload row, without the realized output)."""

    origin: Annotated[str, StringConstraints(min_length=1, max_length=128)] = Field(
        description="location id the request comes from (provider:region, see GET /v1/offerings)")
    input_tokens: JsonInt = Field(ge=0, le=2_000_000, description="prompt length in tokens")
    max_output_tokens: JsonInt = Field(
        ge=1, le=1_000_000, description="output token budget (max_tokens); the expected length is estimated from "
                                        "past completions of the tenant and model, capped at this budget")
    ttft_ms: JsonNumber = Field(ge=1, le=3_600_000, description="SLO: time to first token, milliseconds")
    tpot_ms: JsonNumber = Field(gt=0, le=60_000, description="SLO: mean time per output token after the first, milliseconds")
    deadline_ms: JsonNumber | None = Field(None, ge=1, le=86_400_000,
                                           description="SLO: optional end-to-end deadline, milliseconds")
    model: Id | None = Field(None, description="the model the request is for (GET /v1/offerings lists them); "
                                               "absent = the default model")
    session_id: Id | None = Field(None, description="opaque client session id (a conversation, an agent run): a "
                                  "soft preference for the pool its previous request went to (docs/router.md, "
                                  "'Prefix affinity and sessions'); stored with the decision")
    prefix_hashes: list[BlockHash] | None = Field(
        None, min_length=1, max_length=MAX_PREFIX_BLOCKS,
        description="the prompt's KV-cache block hashes, in prompt order: the token ids cut into blocks of the "
                    "router's prefix_block_tokens (GET /v1/offerings; the last block may be partial), each block's id "
                    "a signed 64-bit hash chained over the blocks before it, at most ceil(input_tokens / "
                    "prefix_block_tokens) of them; xroute.schema.decision.prefix_block_hashes computes them "
                    "(docs/router.md). The router sends the request where these blocks are expected cached when "
                    "that is worth it against load, cost and the SLO")
    request_class: Id | None = Field(
        None, description="the request's class (e.g. an SLO tier) for the routing policies' targets; absent = the "
                          "first slo_tiers entry of the policy set its SLO falls in (docs/policies.md)")
    constraints: Constraints | None = Field(
        None, description="allow / deny / prefer rules, ANDed with the tenant's default constraints and the routing "
                          "policies: a request's constraints can only narrow what they allow")
    priority: Band | None = Field(
        None, description="the request's priority band: critical > standard > sheddable (xroute.admission_rules); "
                          "absent = its tenant's default (tenants.<name>.priority), else standard. With admission on "
                          "(docs/router.md, 'Admission, priority and fairness'), a request no pool can serve within "
                          "its ttft_ms waits (critical, standard) or is refused at once (sheddable: 429 "
                          "slo_unattainable)")


class OfferingRef(BaseModel):
    offering_id: str
    provider: str
    region: str
    location: str
    instance_type: str
    pricing_mode: str
    accelerator: str


_SIG9 = " (9 significant digits)"


class Alternative(BaseModel):
    offering: OfferingRef
    score: float = Field(description="the deciding policy's score (higher is better); see score_kind" + _SIG9)
    expected_latency_ms: float = Field(description="expected end-to-end latency on this offering" + _SIG9)
    expected_cost_usd: float = Field(description="expected cost of the request on this offering" + _SIG9)


class PolicyInfo(BaseModel):
    name: str = Field(description="policy name: the registered model, or the fallback baseline")
    kind: Literal["model", "fallback"]
    version: str | None = Field(None, description="model version (registry version or file fingerprint)")
    uri: str | None = None
    reason: str | None = Field(None, description="why the fallback decided (no model, stale telemetry)")


class Exclusions(BaseModel):
    total: int = Field(description="offerings not eligible for this request")
    by_reason: dict[str, int] = Field(
        description="count per reason: '<tenant|request>:not_allowed' / ':denied' (constraints), 'policy:<name>' "
                    "(the routing policy that excluded them: docs/policies.md), 'not_preferred', 'unavailable' (spot "
                    "pool down), 'queue_full', 'no_capacity', 'no_price'")


class CanaryRef(BaseModel):
    """The canary rollout running when a decision was made (``docs/policies.md``, "Canary rollouts")."""

    id: str = Field(description="the canary's id")
    version: int = Field(description="the policy store's version that started it")
    key: str = Field(description="what selects a request's arm: tenant, session or request")
    share: float = Field(description="percent of the keys its arm decides")


class PoliciesApplied(BaseModel):
    """The routing policies of the decision (``docs/policies.md``)."""

    version: int = Field(description="the policy set's version the decision saw (0: none stored)")
    arm: str = Field("stable", description="which set decided: 'stable', or 'canary' (the canary's set: "
                                           "docs/policies.md, \"Canary rollouts\")")
    canary: CanaryRef | None = Field(None, description="the canary running then (absent: none)")
    request_class: str | None = Field(description="the request's class: its request_class, else its SLO tier")
    biased: dict[str, int] = Field(
        description="per prefer policy, how many allowed offerings it raised (its weight is in their scores)")


class TelemetryInfo(BaseModel):
    source: str = Field(description="where prices, availability and RTT come from, e.g. replay:<bundle>")
    clock: str = Field(description="how wall-clock time maps onto telemetry time")
    telemetry_time: str = Field(description="telemetry time the decision used (ISO-8601 UTC)")
    age_s: float = Field(description="seconds since the telemetry cache last refreshed from its source")
    stale: bool


class RouteResponse(BaseModel):
    """The answer to ``POST /v1/route`` (also what ``GET /v1/decisions/{id}`` returns, plus feedback)."""

    decision_id: str
    created_at: str = Field(description="wall-clock time of the decision (ISO-8601 UTC)")
    tenant: str
    session_id: str | None = None
    offering: OfferingRef
    expected_latency_ms: float = Field(description="expected end-to-end latency on the chosen offering" + _SIG9)
    expected_cost_usd: float = Field(description="expected cost of the request on the chosen offering" + _SIG9)
    score: float = Field(description="the deciding policy's score of the chosen offering" + _SIG9)
    score_kind: str = Field(description="'q_value' (model) or 'expected_reward' (one-step expectation)")
    alternatives: list[Alternative]
    policy: PolicyInfo
    excluded: Exclusions
    policies: PoliciesApplied | None = Field(None, description="the routing policies applied (absent in answers "
                                                                "logged before they existed)")
    telemetry: TelemetryInfo


_OBSERVED = ("latency_ms", "ttft_ms", "cost_usd", "output_tokens", "cached_tokens")
_ONE_OBSERVATION: list[JsonValue] = [{"required": ["failed"], "properties": {"failed": {"const": True}}}]
for _f in reversed(_OBSERVED):
    _ONE_OBSERVATION.insert(0, {"required": [_f], "properties": {_f: {"type": "number"}}})


class FeedbackRequest(_Strict):
    """``POST /v1/feedback``: what actually happened to a routed request -- at least one observation
    (said in the JSON schema too, as ``anyOf``, so generated clients and fuzzers agree)."""

    model_config = ConfigDict(**_Strict.model_config, json_schema_extra={"anyOf": _ONE_OBSERVATION})

    decision_id: Id
    latency_ms: JsonNumber | None = Field(None, ge=0, le=86_400_000, description="observed end-to-end latency "
                                          "(the pool's observed duration statistics)")
    ttft_ms: JsonNumber | None = Field(None, ge=0, le=86_400_000, description="observed time to first token")
    cost_usd: JsonNumber | None = Field(None, ge=0, le=1_000_000, description="observed cost")
    output_tokens: Annotated[int, Field(ge=0, le=1_000_000), BeforeValidator(_json_integer)] | None = Field(
        None, description="tokens actually generated")  # (bounds before the validator: the schema keeps them)
    cached_tokens: Annotated[int, Field(ge=0, le=2_000_000), BeforeValidator(_json_integer)] | None = Field(
        None, description="prompt tokens the server had cached (OpenAI-compatible servers: "
                          "usage.prompt_tokens_details.cached_tokens): corrects the router's prefix affinity for the "
                          "pool; at most the request's input_tokens")
    failed: JsonBool = Field(False, description="the request failed (error, timeout, preempted without retry)")
    error: Annotated[str, StringConstraints(max_length=1000)] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> FeedbackRequest:
        if (self.latency_ms is None and self.ttft_ms is None and self.cost_usd is None and self.output_tokens is None
                and self.cached_tokens is None and not self.failed):
            raise ValueError(f"give at least one of {', '.join(_OBSERVED)}, failed=true")
        return self


class FeedbackResponse(BaseModel):
    feedback_id: int
    decision_id: str
    received_at: str


class FeedbackRecord(BaseModel):
    feedback_id: int
    received_at: str
    latency_ms: float | None = None
    ttft_ms: float | None = None
    cost_usd: float | None = None
    output_tokens: int | None = None
    failed: bool = False
    error: str | None = None
    tpot_ms: float | None = Field(None, description="time per output token after the first (gateway: measured)")
    prompt_tokens: int | None = Field(None, description="prompt tokens as the inference server counted them (gateway)")
    cached_tokens: int | None = Field(None, description="of those, the ones its prefix cache held (measured by the "
                                                        "gateway, or reported in the feedback)")
    request_id: str | None = Field(None, description="the gateway request this attempt belonged to (its X-Request-ID; "
                                                     "every attempt of one request shares it)")
    attempt: int | None = Field(None, description="the attempt's number within that request, from 1 (gateway)")


class DecisionRecord(RouteResponse):
    """``GET /v1/decisions/{id}``: the decision as answered, the request, and its feedback."""

    request: dict[str, object]
    feedback: list[FeedbackRecord]


class OfferingState(BaseModel):
    offering: OfferingRef
    usd_per_hour: float | None
    available: bool
    valid: bool = Field(description="can take a request now (available, capacity, queue)")
    slots: int
    busy_slots: int = Field(description="this router's requests in flight there (its own view)")
    reserved: int | None = Field(None, description="reservations held there in the shared state (every router "
                                                   "sharing it); null while the state cannot be read")
    next_free_in_s: float
    external_util: float
    ejected: bool = Field(False, description="the default model's pool here is ejected (its servers failed "
                          "requests in a row: docs/gateway.md, \"Outlier ejection\"); new decisions skip it")
    ejected_for_s: float | None = Field(None, description="seconds until it is half-open (0: half-open, waiting for "
                                        "its probe); null: not ejected")


class EjectionState(BaseModel):
    target: str = Field(description="'pool:<model>|<offering_id>' or 'server:<base URL>'")
    ejected: bool
    ejected_for_s: float | None
    consecutive_failures: int
    ejections: int = Field(description="times it was ejected since the shared state began")


class WatchdogState(BaseModel):
    """The champion's watchdog (``router.decision.watchdog``; docs/ope.md, "The watchdog")."""

    state: Literal["off", "unavailable", "idle", "watching", "ok", "tripped"] = Field(
        description="off: disabled; unavailable: log_features false; idle: no champion loaded; watching: fewer "
                    "decisions with feedback than min_decisions; ok: the champion decides; tripped: greedy decides")
    estimate: float | None = Field(None, description="the mean paired doubly robust difference champion - greedy "
                                                     "(reward units per decision) over every term since the champion "
                                                     "was loaded (or the watchdog reset)")
    interval: list[float] | None = Field(None, description="its confidence sequence's bounds now at the configured "
                                                           "confidence (time-uniform: valid read after every term)")
    n: int = Field(description="paired terms since the champion was loaded (or the watchdog reset)")
    since: str = Field(description="when the state began (the sequence's start, or the trip)")
    version: str | None = Field(None, description="the champion version watched")
    horizon: int = Field(description="the number of terms at which the confidence sequence is tightest")
    confidence: float


class OfferingsResponse(BaseModel):
    telemetry: TelemetryInfo
    origins: list[str]
    models: list[str] = Field(description="models requests may name; the first is the default")
    prefix_block_tokens: int | None = Field(None, description="tokens per block of a request's prefix_hashes")
    offerings: list[OfferingState]
    ejections: list[EjectionState] = Field(default_factory=list, description="every pool and server ejected, "
                                           "half-open or with failures counted, as this router's view of the shared "
                                           "state has it")
    watchdog: WatchdogState | None = Field(None, description="the champion's watchdog: whether greedy decides "
                                                             "instead of it, and the estimate behind that")


class ErrorItem(BaseModel):
    field: str
    message: str
    suggestions: list[str] = []


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: ``error`` (a code), ``message`` and, for bad input, the fields."""

    error: str
    message: str
    fields: list[ErrorItem] = []
    request_id: str | None = None
