"""The logged decision — what off-policy evaluation (``xroute ope``) reads. Defined here only.

A log is a file of decisions, each with everything needed to re-decide it under another policy
and to weigh its observed reward: the action set the router chose among (offering ids, in the
order it scored them), the observation of that set (one feature row per offering, the request
vector), the chosen index, the propensity of that choice under the logging policy, and the
realized reward computed when the feedback arrived (with the raw feedback beside it). See
``docs/ope.md``.

Two encodings of the same fields, chosen by the file name:

* ``*.jsonl`` / ``*.jsonl.gz``: line 1 is the :class:`LogHeader`, every further line one
  :class:`LoggedDecision` (what a router appends as feedback arrives);
* ``*.parquet``: one row per decision, the header as JSON in the schema metadata key
  ``xroute_ope_header`` (columnar, read without a Python object per decision).

:func:`read_log` returns a :class:`DecisionLog` (numpy arrays, the action sets concatenated);
decisions whose reward is still null (no feedback yet) are left out and counted as ``pending``.
Every bad value is one :class:`LogError` line naming the record and the field. The feature names
the rows follow are in the header; ``models.ope`` checks them against ``envs.features``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from xroute.errors import XrouteError

FORMAT = "xroute-ope-log/1"
PARQUET_HEADER_KEY = b"xroute_ope_header"
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")

Text = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class LogError(XrouteError):
    """A decision log that cannot be read: one line naming the file, the record and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RewardWeights(_Strict):
    """The reward the log's ``reward`` values were computed with (``envs.kernels.realized_reward``
    arguments, and the retry overhead its one-step expectation uses)."""

    cost_weight: float = Field(ge=0)
    latency_weight: float = Field(ge=0)
    sla_penalty: float = Field(ge=0)
    cost_norm_cap: float = Field(gt=0)
    latency_norm_cap: float = Field(gt=0)
    failure_latency_norm: float = Field(ge=0)
    retry_overhead_ms: float = Field(ge=0)


class LogHeader(_Strict):
    """What every decision of a file shares."""

    format: Literal["xroute-ope-log/1"] = "xroute-ope-log/1"
    offering_features: list[str] = Field(description="names of the columns of each offering row, in order")
    request_features: list[str] = Field(description="names of the request vector's entries, in order")
    reward: RewardWeights | None = Field(None, description="the reward definition; absent: the evaluate config's")
    source: str = Field("", description="who wrote the log, e.g. 'router <host>' or 'simulate <bundle> eps=0.1'")


class Feedback(_Strict):
    """What really happened to the request (``POST /v1/feedback``), kept beside the reward."""

    cost_usd: float | None = Field(None, ge=0)
    latency_ms: float | None = Field(None, ge=0)
    ttft_ms: float | None = Field(None, ge=0)
    output_tokens: int | None = Field(None, ge=0)
    sla_violation: bool | None = None
    failed: bool = False
    error: str | None = Field(None, max_length=1000, description="the client's error text, as POST /v1/feedback")


class LoggedDecision(_Strict):
    """One routing decision."""

    decision_id: Text
    tenant: str = Field(max_length=256)
    ts: str | None = Field(None, description="decision time, ISO-8601 UTC")
    action_set: list[Text] = Field(min_length=1, description="offering ids the router chose among, in order")
    offering_features: list[list[float]] = Field(description="one row per action_set entry (header's names)")
    request_features: list[float] = Field(description="the request vector (header's names)")
    chosen: int = Field(ge=0, description="index of the chosen offering in action_set")
    propensity: float = Field(gt=0, le=1, description="P(chosen | observation) under the logging policy")
    policy: Text = Field(description="the logging policy's name")
    policy_version: str | None = None
    epsilon: float | None = Field(None, ge=0, le=1, description="the exploration probability in force")
    reward: float | None = Field(None, description="realized reward from the feedback; null = no feedback yet")
    feedback: Feedback | None = None


