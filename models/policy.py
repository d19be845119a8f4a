"""The learned router at decision time: numpy and numba only (no torch, no stable-baselines3).

A trained Q-network is exported as two files in one directory (:func:`save_router`):

``router.npz``
    the weights: ``ctx_w``/``ctx_b`` (context encoder, absent when ``context_dim`` is 0) and
    ``mlp_{k}_w``/``mlp_{k}_b`` for each layer of the scorer, ``w`` shaped (in, out).
``router.json``
    ``format``, the feature names the weights expect (checked against ``envs.features`` on load),
    the layer sizes, and provenance (bundle hash, trial config, validation metrics).

Scoring one request (identical to ``models.qnet.SharedScorer``): every offering row ``x_i`` is the
concatenation of its features and the request features; ``c = mean_{i valid} relu(W_c x_i + b_c)``
summarizes the valid alternatives; ``score_i = MLP([x_i, c])`` (ReLU hidden layers, linear output).
With a reward prior (``router.json`` key ``prior``), ``score_i`` is additionally offset by
:meth:`RewardPrior.scores`: ``envs.kernels.expected_reward`` (greedy's score) computed from the
row's features with the reward weights of the environment it was trained in: the network learns a
correction to it, not the whole value.

The action is the argmax over valid offerings, so the router is indifferent to the order of the
offerings and scores any catalog size. The routing policies' prefer weights (``info["policy_bias"]``
in the environment, ``envs.policies``) are added to the scores before the argmax, as to every
baseline's; their masks are the action mask's.

This module is the inference path a registered model carries (``models.pyfunc.INFERENCE_MODULES``):
it imports ``envs.features``, ``envs.kernels`` and ``xroute.errors`` of ours, and numpy and numba.
Fetching a model from a URI is ``models.loader``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from envs import kernels as env_kernels
from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES, OFFERING_FEATURES, REQUEST_FEATURES, F, R
from xroute.errors import ConfigError

FORMAT = "xroute-router/1"
WEIGHTS_FILE = "router.npz"
META_FILE = "router.json"


@dataclass(frozen=True)
class RewardPrior:
    """The one-step expected reward (``envs.kernels.expected_reward``, the same function greedy
    ranks by) computed from a row's features: ``exp_cost``, ``exp_latency``, ``exp_violation``,
    ``preempt_risk``, and the retry overhead over the request's latency budget (``budget``
    request feature). The features are clipped where the reward caps them, so this is greedy's
    score up to float32 rounding."""

    cost_weight: float
    latency_weight: float
    sla_penalty: float
    cost_norm_cap: float
    latency_norm_cap: float
    retry_overhead_ms: float

    @classmethod
    def from_env_config(cls, env_cfg: Any) -> RewardPrior:
        rw = env_cfg.reward
        return cls(float(rw.cost_weight), float(rw.latency_weight), float(rw.sla_penalty), float(rw.cost_norm_cap),
                   float(rw.latency_norm_cap), float(env_cfg.retry_overhead_ms))

    def scores(self, rows: np.ndarray, request: np.ndarray) -> np.ndarray:
        """(B, N, F) rows and (B, R) requests -> (B, N) prior scores (float32)."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        request = np.ascontiguousarray(request, dtype=np.float32)
        out = np.empty(rows.shape[:2], dtype=np.float32)
        for b in range(rows.shape[0]):
            out[b] = _prior_one(rows[b], request[b], *self.one_args)
        return out

    @cached_property
    def one_args(self) -> tuple[Any, ...]:
        """:func:`_prior_one`'s arguments after the rows and the request: the feature columns and
        the constants."""
        return (F["exp_cost"], F["exp_latency"], F["exp_violation"], F["preempt_risk"], R["budget"],
                float(self.cost_weight), float(self.latency_weight), float(self.sla_penalty), float(self.cost_norm_cap),
                float(self.latency_norm_cap), float(self.retry_overhead_ms))


def budget_from_feature(x: float) -> float:
    """The latency budget (ms) back from its request feature (``ln(1 + ms) / 12``), at least 1."""
    return max(float(np.expm1(np.float64(x) * 12.0)), 1.0)


