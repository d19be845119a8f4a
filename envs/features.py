"""The feature layout the environment emits and every policy reads — defined here only.

Each offering row of the observation holds :data:`OFFERING_FEATURES` (in this order); the request
vector holds :data:`REQUEST_FEATURES`. Values are clipped into the bounds given here so the
observation space has finite, normalized bounds.
"""

from __future__ import annotations

import numpy as np

#: (name, low, high, meaning)
OFFERING_FEATURE_SPECS: tuple[tuple[str, float, float, str], ...] = (
    ("valid", 0.0, 1.0, "1 if the offering can take the request now (the action mask)"),
    ("log_price", -3.0, 3.0, "ln(price of one replica of the request's model per hour / reference price)"),
    ("price_trend", -1.0, 1.0, "(price now - price 24 h ago) / price now"),
    ("price_volatility", 0.0, 1.0, "price changes in the last 7 days / 10"),
    ("is_spot", 0.0, 1.0, "1 for spot pricing"),
    ("rtt", 0.0, 3.0, "RTT from the request's origin / 300 ms"),
    ("busy", 0.0, 1.0, "requests the router has in the pool (not yet seen complete) / slots, at most 1"),
    ("wait", 0.0, 3.0, "expected time until a slot frees (the router's view) / the request's TTFT objective"),
    ("ext_util", 0.0, 1.0, "pool utilization from outside xroute (utilization table)"),
    ("available", 0.0, 1.0, "spot pool obtainable now (always 1 for on-demand)"),
    ("preemptions", 0.0, 2.0, "preemptions in the lookback window / 5"),
    ("preempt_recency", 0.0, 1.0, "exp(-time since last preemption / lookback); 0 if none"),
    ("preempt_risk", 0.0, 1.0, "estimated probability of a preemption during this request's service"),
    ("speed", -3.0, 3.0, "ln(reference TPOT / this pool's TPOT for the request's model)"),
    ("capacity", 0.0, 2.0, "ln(1 + slots of the request's model) / 5"),
    ("exp_latency", 0.0, 3.0, "expected latency (RTT + wait + service) / the request's latency budget"),
    ("exp_ttft", 0.0, 3.0, "expected time to first token / the TTFT objective"),
    ("exp_tpot", 0.0, 3.0, "expected time per output token / the TPOT objective"),
    ("exp_cost", 0.0, 5.0, "expected cost / cost on a reference replica"),
    ("exp_violation", 0.0, 1.0, "probability that the SLO is missed (TTFT, TPOT or deadline) under service noise"),
    ("exp_cached", 0.0, 1.0, "expected share of the prompt's tokens cached there (the router's view: the prefix "
                             "blocks it sent to the pool, aged, times the pool's confirmed retention; envs.prefix)"),
    ("session_here", 0.0, 1.0, "1 if the router sent this request's session's previous request to this offering "
                               "(within the view's age bound)"),
)
REQUEST_FEATURE_SPECS: tuple[tuple[str, float, float, str], ...] = (
    ("input_tokens", 0.0, 2.0, "ln(1 + input tokens) / 10"),
    ("expected_output", 0.0, 2.0, "ln(1 + expected output tokens: the estimator, from past completions) / 8"),
    ("max_output", 0.0, 2.0, "ln(1 + max_output_tokens) / 8"),
    ("ttft_slo", 0.0, 2.0, "ln(1 + TTFT objective ms) / 10"),
    ("tpot_slo", 0.0, 2.0, "ln(1 + TPOT objective ms) / 6"),
    ("budget", 0.0, 2.0, "ln(1 + latency budget ms) / 12: the deadline, else TTFT + TPOT x (expected output - 1)"),
    ("model_size", 0.0, 2.0, "ln(1 + the model's parameters in billions) / 5"),
    ("arrival_rate", 0.0, 3.0, "requests in the last 10 s / 100"),
    ("load", 0.0, 1.0, "requests in flight / slots over all valid offerings (the router's view)"),
    ("budget_left", 0.0, 1.0, "USD left of the tenant's budget for the period / the budget (the tighter of its own and "
                              "its model's; envs.budget); 1 without a USD budget"),
    ("period_left", 0.0, 1.0, "time left in that budget's period / the period; 1 without a USD budget"),
    ("rate_left", 0.0, 1.0, "tokens left in the tenant's sliding minute / tokens_per_minute (the tighter); 1 without "
                            "a token rate limit"),
)

OFFERING_FEATURES: tuple[str, ...] = tuple(s[0] for s in OFFERING_FEATURE_SPECS)
REQUEST_FEATURES: tuple[str, ...] = tuple(s[0] for s in REQUEST_FEATURE_SPECS)
F = {name: i for i, name in enumerate(OFFERING_FEATURES)}
R = {name: i for i, name in enumerate(REQUEST_FEATURES)}
N_OFFERING_FEATURES = len(OFFERING_FEATURES)
N_REQUEST_FEATURES = len(REQUEST_FEATURES)

OFFERING_LOW = np.array([s[1] for s in OFFERING_FEATURE_SPECS], dtype=np.float32)
OFFERING_HIGH = np.array([s[2] for s in OFFERING_FEATURE_SPECS], dtype=np.float32)
REQUEST_LOW = np.array([s[1] for s in REQUEST_FEATURE_SPECS], dtype=np.float32)
REQUEST_HIGH = np.array([s[2] for s in REQUEST_FEATURE_SPECS], dtype=np.float32)


def offering_matrix(obs: dict[str, np.ndarray]) -> np.ndarray:
    """The observation's offering features as a (max_offerings, F) matrix (a view, no copy)."""
    return obs["offerings"].reshape(-1, N_OFFERING_FEATURES)