@dataclass
class DecisionLog:
    """The decisions with a reward, as arrays. Decision ``i``'s action set is the flat entries
    ``offsets[i]:offsets[i+1]`` of ``action_ids`` and ``rows``."""

    header: LogHeader
    decision_id: np.ndarray  #: (n,) str
    tenant: np.ndarray  #: (n,) str
    offsets: np.ndarray  #: (n+1,) int64
    action_ids: np.ndarray  #: (T,) str
    rows: np.ndarray  #: (T, F) float32
    request: np.ndarray  #: (n, R) float32
    chosen: np.ndarray  #: (n,) int64, index within the set
    propensity: np.ndarray  #: (n,) float64
    reward: np.ndarray  #: (n,) float64
    policy: np.ndarray  #: (n,) str: 'name' or 'name@version'
    pending: int = 0
    path: str = ""

    @property
    def n(self) -> int:
        return int(self.chosen.shape[0])

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def chosen_flat(self) -> np.ndarray:
        """The chosen entries as indices into the flat arrays."""
        return self.offsets[:-1] + self.chosen

    @classmethod
    def from_records(cls, header: LogHeader, records: list[LoggedDecision], path: str = "") -> DecisionLog:
        """Arrays from validated records; those without a reward are counted as ``pending``."""
        done = [r for r in records if r.reward is not None]
        return cls._from_columns(header, {
            "decision_id": [r.decision_id for r in done], "tenant": [r.tenant for r in done],
            "action_set": [r.action_set for r in done],
            "offering_features": [r.offering_features for r in done],
            "request_features": [r.request_features for r in done], "chosen": [r.chosen for r in done],
            "propensity": [r.propensity for r in done], "reward": [r.reward for r in done],
            "policy": [_policy_label(r.policy, r.policy_version) for r in done]}, len(records) - len(done), path)

    @classmethod
    def _from_columns(cls, header: LogHeader, c: dict[str, list[Any]], pending: int, path: str) -> DecisionLog:
        n = len(c["chosen"])
        sizes = np.array([len(a) for a in c["action_set"]], dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        _check_row_counts(path, c["decision_id"], sizes, [len(r) for r in c["offering_features"]])
        width = len(header.offering_features)
        flat_rows = [row for rows in c["offering_features"] for row in rows]
        bad = next((k for k, row in enumerate(flat_rows) if len(row) != width), None)
        if bad is not None:
            i = int(np.searchsorted(offsets, bad, side="right") - 1)
            raise LogError(f"{_where(path, i, c['decision_id'][i])}: field 'offering_features[{bad - offsets[i]}]': "
                           f"{len(flat_rows[bad])} values, the header names {width}")
        rows = np.array(flat_rows, dtype=np.float32).reshape(-1, width)
        req = [np.asarray(r, dtype=np.float32) for r in c["request_features"]]
        log = cls(header=header, decision_id=np.array(c["decision_id"], dtype=object),
                  tenant=np.array(c["tenant"], dtype=object), offsets=offsets,
                  action_ids=np.array([a for s in c["action_set"] for a in s], dtype=object), rows=rows,
                  request=_stack(path, c["decision_id"], req, len(header.request_features)),
                  chosen=np.asarray(c["chosen"], dtype=np.int64), propensity=np.asarray(c["propensity"], dtype=float),
                  reward=np.asarray(c["reward"], dtype=float), policy=np.array(c["policy"], dtype=object),
                  pending=pending, path=path)
        log.check()
        return log

    def check(self) -> None:
        """The rules a decision must satisfy beyond its types (one :class:`LogError` on the first
        record that breaks one)."""
        ids = self.decision_id
        checks: list[tuple[np.ndarray, str, str]] = [
            (self.chosen >= self.sizes, "chosen", "is past the end of action_set"),
            (self.chosen < 0, "chosen", "must be >= 0"),
            (~((self.propensity > 0) & (self.propensity <= 1)), "propensity", "must be in (0, 1]"),
            (~np.isfinite(self.reward), "reward", "must be a finite number"),
            (~np.isfinite(self.request).all(axis=1), "request_features", "must be finite numbers"),
        ]
        if self.rows.shape[0]:
            bad_row = ~np.isfinite(self.rows).all(axis=1)
            owner = np.repeat(np.arange(self.n), self.sizes)
            checks.append((np.bincount(owner[bad_row], minlength=self.n) > 0, "offering_features",
                           "must be finite numbers"))
        for bad, field, problem in checks:
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                value = {"chosen": self.chosen, "propensity": self.propensity, "reward": self.reward}.get(field)
                got = f", got {value[i]}" if value is not None else ""
                raise LogError(f"{_where(self.path, i, ids[i])}: field '{field}': {problem}{got}")
        _, first, counts = np.unique(ids.astype(str), return_index=True, return_counts=True)
        if (counts > 1).any():
            dup = ids[first[counts > 1][0]]
            i = int(np.flatnonzero(ids == dup)[1])
            raise LogError(f"{_where(self.path, i, dup)}: field 'decision_id': repeats an earlier record")


def _policy_label(name: str, version: str | None) -> str:
    return f"{name}@{version}" if version else name


def _where(path: str, i: int, decision_id: Any) -> str:
    """How an error names a record: 1-based among the decisions with a reward, and its id."""
    return f"{path or 'log'}: decision {i + 1} ('{decision_id}')"


def _check_row_counts(path: str, ids: list[str], sizes: np.ndarray, n_rows: list[int]) -> None:
    bad = np.flatnonzero(sizes != np.asarray(n_rows, dtype=np.int64))
    if bad.size:
        i = int(bad[0])
        raise LogError(f"{_where(path, i, ids[i])}: field 'offering_features': {n_rows[i]} rows for "
                       f"{sizes[i]} action_set entries")


def _stack(path: str, ids: list[str], vectors: list[np.ndarray], width: int) -> np.ndarray:
    for i, v in enumerate(vectors):
        if v.shape != (width,):
            raise LogError(f"{_where(path, i, ids[i])}: field 'request_features': {v.size} values, the header "
                           f"names {width}")
    return np.stack(vectors) if vectors else np.zeros((0, width), dtype=np.float32)


# ------------------------------------------------------------------------------------- files
def _kind(path: Path) -> str:
    name = path.name
    for s in SUFFIXES:
        if name.endswith(s):
            return s
    raise LogError(f"{path}: a decision log is named *.jsonl, *.jsonl.gz or *.parquet")


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


def _pydantic_line(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(record)"
    return f"field '{loc}': {err['msg']}"


def write_log(path: str | Path, header: LogHeader, records: Iterable[LoggedDecision]) -> Path:
    """Write ``records`` under ``header`` (the encoding follows the suffix); returns the path."""
    p = Path(path)
    kind = _kind(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    if kind == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [r.model_dump(mode="json") for r in records]
        table = pa.Table.from_pylist(rows, schema=_arrow_schema()) if rows else _arrow_schema().empty_table()
        table = table.replace_schema_metadata({PARQUET_HEADER_KEY: header.model_dump_json().encode()})
        pq.write_table(table, p)
        return p
    with _open_text(p, "w") as f:
        f.write(header.model_dump_json() + "\n")
        for r in records:
            f.write(r.model_dump_json() + "\n")
    return p


def _arrow_schema() -> Any:
    import pyarrow as pa

    fb = pa.struct([("cost_usd", pa.float64()), ("latency_ms", pa.float64()), ("ttft_ms", pa.float64()),
                    ("output_tokens", pa.int64()), ("sla_violation", pa.bool_()), ("failed", pa.bool_()),
                    ("error", pa.string())])
    return pa.schema([
        ("decision_id", pa.string()), ("tenant", pa.string()), ("ts", pa.string()),
        ("action_set", pa.list_(pa.string())), ("offering_features", pa.list_(pa.list_(pa.float32()))),
        ("request_features", pa.list_(pa.float32())), ("chosen", pa.int64()), ("propensity", pa.float64()),
        ("policy", pa.string()), ("policy_version", pa.string()), ("epsilon", pa.float64()),
        ("reward", pa.float64()), ("feedback", fb)])


def read_log(path: str | Path) -> DecisionLog:
    """The decisions of a log file with their rewards (see the module docstring)."""
    p = Path(path)
    kind = _kind(p)
    if not p.is_file():
        raise LogError(f"{p}: no such file")
    return _read_parquet(p) if kind == ".parquet" else _read_jsonl(p)


def _header(p: Path, where: str, raw: Any) -> LogHeader:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise LogError(f"{p}: {where}: field 'format': expected the header '{FORMAT}', got '{got}'")
    try:
        return LogHeader.model_validate(raw)
    except ValidationError as e:
        raise LogError(f"{p}: {where}: {_pydantic_line(e)}") from None


def _read_jsonl(p: Path) -> DecisionLog:
    records: list[LoggedDecision] = []
    pending = 0
    header: LogHeader | None = None
    try:
        with _open_text(p, "r") as f:
            for k, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as e:
                    raise LogError(f"{p}: line {k}: not JSON ({e.msg} at column {e.colno})") from None
                if header is None:
                    header = _header(p, f"line {k}", raw)
                    continue
                try:
                    rec = LoggedDecision.model_validate(raw)
                except ValidationError as e:
                    rid = raw.get("decision_id") if isinstance(raw, dict) else None
                    raise LogError(f"{p}: line {k}" + (f" ('{rid}')" if rid else "") + f": {_pydantic_line(e)}"
                                   ) from None
                if rec.reward is None:
                    pending += 1
                else:
                    records.append(rec)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise LogError(f"{p}: cannot read: {e}") from None
    if header is None:
        raise LogError(f"{p}: empty: line 1 must be the header {{\"format\": \"{FORMAT}\", ...}}")
    log = DecisionLog.from_records(header, records, path=str(p))
    log.pending += pending
    return log


_REQUIRED = ("decision_id", "tenant", "action_set", "offering_features", "request_features", "chosen", "propensity",
             "policy", "reward")


def _read_parquet(p: Path) -> DecisionLog:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except (OSError, pa.ArrowException) as e:
        raise LogError(f"{p}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    meta = table.schema.metadata or {}
    if PARQUET_HEADER_KEY not in meta:
        raise LogError(f"{p}: field 'format': no '{PARQUET_HEADER_KEY.decode()}' header in the schema metadata")
    try:
        raw = json.loads(meta[PARQUET_HEADER_KEY])
    except json.JSONDecodeError as e:
        raise LogError(f"{p}: header: not JSON ({e.msg})") from None
    header = _header(p, "header", raw)
    missing = [c for c in _REQUIRED if c not in table.column_names]
    if missing:
        raise LogError(f"{p}: field '{missing[0]}': column missing")
    for f in _arrow_schema():
        if f.name in table.column_names and f.name != "feedback" and table.schema.field(f.name).type != f.type:
            try:
                table = table.set_column(table.column_names.index(f.name), f.name, table.column(f.name).cast(f.type))
            except (pa.ArrowException, ValueError):
                raise LogError(f"{p}: field '{f.name}': a column of {table.schema.field(f.name).type}, expected "
                               f"{f.type}") from None
    ids = table.column("decision_id").to_pylist()
    for c in _REQUIRED:
        col = table.column(c)
        if c != "reward" and col.null_count:
            i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise LogError(f"{_where(str(p), i, ids[i])}: field '{c}': missing")
    has = table.column("reward").is_valid().to_numpy(zero_copy_only=False)
    pending = int((~has).sum())
    table = table.filter(pa.array(has))
    ids = table.column("decision_id").to_pylist()
    try:
        sets = table.column("action_set").combine_chunks()
        feats = table.column("offering_features").combine_chunks()
        reqs = table.column("request_features").combine_chunks()
        sizes = pc.list_value_length(sets).to_numpy(zero_copy_only=False).astype(np.int64)
        n_rows = pc.list_value_length(feats).to_numpy(zero_copy_only=False).astype(np.int64)
        _check_row_counts(str(p), ids, sizes, list(n_rows))
        inner = feats.flatten()
        widths = pc.list_value_length(inner).to_numpy(zero_copy_only=False)
        width = len(header.offering_features)
        if (widths != width).any():
            j = int(np.flatnonzero(widths != width)[0])
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            i = int(np.searchsorted(offsets, j, side="right") - 1)
            raise LogError(f"{_where(str(p), i, ids[i])}: field 'offering_features[{j - offsets[i]}]': "
                           f"{widths[j]} values, the header names {width}")
        rows = inner.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, width)
        rw = pc.list_value_length(reqs).to_numpy(zero_copy_only=False)
        rwidth = len(header.request_features)
        if (rw != rwidth).any():
            i = int(np.flatnonzero(rw != rwidth)[0])
            raise LogError(f"{_where(str(p), i, ids[i])}: field 'request_features': {rw[i]} values, the header "
                           f"names {rwidth}")
        request = reqs.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, rwidth)
        versions = (table.column("policy_version").to_pylist() if "policy_version" in table.column_names
                    else [None] * len(ids))
        log = DecisionLog(
            header=header, decision_id=np.array(ids, dtype=object),
            tenant=np.array(table.column("tenant").to_pylist(), dtype=object),
            offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            action_ids=np.array(sets.flatten().to_pylist(), dtype=object), rows=rows, request=request,
            chosen=table.column("chosen").to_numpy().astype(np.int64),
            propensity=table.column("propensity").to_numpy().astype(float),
            reward=table.column("reward").to_numpy().astype(float),
            policy=np.array([_policy_label(a, b) for a, b in zip(table.column("policy").to_pylist(), versions)],
                            dtype=object),
            pending=pending, path=str(p))
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise LogError(f"{p}: a column has the wrong type ({str(e).splitlines()[0]}); see xroute/schema/ope.py"
                       ) from None
    log.check()
    return log