@njit(cache=True)
def _mlp_one(rows, request, w0r, w0q, w0c, b0, wcr, wcq, bc, ws, bs, has_ctx):  # pragma: no cover
    """``RouterWeights.scores_one`` without the prior, in one compiled call: the matrix products
    go to BLAS (numba's ``np.dot``), everything between them is fused loops. Same float32
    operations in the same order as the numpy formulation (``RouterWeights.scores``)."""
    k = rows.shape[0]
    bias = np.dot(request, w0q)
    for j in range(bias.shape[0]):
        bias[j] += b0[j]
    if has_ctx:
        e = np.dot(rows, wcr)
        cb = np.dot(request, wcq)
        nc = e.shape[1]
        for j in range(nc):
            cb[j] += bc[j]
        c = np.zeros(nc, dtype=np.float32)
        for i in range(k):
            for j in range(nc):
                v = e[i, j] + cb[j]
                if not v <= 0:  # relu, NaN kept (as np.maximum)
                    c[j] += v
        div = np.float32(max(k, 1))
        for j in range(nc):
            c[j] /= div
        cw = np.dot(c, w0c)
        for j in range(bias.shape[0]):
            bias[j] += cw[j]
    h = np.dot(rows, w0r)
    nrest = len(ws)
    hid = h.shape[1]
    for i in range(k):
        for j in range(hid):
            v = h[i, j] + bias[j]
            h[i, j] = v if (nrest == 0 or not v <= 0) else np.float32(0.0)
    for layer in range(nrest):
        h = np.dot(h, ws[layer])
        b = bs[layer]
        relu = layer < nrest - 1
        for i in range(k):
            for j in range(h.shape[1]):
                v = h[i, j] + b[j]
                h[i, j] = v if (not relu or not v <= 0) else np.float32(0.0)
    return h[:, 0].copy()


def _against(digest: str) -> tuple[Any, ...]:
    """The kernels that compile ``envs.kernels.expected_reward`` into themselves, cached on disk as
    closures over ``digest`` (``envs.kernels.DIGEST``): numba's cache key hashes a closure's
    variables, so an edit of the environment's kernels is a new cache entry here, not a stale load
    (``router/decision/kernels.py`` says more). They call each other by their names in this module."""

    @njit(cache=True)
    def prior_one(rows, request, ic, il, iv, ir, ib, cw, lw, sp, ccap, lcap, retry_ms):  # pragma: no cover
        """:meth:`RewardPrior.scores` of one request: the budget back from its feature, then
        ``envs.kernels.expected_reward`` row by row (float64, returned as float32)."""
        digest  # noqa: B018 (a closure variable, which numba's cache key hashes: router/decision/kernels.py)
        budget = np.expm1(np.float64(request[ib]) * 12.0)
        if budget < 1.0:
            budget = 1.0
        retry_n = retry_ms / budget
        n = rows.shape[0]
        out = np.empty(n, dtype=np.float32)
        for i in range(n):
            out[i] = env_kernels.expected_reward(np.float64(rows[i, ic]), np.float64(rows[i, il]), np.float64(rows[i, iv]),
                                                 np.float64(rows[i, ir]), retry_n, cw, lw, sp, ccap, lcap)
        return out

    @njit(cache=True)
    def mlp_prior_one(rows, request, w0r, w0q, w0c, b0, wcr, wcq, bc, ws, bs, has_ctx, ic, il, iv, ir, ib, cw, lw, sp,
                       ccap, lcap, retry_ms):  # pragma: no cover
        """:func:`_mlp_one` plus :func:`_prior_one` in one compiled call (float32 sums, as numpy's
        ``s += prior``)."""
        digest  # noqa: B018 (a closure variable, which numba's cache key hashes: router/decision/kernels.py)
        s = _mlp_one(rows, request, w0r, w0q, w0c, b0, wcr, wcq, bc, ws, bs, has_ctx)
        p = _prior_one(rows, request, ic, il, iv, ir, ib, cw, lw, sp, ccap, lcap, retry_ms)
        for i in range(s.shape[0]):
            s[i] += p[i]
        return s

    return prior_one, mlp_prior_one


_prior_one, _mlp_prior_one = _against(env_kernels.DIGEST)


