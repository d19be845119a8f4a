"""Router settings: defaults < config file < ``XROUTE_ROUTER_*`` environment < explicit overrides.

The config file is YAML with the fields below at top level; it is ``--config``, else
``$XROUTE_ROUTER_CONFIG``, else ``configs/router.yaml`` when present. Nested fields use ``__`` in
environment variables (``XROUTE_ROUTER_ENV__SERVING_CONFIG=/abs/serving.yaml``). Unknown keys are
errors, reported with the field's name.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from xroute import migration_rules as rules
from xroute.admission_rules import Band
from xroute.config import CONFIG_DIR, read_yaml
from xroute.errors import ConfigError
from xroute.schema.policy_ir import Constraints
from xroute.schema.quota import TenantQuotas

# ---- defaults the state and the decision log use too (router.state.base, router.store.sqlite)
#: the default weight of a new outcome in the per-pool statistics (``router.state.base``'s docstring)
STATS_ALPHA = 0.05
#: :func:`hold_for`'s default: a reservation is held for this many times its expected time ...
HOLD_FACTOR = 2.0
#: ... at least this long (seconds) ...
HOLD_FLOOR_S = 1.0
#: ... and at most this long (seconds)
HOLD_MAX_S = 3600.0
#: the default cadence of the checkpoints run between commits (``RouterSettings.db_checkpoint_rows``
#: and ``db_checkpoint_s``): small ones, often (``router.store.sqlite``'s docstring)
CHECKPOINT_ROWS = 500
CHECKPOINT_S = 0.25

_FILE_DATA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("router_settings_file", default=None)


#: the largest exploration probability a tenant may be given (``tenants.<name>.explore_epsilon``)
EXPLORE_MAX = 0.2


class TenantGateway(BaseModel):
    """A tenant's defaults for the OpenAI-compatible gateway (``router.gateway``, ``docs/gateway.md``):
    its SLOs and origin when a request's headers give none, and whether its prompts and completions
    are kept."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(None, ge=1, le=3_600_000, description="SLO: time to first token, ms (default: "
                                  "gateway.ttft_ms)")
    tpot_ms: float | None = Field(None, gt=0, le=60_000, description="SLO: time per output token, ms (default: "
                                  "gateway.tpot_ms)")
    deadline_ms: float | None = Field(None, ge=1, le=86_400_000, description="SLO: end-to-end deadline, ms")
    origin: str | None = Field(None, min_length=1, max_length=128, description="where this tenant's requests come "
                               "from, a location id (default: gateway.origin)")
    store_prompts: bool = Field(False, description="keep this tenant's prompts and completions in the transcript "
                                "store (gateway.transcripts_path); off by default, and never in any log")


_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"


def read_secret(env: str | None, file: Path | None, where: str) -> str | None:
    """The secret an environment variable (``env``) or a file (``file``, e.g. a mounted secret)
    holds; None when neither is named. A ``ConfigError`` names ``where`` + ``_env``/``_file`` when
    it is unset, unreadable or empty. Never logged."""
    if env is not None:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ConfigError(f"{where}_env': the environment variable '{env}' is not set")
        return value
    if file is not None:
        try:
            value = file.read_text().strip()
        except OSError as e:
            raise ConfigError(f"{where}_file': cannot read '{file}' ({e.strerror})") from None
        if not value:
            raise ConfigError(f"{where}_file': '{file}' is empty")
        return value
    return None


#: where a webhook's signing secret is: ``env:<VARIABLE>`` or ``file:<absolute path>``
WEBHOOK_SECRET_PATTERN = r"^(env:[A-Za-z_][A-Za-z0-9_]{0,127}|file:/[ -~]{1,1023})$"


