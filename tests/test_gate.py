"""The promotion gate's verdict (``models.gate.decide``) on known differences."""

from __future__ import annotations

import numpy as np

from models.gate import ScenarioResult, decide


def _scenarios(*per_seed: list[float]) -> list[ScenarioResult]:
    return [ScenarioResult(f"s{k}", [], "greedy", {"router": np.array(d)}) for k, d in enumerate(per_seed)]


def test_a_clear_gain_everywhere_passes() -> None:
    d = decide(_scenarios([0.010, 0.011, 0.012], [0.004, 0.005, 0.006]), "router")
    assert d.passed and d.wins == ["s0", "s1"] and not d.losses and d.pooled[1] > 0


def test_a_significant_loss_anywhere_refuses_even_with_a_pooled_gain() -> None:
    d = decide(_scenarios([0.05, 0.051, 0.052], [-0.002, -0.0021, -0.0019]), "router")
    assert not d.passed and d.losses == ["s1"] and "loses to the best baseline" in d.reason and d.pooled[1] > 0


def test_a_gain_within_noise_refuses() -> None:
    d = decide(_scenarios([0.004, -0.003, 0.001], [0.002, -0.004, 0.003]), "router")
    assert not d.passed and not d.losses and "beyond noise" in d.reason and d.pooled[1] <= 0 < d.pooled[2]


def test_the_verdict_is_recorded_as_tags() -> None:
    d = decide(_scenarios([0.01, 0.012], [0.02, 0.018]), "router")
    t = d.tags()
    assert t["gate_passed"] is True and t["gate_reward_delta"] == d.pooled[0] and t["gate_losses"] == "none"
