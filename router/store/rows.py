"""The decision log's rows and tables, as every backend writes and reads them (SQLite:
``router.store.sqlite``; PostgreSQL: ``router.store.postgres``).

A decision is written as one :class:`DecisionRow` (built by ``RoutingEngine.admit``): its fields
are the table's columns, :data:`DECISION_COLUMNS`, in order, and the log turns it into a plain
tuple once, when it queues the row for its group commit (:meth:`DecisionRow.astuple`). A
feedback row is a tuple in :data:`FEEDBACK_COLUMNS`' order. What feedback reads back of a decision
is a :class:`DecisionRef`. The statements here are written once with ``?`` placeholders
(``router.store.dialect``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

from router.core.logs import iso


@dataclass(slots=True)
class DecisionRow:
    """One row of ``decisions``: the request, what was chosen and expected, the policy that chose
    it, and what the shared state, the OPE record and the quotas kept of it."""

    decision_id: str
    tenant: str
    #: wall time of the decision (seconds since the epoch)
    created_at: float
    #: the telemetry time it was made on
    telemetry_ts: float
    origin: str
    input_tokens: int
    max_output_tokens: int
    ttft_ms: float
    tpot_ms: float
    deadline_ms: float | None
    model: str
    session_id: str | None
    offering_id: str
    expected_latency_ms: float
    expected_cost_usd: float
    #: the model slot's name, kind and version, and the hash of the bundle it decided on
    policy: str
    policy_kind: str
    policy_version: str | None
    bundle_hash: str
    #: the shared state's pool key and the end of the reservation's hold (None: no reservation)
    pool: str | None
    hold_until: float | None
    #: ``<tenant>:route:<key>`` of a keyed request
    idempotency_key: str | None
    #: the OPE record (``router.decision.ope_log``): the propensity of the offering served (None:
    #: unknown), the tenant's exploration probability, the packed action set with its features
    propensity: float | None
    epsilon: float | None
    features: bytes | None
    #: what the tenant's quotas reserved (None: no quota applied)
    quota_tokens: int | None
    quota_usd: float | None
    #: the request as received (JSON) and the answer exactly as sent
    request_json: str
    response_json: str
    #: the W3C trace the decision belongs to (32 hex: the caller's ``traceparent`` or the router's own
    #: trace, ``router.core.tracing``; None: neither); set after the row is built
    trace_id: str | None = None
    #: the arm of the canary rollout running that decided it (``stable:<canary id>`` or
    #: ``canary:<canary id>``; None: no canary was running: the stable set decided); set after the row is built
    policy_arm: str | None = None
    #: what greedy would have chosen among the same offerings (``router.decision.watchdog``; None: not
    #: known, e.g. a decision logged before the column existed)
    greedy_offering_id: str | None = None

    def astuple(self) -> tuple[Any, ...]:
        """The row's values in :data:`DECISION_COLUMNS`' order (what a backend inserts)."""
        return _values(self)


#: the columns of ``decisions`` a decision writes, in :class:`DecisionRow`'s order (the one definition)
DECISION_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(DecisionRow))
_values = attrgetter(*DECISION_COLUMNS)

FEEDBACK_COLUMNS = ("decision_id", "tenant", "received_at", "latency_ms", "cost_usd", "output_tokens", "failed",
                    "error", "ttft_ms", "idempotency_key", "reward", "sla_violation", "tpot_ms", "prompt_tokens",
                    "cached_tokens", "request_id", "attempt")

#: the log's tables on either backend (``router.store.dialect.Dialect.ddl``; ``{answer}``: the
#: answer's column type, ``{answer_dictionary}``: SQLite's column naming the dictionary it is
#: compressed against). Columns added since the first release are listed in ``ADDED_COLUMNS`` too,
#: so a log written before gets them at start.
TABLES = """
CREATE TABLE IF NOT EXISTS decisions (
    decision_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at {real} NOT NULL,
    telemetry_ts {real} NOT NULL,
    origin TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    max_output_tokens INTEGER NOT NULL,
    ttft_ms {real} NOT NULL,
    tpot_ms {real} NOT NULL,
    deadline_ms {real},
    model TEXT NOT NULL,
    session_id TEXT,
    offering_id TEXT NOT NULL,
    expected_latency_ms {real} NOT NULL,
    expected_cost_usd {real} NOT NULL,
    policy TEXT NOT NULL,
    policy_kind TEXT NOT NULL,
    policy_version TEXT,
    bundle_hash TEXT NOT NULL,
    pool TEXT,
    hold_until {real},
    idempotency_key TEXT,
    propensity {real},
    epsilon {real},
    features {blob},
    quota_tokens INTEGER,
    quota_usd {real},
    request_json TEXT NOT NULL,
    trace_id TEXT,
    policy_arm TEXT,
    greedy_offering_id TEXT,
    response_json {answer} NOT NULL{answer_dictionary}
);
CREATE INDEX IF NOT EXISTS decisions_tenant_time ON decisions (tenant, created_at);
CREATE TABLE IF NOT EXISTS feedback (
    feedback_id {serial},
    decision_id TEXT NOT NULL REFERENCES decisions(decision_id),
    tenant TEXT NOT NULL,
    received_at {real} NOT NULL,
    latency_ms {real},
    cost_usd {real},
    output_tokens INTEGER,
    failed INTEGER NOT NULL,
    error TEXT,
    ttft_ms {real},
    idempotency_key TEXT,
    reward {real},
    sla_violation INTEGER
);
CREATE INDEX IF NOT EXISTS feedback_decision ON feedback (decision_id);
CREATE TABLE IF NOT EXISTS catalogs (
    catalog_key TEXT PRIMARY KEY,
    offering_ids TEXT NOT NULL
);
"""
#: columns added since the first release, with their SQLite types: a log written before gets them on
#: start (``ALTER TABLE ... ADD COLUMN``; its old rows hold NULL there), in either backend. The
#: decisions' OPE columns (``router.decision.ope_log``): the propensity of the offering served (NULL: unknown),
#: the tenant's exploration probability, the action set with the features its policy saw; the
#: feedback's realized reward (``envs.kernels.realized_reward``; NULL: the feedback did not say
#: enough) and whether the SLO was missed; what the gateway measured itself (``router.gateway``):
#: the time per output token, the prompt tokens the server counted and those it had cached, the
#: gateway request the attempt belonged to (its X-Request-ID: every attempt of one request shares
#: it) and the attempt's number; the tenant quotas' reservation of a decision (tokens, USD; NULL: no
#: quota applied: ``router.decision.quotas.quota_events`` rebuilds the counters from them); the decision's
#: W3C trace id (``router.core.tracing``; NULL: no trace); the canary arm that decided it (NULL: no canary ran);
#: what greedy would have chosen (``router.decision.watchdog``; NULL: not known)
ADDED_COLUMNS = {"decisions": (("pool", "TEXT"), ("hold_until", "REAL"), ("idempotency_key", "TEXT"),
                               ("propensity", "REAL"), ("epsilon", "REAL"), ("features", "BLOB"),
                               ("quota_tokens", "INTEGER"), ("quota_usd", "REAL"), ("trace_id", "TEXT"),
                               ("policy_arm", "TEXT"), ("greedy_offering_id", "TEXT")),
                 "feedback": (("ttft_ms", "REAL"), ("idempotency_key", "TEXT"), ("reward", "REAL"),
                              ("sla_violation", "INTEGER"), ("tpot_ms", "REAL"), ("prompt_tokens", "INTEGER"),
                              ("cached_tokens", "INTEGER"), ("request_id", "TEXT"), ("attempt", "INTEGER"))}

#: indexes on added columns, created after the columns are (``CREATE INDEX IF NOT EXISTS``, either backend): the
#: canary arms' decisions, newest first (partial: the decisions made with no canary running are not in it)
ADDED_INDEXES = ("CREATE INDEX IF NOT EXISTS decisions_policy_arm ON decisions (policy_arm, created_at) "
                 "WHERE policy_arm IS NOT NULL",)

#: a canary arm's decisions (the latest ``?`` of them, by the index above) with their latest feedback, aggregated:
#: count, expected cost, decisions with feedback, feedback with an SLO verdict and those that met it, observed cost
#: (sum, count), failed attempts (``router.service.canary``)
ARM_SQL = ("SELECT COUNT(*), SUM(d.expected_cost_usd), COUNT(f.feedback_id), COUNT(f.sla_violation), "
           "SUM(CASE WHEN f.sla_violation = 0 THEN 1 ELSE 0 END), SUM(f.cost_usd), COUNT(f.cost_usd), "
           "SUM(CASE WHEN f.failed <> 0 THEN 1 ELSE 0 END), MIN(d.created_at), MAX(d.created_at) "
           "FROM (SELECT decision_id, expected_cost_usd, created_at FROM decisions WHERE policy_arm = ? "
           "ORDER BY created_at DESC LIMIT ?) d LEFT JOIN feedback f ON f.feedback_id = "
           "(SELECT MAX(feedback_id) FROM feedback WHERE decision_id = d.decision_id)")

#: a stored decision's answer and request (``{z}``: SQLite's dictionary column), by id, and by id and tenant
GET_DECISION_SQL = "SELECT response_json, request_json{z} FROM decisions WHERE decision_id = ?"
GET_TENANT_DECISION_SQL = GET_DECISION_SQL + " AND tenant = ?"
OWNER_SQL = "SELECT tenant FROM decisions WHERE decision_id = ?"
#: what ``GET /v1/decisions/{id}`` shows of each feedback row (:func:`decision_record`)
RECORD_FEEDBACK_SQL = ("SELECT feedback_id, received_at, latency_ms, cost_usd, output_tokens, failed, error, ttft_ms, "
                       "tpot_ms, prompt_tokens, cached_tokens, request_id, attempt "
                       "FROM feedback WHERE decision_id = ? ORDER BY feedback_id")
#: the columns ``GroupCommitLog.lookup`` reads (and how a backend builds its answer: :func:`decision_ref`)
LOOKUP_SQL = ("SELECT d.tenant, d.model, d.offering_id, d.pool, (SELECT COUNT(*) FROM feedback f WHERE "
              "f.decision_id = d.decision_id), d.input_tokens, d.max_output_tokens, d.ttft_ms, d.tpot_ms, "
              "d.deadline_ms, d.expected_cost_usd, d.quota_tokens, d.quota_usd, d.policy_kind, d.policy_version, "
              "d.propensity, d.features, d.greedy_offering_id FROM decisions d WHERE d.decision_id = ?")
#: how a backend keeps a catalog (``GroupCommitLog.register_catalog``)
REGISTER_CATALOG_SQL = "INSERT INTO catalogs (catalog_key, offering_ids) VALUES (?, ?) ON CONFLICT DO NOTHING"
CATALOGS_SQL = "SELECT catalog_key, offering_ids FROM catalogs"
#: the keyed decisions and feedback since a time (``GroupCommitLog.keyed_since``; ``{z}``: SQLite's
#: dictionary column); decision ids are time-sorted, so the id bound (``router.core.logs.id_floor``)
#: finds them by the primary key
KEYED_DECISIONS_SQL = ("SELECT idempotency_key, request_json, response_json{z}, created_at FROM decisions "
                       "WHERE decision_id >= ? AND created_at >= ? AND idempotency_key IS NOT NULL")
KEYED_FEEDBACK_COLUMNS = ("idempotency_key, feedback_id, decision_id, received_at, latency_ms, ttft_ms, cost_usd, "
                          "output_tokens, failed, error")
KEYED_FEEDBACK_SQL = (f"SELECT {KEYED_FEEDBACK_COLUMNS} FROM feedback "
                      "WHERE received_at >= ? AND idempotency_key IS NOT NULL")


@dataclass(frozen=True, slots=True)
class DecisionRef:
    """A stored decision as feedback needs it: its tenant, model, pool (``router.state.base``'s key:
    the row's ``pool``, or the model and offering for rows written before it existed), how many
    feedback rows it has, and what the reward of its outcome needs of the request (its tokens and
    objectives) and of the decision (its expected cost)."""

    tenant: str
    model: str
    pool: str
    feedback: int
    input_tokens: int = 0
    max_output_tokens: int = 0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    deadline_ms: float | None = None
    expected_cost_usd: float = 0.0
    #: what the tenant's quotas reserved for it (None: no quota applied)
    quota_tokens: int | None = None
    quota_usd: float | None = None
    #: what the watchdog needs (``router.decision.watchdog``): the policy that decided, the propensity
    #: of what it served, its OPE record, greedy's choice
    policy_kind: str = ""
    policy_version: str | None = None
    propensity: float | None = None
    features: bytes | None = None
    greedy_offering_id: str | None = None


def decision_ref(row: tuple[Any, ...] | None) -> DecisionRef | None:
    """A :data:`LOOKUP_SQL` row as a :class:`DecisionRef` (None for none)."""
    if row is None:
        return None
    (tenant, model, offering_id, pool, n, n_in, max_out, ttft, tpot, deadline, cost, q_tok, q_usd, kind, version,
     propensity, features, greedy) = row
    from router.state.base import pool_key

    return DecisionRef(str(tenant), str(model), str(pool) if pool else pool_key(str(model), str(offering_id)), int(n),
                       int(n_in), int(max_out), float(ttft), float(tpot), None if deadline is None else float(deadline),
                       float(cost), None if q_tok is None else int(q_tok), None if q_usd is None else float(q_usd),
                       str(kind), None if version is None else str(version),
                       None if propensity is None else float(propensity), None if features is None else bytes(features),
                       None if greedy is None else str(greedy))


def decision_record(response: dict[str, Any], request_json: str, feedback: list[tuple[Any, ...]]) -> dict[str, Any]:
    """What ``get_decision`` returns, from the stored answer, the stored request and the feedback
    rows (``RECORD_FEEDBACK_SQL``'s columns)."""
    response["request"] = json.loads(request_json)
    response["feedback"] = [
        {"feedback_id": r[0], "received_at": iso(r[1]), "latency_ms": r[2], "cost_usd": r[3],
         "output_tokens": r[4], "failed": bool(r[5]), "error": r[6], "ttft_ms": r[7], "tpot_ms": r[8],
         "prompt_tokens": r[9], "cached_tokens": r[10], "request_id": r[11], "attempt": r[12]} for r in feedback]
    return response


def export_columns(by_tenant: bool, ope: bool = False, since: bool = False, until: bool = False
                   ) -> tuple[str, list[str]]:
    """The export's query (every decision with its latest feedback, oldest first; ``?``
    placeholders) and the names of its columns. ``ope``: also each decision's OPE record
    (``features``) and its feedback's TTFT, reward and SLO verdict. Parameters, in this order, for
    those given: the tenant, the earliest and the latest-excluded ``created_at``
    (:func:`export_params`)."""
    skip = {"response_json"} if ope else {"response_json", "features"}
    dcols = [c for c in DECISION_COLUMNS if c not in skip]
    fcols = ["latency_ms", "cost_usd", "output_tokens", "failed", "error", "received_at"]
    names = ["observed_latency_ms", "observed_cost_usd", "observed_output_tokens", "failed", "error", "feedback_at"]
    if ope:
        fcols += ["ttft_ms", "reward", "sla_violation"]
        names += ["observed_ttft_ms", "reward", "sla_violation"]
    sql = (f"SELECT {', '.join('d.' + c for c in dcols)}, {', '.join('f.' + c for c in fcols)} "
           "FROM decisions d LEFT JOIN feedback f ON f.feedback_id = "
           "(SELECT MAX(feedback_id) FROM feedback WHERE decision_id = d.decision_id)")
    where = [w for w, on in (("d.tenant = ?", by_tenant), ("d.created_at >= ?", since),
                             ("d.created_at < ?", until)) if on]
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY d.created_at, d.decision_id"
    return sql, dcols + names


def export_params(tenant: str | None, since: float | None, until: float | None) -> tuple[Any, ...]:
    """:func:`export_columns`' parameters."""
    return tuple(v for v in (tenant, since, until) if v is not None)