class TenantWebhook(BaseModel):
    """Where a tenant hears that a migration of one of its sessions ended (``router.service.webhooks``,
    ``docs/migration.md``): an HTTP(S) URL, and where the secret that signs each call is -- an
    environment variable or a file (a mounted secret), never the config itself. (One string for
    the secret's source, not two exclusive fields, so the published JSON schema says exactly what
    is accepted.)"""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://[!-~]{1,2040}$", description="the URL each notice is POSTed to "
                     "(http:// or https://)")
    secret: str = Field(pattern=WEBHOOK_SECRET_PATTERN, description="the signing secret's source (HMAC-SHA256, "
                        "header X-Xroute-Signature): 'env:<VARIABLE>' or 'file:<absolute path>'")

    def read(self, where: str) -> str:
        """The secret (a ``ConfigError`` naming ``where`` when it is unset, unreadable or empty)."""
        kind, _, ref = self.secret.partition(":")
        got = read_secret(ref if kind == "env" else None, Path(ref) if kind == "file" else None, where)
        assert got is not None
        return got


class TenantConfig(BaseModel):
    """Per-tenant settings; ``constraints`` apply to every request of the tenant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    constraints: Constraints = Constraints()
    explore_epsilon: float = Field(
        0.0, ge=0.0, le=EXPLORE_MAX,
        description="exploration for off-policy evaluation (docs/ope.md): with this probability a request goes to an "
                    "offering drawn uniformly from the ones it may go to, instead of the policy's choice; 0 = never "
                    f"(the default), at most {EXPLORE_MAX}")
    gateway: TenantGateway = Field(default_factory=TenantGateway, description="the tenant's gateway defaults")
    quotas: TenantQuotas | None = Field(
        None, description="the tenant's quotas (docs/quotas.md): max_concurrent, tokens_per_minute, requests_per_day, "
                          "usd_per_day, and the same per model under models; over one, a request gets 429")
    webhook: TenantWebhook | None = Field(
        None, description="where the tenant hears of its sessions' migrations ending (docs/migration.md, "
                          "\"Webhooks\"): signed, delivered at least once, retried with backoff")
    priority: Band | None = Field(
        None, description="the band of the tenant's requests that name none (critical > standard > sheddable; "
                          "absent = standard): docs/router.md, 'Admission, priority and fairness'")
    weight: float = Field(
        1.0, gt=0, le=1e6, description="the tenant's share in the fair queue (the Virtual Token Counter counts its "
                                       "served tokens divided by this weight): a tenant of weight 2 is served twice "
                                       "the tokens of one of weight 1 when both wait")


class AdmissionSettings(BaseModel):
    """Admission that predicts (``router.service.admission_queue``; docs/router.md, "Admission,
    priority and fairness")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="predict each request's TTFT at the feasible pools before placing it: "
                                             "one no pool can serve within its ttft_ms waits in this router's queue "
                                             "(critical, standard) or is refused at once (sheddable)")
    queue_limit: int = Field(256, ge=0, le=1_000_000, description="the most requests waiting in one router "
                             "process's queue; one more is refused (429 admission_queue_full); > 0 when enabled")
    recheck_s: float = Field(0.05, gt=0, le=5, description="while requests wait, how often the queue tries again "
                             "(capacity other routers free is seen only in the shared state)")

    @model_validator(mode="after")
    def _room_to_wait(self) -> AdmissionSettings:
        if self.enabled and self.queue_limit == 0:
            raise ValueError("queue_limit: must be > 0 with admission enabled (requests wait in the queue)")
        return self