@dataclass
class RouterWeights:
    """The exported scorer: numpy arrays plus the meta that says how to use them."""

    layers: list[tuple[np.ndarray, np.ndarray]]
    ctx: tuple[np.ndarray, np.ndarray] | None = None
    prior: RewardPrior | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    #: the departure margin tau (:func:`departs`, ``router.json`` key ``margin``): the policy leaves
    #: greedy's choice only where the network's score of its own choice exceeds its score of greedy's
    #: by more than this; +inf is greedy, -inf the network's argmax (calibrated on the selection
    #: windows at training: ``models.callbacks.calibrate_margin``)
    margin: float = 0.0
    #: the affinity guard (``router.json`` key ``affinity_guard``, ``net.affinity_guard``): a request
    #: that carries KV-prefix blocks or a session is greedy's (:func:`choose`'s ``hold``). Why: what a
    #: placement of such a request is worth depends on the requests that reuse its prefix or session
    #: later, thousands of requests on (the oracle's segments: docs/results.md), while the scorer's
    #: labels look ``warm_start.horizon`` requests ahead -- so there the router cannot be sure of a
    #: departure's worth, and "never worse where unsure" keeps greedy's choice
    affinity_guard: bool = False

    def scores(self, rows: np.ndarray, request: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Scores of a batch: ``rows`` (B, N, F), ``request`` (B, R), ``mask`` (B, N) -> (B, N).
        Masked rows get ``-inf`` (rows of a request with no valid offering keep their raw score)."""
        rows = np.asarray(rows, dtype=np.float32)
        request = np.asarray(request, dtype=np.float32)
        valid = np.asarray(mask) > 0.5
        b, n, _ = rows.shape
        x = np.concatenate([rows, np.broadcast_to(request[:, None, :], (b, n, request.shape[1]))], axis=2)
        if self.ctx is not None:
            w, bias = self.ctx
            e = np.maximum(x @ w + bias, 0.0)
            wts = valid.astype(np.float32)[..., None]
            c = (e * wts).sum(axis=1) / np.maximum(wts.sum(axis=1), 1.0)
            x = np.concatenate([x, np.broadcast_to(c[:, None, :], (b, n, c.shape[1]))], axis=2)
        h = x
        for k, (w, bias) in enumerate(self.layers):
            h = h @ w + bias
            if k < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        s = h[..., 0]
        if self.prior is not None:
            s = s + self.prior.scores(rows, request)
        keep = valid | ~valid.any(axis=1, keepdims=True)
        return np.where(keep, s, -np.inf)

    def scores_one(self, rows: np.ndarray, request: np.ndarray) -> np.ndarray:
        """Scores of one request whose ``rows`` (k, F) are all valid — ``scores(rows[None],
        request[None], ones((1, k)))[0]`` up to float32 rounding (tested: same argmax, 1e-5 close),
        computed the router's way: the first layers' weights are split into their row, request and
        context blocks, so the per-request parts are one small vector-matrix product instead of being
        copied into every row (~2x fewer multiplies, no concatenations), and the whole network runs
        in one compiled call with the prior (:func:`_mlp_prior_one`)."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        request = np.ascontiguousarray(request, dtype=np.float32)
        if self.prior is None:
            return _mlp_one(rows, request, *self._mlp_args())  # type: ignore[no-any-return]
        args = (*self._mlp_args(), *self.prior.one_args)
        return _mlp_prior_one(rows, request, *args)  # type: ignore[no-any-return]

    def _mlp_args(self) -> tuple[Any, ...]:
        """The weights as :func:`_mlp_one` takes them (cached): the first and the context layer
        split into their row / request / context input blocks, all C-contiguous float32 (without a
        context layer its blocks are empty)."""
        cached = self.__dict__.get("_mlp_args_cache")
        if cached is not None:
            return cached  # type: ignore[no-any-return]

        def c(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a, dtype=np.float32)

        nf, nr = N_OFFERING_FEATURES, N_REQUEST_FEATURES
        w0, b0 = self.layers[0]
        wc, bc = self.ctx if self.ctx is not None else (np.zeros((nf + nr, 0)), np.zeros(0))
        rest = self.layers[1:]
        args = (c(w0[:nf]), c(w0[nf:nf + nr]), c(w0[nf + nr:]), c(b0), c(wc[:nf]), c(wc[nf:nf + nr]), c(bc),
                tuple(c(w) for w, _ in rest), tuple(c(b) for _, b in rest), self.ctx is not None)
        self.__dict__["_mlp_args_cache"] = args
        return args

    def score_obs(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """Scores of one environment observation (``max_offerings`` entries, ``-inf`` where masked)."""
        rows = np.asarray(obs["offerings"], dtype=np.float32).reshape(1, -1, N_OFFERING_FEATURES)
        return self.scores(rows, np.asarray(obs["request"])[None, :], np.asarray(obs["mask"])[None, :])[0]


def masked_argmax(scores: np.ndarray, mask: np.ndarray) -> int:
    """Index of the best valid score; 0 when nothing is valid (the env then fails the request)."""
    valid = np.asarray(mask)[: len(scores)] > 0.5
    if not valid.any():
        return 0
    return int(np.argmax(np.where(valid, scores, -np.inf)))


def greedy_choice(expected: np.ndarray, bias: np.ndarray | None = None) -> int:
    """Greedy's choice (``models.baselines.Greedy``): the argmax of the one-step expected rewards
    (``CloudRouteEnv.expected_rewards``, -inf where not valid) plus the routing policies' bias;
    ties go to the lower index."""
    r = np.asarray(expected)
    return int(np.argmax(r if bias is None else r + np.asarray(bias)[: r.shape[0]]))


def departs(q_model: float, q_greedy: float, margin: float) -> bool:
    """**The departure rule** ("never worse where unsure", issue 39): the learned policy serves its
    own choice instead of greedy's only when its score of that choice exceeds its score of greedy's
    choice by more than ``margin`` (tau); elsewhere it serves greedy's. ``margin`` = +inf is greedy
    exactly, -inf the network's argmax exactly. The one definition: the environment's rollouts
    (:meth:`LearnedPolicy.act`, so ``xroute evaluate``, selection and the gate) and the router's
    decision path (``router.decision.stages.Watchdog``) both call it."""
    if margin == -math.inf:
        return True
    return bool(float(q_model) - float(q_greedy) > margin)


def choose(scores: np.ndarray, idx: np.ndarray, greedy: int, margin: float, hold: bool = False) -> int:
    """The offering served among the valid offerings ``idx`` (ascending) with the network's
    ``scores`` of them (the routing policies' bias added): its argmax, unless :func:`departs` says
    greedy's choice ``greedy`` (an offering index; -1 or outside ``idx``: unknown) stays, or
    ``hold`` (:func:`holds`: the affinity guard on a request with a prefix or a session) keeps it."""
    j = int(np.argmax(scores))
    model = int(idx[j])
    if greedy < 0 or greedy == model or margin == -math.inf:
        return model
    g = int(np.searchsorted(idx, greedy))
    if g >= idx.shape[0] or int(idx[g]) != greedy:
        return model
    if hold:
        return int(greedy)
    return model if departs(scores[j], scores[g], margin) else int(greedy)


def holds(weights: Any, affinity: bool) -> bool:
    """Whether the affinity guard keeps greedy's choice for a request: the weights have it
    (:attr:`RouterWeights.affinity_guard`) and the request carries KV-prefix blocks or a session
    (``affinity``: the environment's ``CloudRouteEnv.carries_affinity``, the router's
    ``RoutingEngine.wants_affinity``). Weights without the attribute (a policy of another kind, an
    export from before the guard) have no guard."""
    return bool(getattr(weights, "affinity_guard", False)) and bool(affinity)


class LearnedPolicy:
    """The ``models.baselines.Policy`` protocol over exported weights (what ``xroute evaluate``
    and the router run): the network's argmax with the departure rule (:func:`choose`) around
    greedy's choice in the environment it was reset with."""

    def __init__(self, weights: RouterWeights, name: str = "dqn"):
        self.weights = weights
        self.name = name
        self.env: Any = None

    def reset(self, env: Any, seed: int) -> None:
        self.n = getattr(env, "n", None)
        self.env = env if hasattr(env, "expected_rewards") else None

    def act(self, obs: dict[str, np.ndarray], info: dict[str, Any]) -> int:
        mask = np.asarray(info.get("action_mask", obs["mask"]), dtype=np.float32)
        n = self.n or len(mask)
        rows = np.asarray(obs["offerings"], dtype=np.float32).reshape(-1, N_OFFERING_FEATURES)[:n]
        valid = mask[:n] > 0.5
        if not valid.any():
            return 0
        idx = np.flatnonzero(valid)
        bias = info.get("policy_bias")  # the routing policies' prefer weights (envs.policies), reward units
        greedy = -1
        if float(self.weights.margin) != -math.inf and self.env is not None:
            greedy = greedy_choice(self.env.expected_rewards()[:n], None if bias is None else np.asarray(bias)[:n])
        hold = holds(self.weights, getattr(self.env, "carries_affinity", False))
        return self.choose_among(rows[idx], np.asarray(obs["request"]), idx, greedy,
                                 None if bias is None else np.asarray(bias)[idx], hold)

    def choose_among(self, rows: np.ndarray, request: np.ndarray, idx: np.ndarray, greedy: int,
                     bias: np.ndarray | None = None, hold: bool = False) -> int:
        """The decision on one state: the valid offerings ``idx`` (ascending) with their ``rows``
        (k, F), the ``request`` vector, greedy's choice there and the policies' ``bias`` of the
        valid offerings: the network scores them (the context over them alone), then
        :func:`choose`."""
        # only valid rows matter (masked rows neither win nor enter the context): score those alone
        s = self.weights.scores(np.asarray(rows, dtype=np.float32)[None], np.asarray(request)[None],
                                np.ones((1, idx.size)))[0]
        if bias is not None:
            s = s + bias
        return choose(s, idx, greedy, float(self.weights.margin), hold)


# ---------------------------------------------------------------------------------------- files
def save_router(weights: RouterWeights, directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    if weights.ctx is not None:
        arrays["ctx_w"], arrays["ctx_b"] = weights.ctx
    for k, (w, b) in enumerate(weights.layers):
        arrays[f"mlp_{k}_w"], arrays[f"mlp_{k}_b"] = w, b
    np.savez(d / WEIGHTS_FILE, **{k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()})  # type: ignore[arg-type]
    meta = {
        "format": FORMAT,
        "offering_features": list(OFFERING_FEATURES),
        "request_features": list(REQUEST_FEATURES),
        "n_layers": len(weights.layers),
        "context_dim": 0 if weights.ctx is None else int(weights.ctx[0].shape[1]),
        "prior": None if weights.prior is None else asdict(weights.prior),
        "margin": _number(weights.margin),
        "affinity_guard": bool(weights.affinity_guard),
        **{k: v for k, v in weights.meta.items()
           if k not in ("format", "n_layers", "context_dim", "prior", "margin", "affinity_guard")},
    }
    (d / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    return d


def _number(x: float) -> float | str:
    """``x`` for JSON: the infinities as the strings ``"inf"`` / ``"-inf"`` (strict JSON has none)."""
    x = float(x)
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def read_export_meta(directory: str | Path, meta_file: str, fmt: str, what: str) -> tuple[Path, dict[str, Any]]:
    """The directory of an exported model and its metadata: ``directory`` itself when it holds
    ``meta_file`` (its parent when it is a file), else the first directory below it that does (e.g.
    a downloaded MLflow model); the metadata's ``format`` must be ``fmt``. A bad export is a
    ConfigError naming the file and field (``what``: the kind of export, for the message)."""
    d = Path(directory)
    if d.is_file():
        d = d.parent
    if not (d / meta_file).is_file():
        found = sorted(d.rglob(meta_file)) if d.is_dir() else []
        if not found:
            raise ConfigError(f"{directory}: not an exported {what} (no {meta_file} found)")
        d = found[0].parent
    try:
        meta = json.loads((d / meta_file).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{d / meta_file}: not valid JSON ({e})") from None
    if meta.get("format") != fmt:
        raise ConfigError(f"{d / meta_file}: field 'format': expected '{fmt}', got '{meta.get('format')}'")
    return d, meta


def read_router(directory: str | Path) -> RouterWeights:
    """Weights from a directory holding ``router.json`` + ``router.npz`` (or any directory below
    which exactly such a pair is found, e.g. a downloaded MLflow model)."""
    d, meta = read_export_meta(directory, META_FILE, FORMAT, "router")
    if meta.get("offering_features") != list(OFFERING_FEATURES) or meta.get("request_features") != list(REQUEST_FEATURES):
        raise ConfigError(f"{d / META_FILE}: field 'offering_features': the router was trained on another feature "
                          "layout than envs.features defines now; retrain it (xroute train)")
    if not (d / WEIGHTS_FILE).is_file():
        raise ConfigError(f"{d}: {WEIGHTS_FILE} is missing")
    with np.load(d / WEIGHTS_FILE) as z:
        arrays = {k: z[k] for k in z.files}
    ctx = (arrays["ctx_w"], arrays["ctx_b"]) if meta.get("context_dim", 0) else None
    layers = [(arrays[f"mlp_{k}_w"], arrays[f"mlp_{k}_b"]) for k in range(int(meta["n_layers"]))]
    width = N_OFFERING_FEATURES + N_REQUEST_FEATURES + (0 if ctx is None else ctx[0].shape[1])
    if layers[0][0].shape[0] != width:
        raise ConfigError(f"{d / WEIGHTS_FILE}: first layer takes {layers[0][0].shape[0]} inputs, expected {width}")
    try:
        prior = RewardPrior(**meta["prior"]) if meta.get("prior") else None
    except TypeError as e:
        raise ConfigError(f"{d / META_FILE}: field 'prior': {e}") from None
    try:
        margin = float(meta.get("margin", 0.0))
        if math.isnan(margin):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{d / META_FILE}: field 'margin': not a number") from None
    guard = meta.get("affinity_guard", False)  # (an export from before the guard: none)
    if not isinstance(guard, bool):
        raise ConfigError(f"{d / META_FILE}: field 'affinity_guard': expected true or false, got {guard!r}")
    return RouterWeights(layers=layers, ctx=ctx, prior=prior, meta=meta, margin=margin, affinity_guard=guard)