class WatchdogSettings(BaseModel):
    """The champion's watchdog (``router.decision.watchdog``; docs/ope.md, "The watchdog"): **off by
    default**. Its verdict is a confidence sequence over every paired term since the champion was
    loaded, read after every term (anytime-valid: the false alarms of reading a fixed-level interval
    after every term are gone); whether that is enough to turn it on is measured in docs/ope.md
    (``benchmarks/bench_watchdog.py --export``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="estimate the champion minus greedy on the decisions' feedback and serve "
                                            "greedy when the confidence sequence lies below -margin (with log_features: "
                                            "false it has no estimate and says so)")
    horizon: int = Field(1000, ge=50, le=1_000_000, description="the number of paired terms at which the confidence "
                                                                "sequence is tightest (its rho); the sequence runs "
                                                                "over every term since the champion was loaded")
    min_decisions: int = Field(500, ge=20, le=100_000, description="no verdict before this many decisions of the "
                                                                   "champion with feedback")
    confidence: float = Field(0.99, gt=0.5, lt=1.0, description="the two-sided level of the confidence sequence over "
                                                                "the paired differences (time-uniform: 1 - the chance "
                                                                "it ever misses)")
    margin: float = Field(0.0002, ge=0.0, le=1.0, description="trips when the sequence's upper bound is below "
                                                              "-margin (reward units per decision; the default is the "
                                                              "gate's non-inferiority margin)")

    sync_s: float = Field(1.0, gt=0, le=60, description="how often each router reads the others' trips and resets "
                                                         "(the audit log)")

    @model_validator(mode="before")
    @classmethod
    def _no_window(cls, data: Any) -> Any:
        if isinstance(data, dict) and "window" in data:
            raise ValueError("window: no longer a setting: the verdict is a confidence sequence over every term since "
                             "the champion was loaded, not a sliding window (a window would not be anytime-valid); "
                             "'horizon' sets where the sequence is tightest")
        return data


class CapacitySettings(BaseModel):
    """The capacity plan the router answers (``GET /v1/capacity/plan``; ``router.service.capacity``,
    docs/capacity.md, "Planning in the service")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    planner: str = Field("spothedge", min_length=1, max_length=500,
                         description="the planner: static-ondemand, autoscaler, spothedge, melange, or a learned one "
                                     "(models:/xroute-planner@champion, runs:/..., an export directory)")
    epoch_s: float = Field(60.0, gt=0, le=3600, description="telemetry seconds a plan holds: one plan per epoch, "
                                                              "made at its start and cached")
    config: str = Field("capacity.yaml", min_length=1, description="the capacity config (the world's and the "
                        "planners' knobs): a path, or a file name under configs/")

    @field_validator("planner")
    @classmethod
    def _known_planner(cls, v: str) -> str:
        v = v.strip()
        if v == "oracle":
            raise ValueError("'oracle' plans with hindsight (the true future), which a plan made now does not have")
        if v in _PLANNERS or v.startswith(("models:/", "runs:/")) or Path(v).expanduser().exists():
            return v
        raise ValueError(f"unknown planner '{v}' (planners: {', '.join(_PLANNERS)}, a models:/ or runs:/ URI, or an "
                         "export directory)")


class TracingSettings(BaseModel):
    """OpenTelemetry traces (``router.core.tracing``; docs/observability.md): off by default; on, the
    SDK and its OTLP/HTTP exporter (``pip install 'xroute[otel]'``) send the router's spans."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="export OpenTelemetry spans (the route and its stages, the shared-state "
                                             "and decision-log calls, the gateway's attempts and upstream calls)")
    otlp_endpoint: str = Field("http://127.0.0.1:4318/v1/traces", min_length=1, max_length=2000,
                               description="the OTLP/HTTP (protobuf) traces endpoint the spans are sent to")
    service_name: str = Field("xroute-router", min_length=1, max_length=200,
                              description="the resource's service.name")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="the share of new traces sampled (a caller's "
                                "traceparent's sampled flag is followed: parent-based)")

    @field_validator("otlp_endpoint")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP over HTTP)")
        return v


#: the baselines a router may plan with (``models.planners.PLANNERS`` less the oracle; checked equal by the tests)
_PLANNERS = ("static-ondemand", "autoscaler", "spothedge", "melange")


class InferenceServer(BaseModel):
    """A pool whose inference servers expose Prometheus metrics (``router.service.scrape``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offering_id: str = Field(min_length=1, description="the offering the servers run on (GET /v1/offerings)")
    model: str | None = Field(None, description="the model they serve (default: the default model)")
    endpoints: list[str] = Field(min_length=1, description="each server's metrics URL, e.g. http://10.0.0.5:8000/metrics")

    @field_validator("endpoints")
    @classmethod
    def _http(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"'{url}' is not an http:// or https:// URL")
        return v




class Upstream(BaseModel):
    """The inference servers of one pool (an offering, for one model) that the gateway forwards to:
    their OpenAI-compatible base URLs and where their API key comes from -- an environment variable
    or a file (a mounted secret), never the config itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offering_id: str = Field(min_length=1, description="the offering the servers run on (GET /v1/offerings)")
    model: str | None = Field(None, description="the model they serve, as configs/models.yaml names it (default: "
                                                "the default model)")
    base_urls: list[str] = Field(min_length=1, description="each server's OpenAI-compatible base URL, e.g. "
                                                           "http://10.0.0.5:8000/v1")
    served_model: str | None = Field(None, min_length=1, description="the model's name on those servers (vLLM's "
                                     "--served-model-name; default: the model's id)")
    api_key_env: str | None = Field(None, pattern=_ENV_NAME, description="the environment variable holding the "
                                    "servers' API key (sent as Authorization: Bearer)")
    api_key_file: Path | None = Field(None, description="... or a file holding it (e.g. a mounted secret)")

    @field_validator("base_urls")
    @classmethod
    def _http(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"'{url}' is not an http:// or https:// URL")
        return [url.rstrip("/") for url in v]

    @model_validator(mode="after")
    def _one_key_source(self) -> Upstream:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give api_key_env or api_key_file, not both")
        return self


class EjectionSettings(BaseModel):
    """Outlier ejection of the gateway's servers and pools (``router.gateway.health``; docs/gateway.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="eject servers and pools that fail requests in a row")
    consecutive_failures: int = Field(3, ge=1, le=1000, description="failures in a row (connect errors, 5xx, first "
                                      "tokens timed out) that eject a server or a pool")
    base_s: float = Field(30.0, gt=0, le=86_400, description="how long the first ejection lasts; doubled on each "
                          "ejection in a row")
    max_s: float = Field(300.0, gt=0, le=86_400, description="the longest an ejection lasts (and how long a target "
                         "must have been back for its next ejection to start again at base_s)")

    @field_validator("max_s")
    @classmethod
    def _at_least_base(cls, v: float, info: ValidationInfo) -> float:
        base = info.data.get("base_s")
        if base is not None and v < base:
            raise ValueError(f"must be at least base_s ({base})")
        return v


class RetryBudgetSettings(BaseModel):
    """The gateway's retry budget (Envoy's ``retry_budget``; ``router.gateway.health.RetryBudget``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="bound retries by a share of the requests")
    ratio: float = Field(0.2, ge=0, le=100, description="retries at most this share of the requests over the window")
    min_retries: int = Field(20, ge=0, le=1_000_000, description="... or this many, when that is more (so a "
                             "quiet gateway may still retry)")
    window_s: float = Field(10.0, gt=0, le=3600, description="the sliding window the budget counts over")


class GatewaySettings(BaseModel):
    """The OpenAI-compatible gateway (``router.gateway``; ``docs/gateway.md``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    origin: str | None = Field(None, min_length=1, max_length=128, description="where requests come from (the "
                               "location this gateway runs in) unless the tenant or an X-Xroute-Origin header says")
    ttft_ms: float = Field(2000.0, ge=1, le=3_600_000, description="SLO: time to first token (ms) of a request whose "
                           "headers and tenant give none; also its budget for retries")
    tpot_ms: float = Field(100.0, gt=0, le=60_000, description="SLO: time per output token (ms), likewise")
    deadline_ms: float | None = Field(None, ge=1, le=86_400_000, description="SLO: end-to-end deadline (ms), likewise")
    default_max_tokens: int = Field(512, ge=1, le=1_000_000, description="the output budget the routing decision "
                                    "assumes for a request without max_tokens / max_completion_tokens (the request is "
                                    "forwarded without one)")
    connect_timeout_s: float = Field(2.0, gt=0, le=600, description="connecting to an inference server (and "
                                     "waiting for a pooled connection)")
    first_token_timeout_s: float = Field(30.0, gt=0, le=3600, description="a stream whose first token has not "
                                         "come this long after it was sent fails (and is retried within the TTFT "
                                         "budget)")
    idle_timeout_s: float = Field(30.0, gt=0, le=3600, description="a stream silent this long between two tokens "
                                  "ends with an error event")
    response_timeout_s: float = Field(600.0, gt=0, le=86_400, description="a request that is not streamed: its "
                                      "whole answer")
    max_attempts: int = Field(3, ge=1, le=10, description="offerings tried per request (each at most once; a retry "
                              "only before the first token and within the TTFT budget)")
    max_connections: int = Field(1000, ge=1, le=100_000, description="open connections to the inference servers, "
                                 "all together")
    keepalive_s: float = Field(15.0, gt=0, le=3600, description="an idle connection to a server is kept this "
                               "long for reuse")
    upstream_down_s: float = Field(5.0, ge=0, le=3600, description="a server that refused a connection is skipped "
                                   "this long while its pool has others")
    max_body_bytes: int = Field(8 * 2**20, ge=1024, le=2**30, description="larger chat/completion bodies get 413 "
                                "(the other routes keep max_body_bytes)")
    tokenizers: dict[str, Path] = Field(default_factory=dict, description="model -> a local tokenizer.json (Hugging "
                                        "Face tokenizers format; needs xroute[tokenizers]) to count prompt tokens; "
                                        "other models: the estimate in docs/gateway.md")
    transcripts_path: Path = Field(Path("runs/router/transcripts.db"), description="where the prompts and "
                                   "completions of tenants with store_prompts are kept (SQLite)")
    ejection: EjectionSettings = Field(default_factory=EjectionSettings, description="outlier ejection of servers "
                                       "and pools")
    retry_budget: RetryBudgetSettings = Field(default_factory=RetryBudgetSettings, description="the share of "
                                              "requests that may be retried")


class InferenceMetrics(BaseModel):
    """The metric names an inference server exposes (vLLM's by default; its v0 called the KV-cache
    gauge ``vllm:gpu_cache_usage_perc``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    running: str = "vllm:num_requests_running"
    waiting: str = "vllm:num_requests_waiting"
    kv_cache: str = "vllm:kv_cache_usage_perc"


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="XROUTE_ROUTER_", env_nested_delimiter="__", extra="forbid",
                                      frozen=True)

    # telemetry ------------------------------------------------------------------------------
    telemetry: Path | None = Field(None, description="telemetry bundle directory (default: the shipped bundle)")
    telemetry_live: bool = Field(
        False, description="serve 'telemetry' live: a directory kept current by xroute telemetry collect --out, on the "
                           "wall clock, reloaded when the collector commits (default: replay a recorded bundle)")
    replay_speed: float = Field(1.0, gt=0, description="telemetry seconds per wall-clock second")
    replay_offset_s: float = Field(0.0, ge=0, description="where in the recorded window the replay starts")
    telemetry_refresh_s: float = Field(10.0, gt=0, description="how often the telemetry cache polls its source")
    max_telemetry_age_s: float = Field(
        120.0, gt=0, description="older telemetry is stale: the fallback policy decides, and says so")
    env: dict[str, Any] = Field(default_factory=dict, description="CloudRoute-v0 env config overrides (EnvConfig)")

    # policy ---------------------------------------------------------------------------------
    model_uri: str = Field("models:/xroute-router@champion",
                           description="MLflow model URI or local path; empty = always the fallback")
    model_loader: str = Field("models.loader:load_policy", description="module:function(uri) -> policy")
    model_poll_s: float = Field(30.0, ge=0, description="how often the alias (or file) is checked; 0 = never")
    model_load_timeout_s: float = Field(30.0, gt=0, description="at start, serve the fallback after this long")
    fallback_policy: str = Field("greedy", description="baseline used when no model is loaded or telemetry is stale")
    alternatives: int = Field(3, ge=0, le=20, description="next-best offerings returned with each decision")

    # storage and security -------------------------------------------------------------------
    db_path: Path = Field(Path("runs/router/decisions.db"), description="SQLite decision log (WAL); used when "
                          "db_url is unset")
    db_url: SecretStr | None = Field(
        None, description="the decision log on PostgreSQL instead of SQLite: postgresql://user@host:port/dbname "
                          "(many routers can write one log); the password from PGPASSWORD, PGPASSFILE, ~/.pgpass "
                          "or a passfile= parameter, never shown or logged")
    db_synchronous: Literal["FULL", "NORMAL"] = Field(
        "FULL", description="FULL: each group commit is fsynced before any of its requests is answered")
    db_batch_max: int = Field(512, ge=1, le=10_000, description="most decisions per group commit")
    db_checkpoint_rows: int = Field(
        CHECKPOINT_ROWS, ge=1, le=1_000_000,
        description="copy the WAL into the database (a checkpoint between two group commits) after this many "
                    "decisions; smaller: shorter pauses, more often")
    db_checkpoint_s: float = Field(
        CHECKPOINT_S, gt=0, le=3600,
        description="also checkpoint once this many seconds have gone by (whichever of the two comes first)")
    db_compress: bool = Field(
        True, description="store each answer Zstandard-compressed against a dictionary of the catalog (~4x "
                          "smaller answers, ~4x smaller log); false stores the JSON text")
    gil_switch_interval_s: float = Field(
        0.0005, gt=0, le=0.1, description="sys.setswitchinterval while serving: the writer thread gets the GIL "
                                         "back within this time instead of Python's default 5 ms")
    log_features: bool = Field(
        True, description="store with each decision the offerings it chose among, the features its policy saw and "
                          "the propensity of its choice (what xroute export-ope writes for xroute ope); false keeps "
                          "the log smaller and the decisions cheaper, and allows no exploration")
    keys_file: Path = Field(Path("runs/router/keys.json"), description="hashed API keys (xroute keys)")
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict, description="the tenants this router serves, name -> settings: a key whose tenant is "
                                          "not declared here is refused (403 unknown_tenant), unless "
                                          "undeclared_tenants: allow")
    undeclared_tenants: Literal["reject", "allow"] = Field(
        "reject", description="reject (the default): a key of a tenant missing from 'tenants' gets 403 naming it; "
                              "allow: it routes under the policies that target it (e.g. target tenants ['*']) "
                              "with no tenant settings")

    # routing policies (docs/policies.md) ----------------------------------------------------
    policy_files: list[Path] = Field(
        default_factory=list, description="policy YAML files or directories, applied to the policy store at start "
                                          "when their content changed since they were last applied (policies "
                                          "created through the admin API are kept)")
    policy_poll_s: float = Field(1.0, gt=0, le=60, description="how often the policy store's version is checked; a "
                                                               "new version is compiled and swapped in between two "
                                                               "decisions")
    metrics_public: bool = Field(False, description="serve /metrics without a key (else an admin key)")

    # shared state (router/state/base.py) ---------------------------------------------------------
    state_backend: Literal["embedded", "redis"] = Field(
        "embedded", description="where in-flight work, outcome statistics and idempotency keys live: in this "
                                "process (embedded) or on a Redis/Valkey server every router process and host shares")
    state_url: SecretStr | None = Field(
        None, description="redis://host:port/db (rediss:// for TLS) of that server; a password only through the "
                          "environment (XROUTE_ROUTER_STATE_URL), never shown or logged")
    state_fail_open: bool = Field(
        False, description="while the server cannot be reached, answer from this process's own view (may "
                           "overcommit pools) instead of 503 (fail closed, the default)")
    state_timeout_s: float = Field(0.5, gt=0, le=30, description="a state operation without an answer "
                                                                  "within this long counts as the server down")
    state_prefix: str = Field("xroute", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                              description="namespace of the router's keys on the server")
    state_stats_alpha: float = Field(STATS_ALPHA, gt=0, le=1, description="weight of a new outcome in each "
                                     "pool's exponentially weighted TTFT/duration statistics")
    state_hold_factor: float = Field(
        HOLD_FACTOR, gt=0, le=100, description="a reservation whose feedback never comes is released this many times "
                                               "its expected latency after it was made (and counted as expired)")
    state_hold_floor_s: float = Field(HOLD_FLOOR_S, ge=0, le=86_400, description="... at least this long")
    state_hold_max_s: float = Field(HOLD_MAX_S, gt=0, le=7 * 86_400, description="... at most this long")
    state_view_refresh_s: float = Field(
        0.05, gt=0, le=60, description="how often the shared in-flight work per pool is read for the decisions' "
                                       "features (this process's own work is counted at once)")
    idempotency_ttl_s: float = Field(
        300.0, gt=0, le=7 * 86_400, description="how long a request's Idempotency-Key is remembered (with its "
                                                "answer: mind the memory at high rates)")
    state_restore_window_s: float = Field(
        1.0, ge=0, le=600, description="after the Redis state came back empty, a keyed request whose key it lacks "
                                       "is answered 503 state_restoring (not decided anew) until this long after the "
                                       "new epoch began -- every router notices within state_view_refresh_s and "
                                       "announces its restore -- and until every restore announced has ended")

    # admission, priority and fairness (router/service/admission_queue.py, docs/router.md) -------------
    watchdog: WatchdogSettings = Field(
        default_factory=WatchdogSettings, description="the champion's watchdog: serve greedy when the champion is "
                                                      "confidently worse than greedy on recent traffic")
    admission: AdmissionSettings = Field(
        default_factory=AdmissionSettings, description="admission that predicts: requests no pool can serve within "
                                                       "their TTFT SLO wait by priority and fair share, or are shed")

    # the capacity plan (router/service/capacity.py, docs/capacity.md) ------------------------------------
    capacity: CapacitySettings = Field(
        default_factory=CapacitySettings, description="GET /v1/capacity/plan: the planner and the plan's epoch")

    # prefix affinity and sessions (router/state/base.py, envs/prefix.py) ------------------------------
    prefix_block_tokens: int = Field(512, ge=1, le=1_048_576, description="tokens per block of a request's "
                                     "prefix_hashes (clients hash their prompts with it: GET /v1/offerings says it)")
    prefix_ttl_s: float = Field(600.0, gt=0, le=7 * 86_400, description="the prefix index's age bound: blocks "
                                "sent to a pool longer ago, and a session's last pool, are forgotten")
    prefix_retention_alpha: float = Field(0.05, gt=0, le=1, description="weight of one feedback's cached_tokens in "
                                          "its pool's retention (the share of predicted cached tokens confirmed)")

    # migration off preempted or degraded pools (router/service/migration.py, docs/migration.md) ----------
    migration_mask_s: float = Field(900.0, ge=0, le=7 * 86_400, description="a pool a pool event names is masked "
                                    "for new decisions until this long after the event's deadline (or its receipt)")
    migration_deprioritize_s: float = Field(rules.DEPRIORITIZE_S, ge=0, le=7 * 86_400, description="the region of an interrupted "
                                            "pool is de-prioritized for this long after the notice")
    migration_region_penalty: float = Field(rules.REGION_PENALTY, ge=0, le=1e6, description="what a de-prioritized region's offerings "
                                            "lose from their scores (reward units, like a prefer policy's weight)")
    migration_grace_s: float = Field(30.0, ge=0, le=3600, description="after the deadline, a migration whose snapshot "
                                     "is not verified yet gets this long before its work restarts at the target")
    migration_timeout_s: float = Field(300.0, gt=0, le=86_400, description="a migration off a pool with no deadline "
                                       "(rebalance, degraded) not committed within this long rolls back")
    migration_max_deadline_s: float = Field(6 * 3600.0, gt=0, le=30 * 86_400, description="the furthest ahead of its "
                                            "receipt a pool event's deadline may be (a later one is refused, 422 "
                                            "deadline_too_far): the clouds' notices are minutes, a drain is hours")
    migration_poll_s: float = Field(0.2, gt=0, le=60, description="how often unfinished migrations are driven and "
                                    "the pool events of other routers read")
    webhook_timeout_s: float = Field(5.0, gt=0, le=120, description="a webhook call's whole time limit")
    webhook_backoff_s: float = Field(1.0, gt=0, le=3600, description="the wait before a failed webhook's first retry; "
                                     "doubled after each failure (with jitter) up to webhook_backoff_max_s")
    webhook_backoff_max_s: float = Field(300.0, gt=0, le=86_400, description="the longest wait between two attempts")
    webhook_max_attempts: int = Field(10, ge=1, le=1000, description="attempts before a notice is marked failed "
                                      "(kept in the log, counted in xroute_router_webhooks_total{outcome=\"failed\"})")

    # inference servers' own metrics (router/service/scrape.py) ------------------------------------------
    inference_servers: list[InferenceServer] = Field(
        default_factory=list, description="pools whose inference servers are scraped for their running and waiting "
                                          "requests and KV-cache usage")
    inference_metrics: InferenceMetrics = Field(default_factory=InferenceMetrics,
                                                description="the metric names the servers expose")
    inference_scrape_s: float = Field(1.0, gt=0, le=3600, description="how often the servers are scraped")
    inference_scrape_timeout_s: float = Field(0.5, gt=0, le=60, description="a server slower than this is skipped")
    inference_stale_s: float = Field(5.0, gt=0, le=86_400, description="a pool none of whose servers answered for "
                                                                       "this long reports nothing")
    kv_cache_full: float = Field(0.95, gt=0, le=1, description="a pool whose servers' KV cache is this full has no "
                                                               "free slot, whatever the counts say")

    # the OpenAI-compatible gateway (router/gateway/) ----------------------------------------------
    upstreams: list[Upstream] = Field(
        default_factory=list, description="the pools' inference servers the gateway forwards to (POST "
                                          "/v1/chat/completions, /v1/completions)")
    gateway: GatewaySettings = Field(default_factory=GatewaySettings, description="the gateway's SLO defaults, "
                                     "timeouts, retries and limits")

    # traces (router/core/tracing.py) ---------------------------------------------------------
    tracing: TracingSettings = Field(default_factory=TracingSettings, description="OpenTelemetry spans: enabled, "
                                     "otlp_endpoint, service_name, sample_ratio (docs/observability.md)")

    # HTTP -----------------------------------------------------------------------------------
    max_body_bytes: int = Field(65_536, ge=1024, description="larger request bodies get 413")
    access_log: bool = Field(True, description="one JSON line per request")
    ready_probe_s: float = Field(0.5, gt=0, le=60, description="how often the decision log and the shared state "
                                                             "are probed for /readyz, whatever the traffic")
    log_level: str = "INFO"

    @property
    def log_target(self) -> Path | str:
        """The decision log this router writes: the PostgreSQL URL (``db_url``), else the SQLite
        file (``db_path``) -- what ``router.store.readers`` readers take."""
        return self.db_url.get_secret_value() if self.db_url is not None else self.db_path

    @field_validator("db_url")
    @classmethod
    def _postgres_url(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (postgresql://user@host:port/dbname)")
        return v

    @field_validator("state_url")
    @classmethod
    def _redis_url(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return v

    @model_validator(mode="after")
    def _redis_needs_a_url(self) -> RouterSettings:
        if self.state_backend == "redis" and self.state_url is None:
            raise ValueError("state_url: needed with state_backend: redis (redis://host:port/db)")
        return self

    @model_validator(mode="after")
    def _exploration_is_logged(self) -> RouterSettings:
        if not self.log_features:
            for name, t in self.tenants.items():
                if t.explore_epsilon > 0:
                    raise ValueError(f"tenants.{name}.explore_epsilon: exploration needs log_features: true (an "
                                     "explored decision not logged with its propensity teaches nothing)")
        return self

    @field_validator("telemetry_live")
    @classmethod
    def _live_needs_a_directory(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("telemetry") is None:
            raise ValueError("needs 'telemetry' (--telemetry DIR): the directory xroute telemetry collect --out writes")
        return v

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _FileSource(settings_cls)


class _FileSource(PydanticBaseSettingsSource):
    """The YAML config file's values (read by :func:`load_settings`)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        data = _FILE_DATA.get() or {}
        return data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_DATA.get() or {})


def _config_file(config: Path | str | None) -> Path | None:
    if config is not None:
        return Path(config)
    env = os.environ.get("XROUTE_ROUTER_CONFIG", "").strip()
    if env:
        return Path(env)
    default = CONFIG_DIR / "router.yaml"
    return default if default.is_file() else None


def load_settings(config: Path | str | None = None, **overrides: Any) -> RouterSettings:
    """Settings from the config file, the environment and ``overrides`` (``None`` values ignored)."""
    path = _config_file(config)
    data = read_yaml(path) if path is not None else {}
    unknown = sorted(set(data) - set(RouterSettings.model_fields))
    if unknown:
        raise ConfigError(f"{path}: field '{unknown[0]}': unknown key")
    token = _FILE_DATA.set(data)
    try:
        return RouterSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = str(err["msg"])
        if not err["loc"] and msg.startswith("Value error, ") and ": " in msg:  # a check across fields names its own
            loc, msg = msg.removeprefix("Value error, ").split(": ", 1)
        where = str(path) if path is not None else "router settings"
        raise ConfigError(f"{where} (or XROUTE_ROUTER_* / options): field '{loc}': {msg}") from None
    finally:
        _FILE_DATA.reset(token)
