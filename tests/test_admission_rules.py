"""The admission rules the router and the simulator share (``xroute.admission_rules``)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xroute import admission_rules as ar


def test_a_request_a_pool_can_serve_in_time_is_admitted_whatever_its_band() -> None:
    for band in ar.BANDS:
        assert ar.verdict(band, 400.0, 500.0) == ar.ADMIT
        assert ar.verdict(band, 500.0, 500.0) == ar.ADMIT  # within is within


def test_no_pool_in_time_queues_critical_and_standard_and_sheds_sheddable() -> None:
    assert ar.verdict("critical", 900.0, 500.0) == ar.QUEUE
    assert ar.verdict("standard", math.inf, 500.0) == ar.QUEUE
    assert ar.verdict("sheddable", 900.0, 500.0) == ar.SHED


def test_the_wait_spends_the_ttft_budget_and_a_spent_budget_is_shed() -> None:
    assert ar.verdict("critical", 300.0, 500.0, waited_ms=150.0) == ar.ADMIT
    assert ar.verdict("critical", 400.0, 500.0, waited_ms=150.0) == ar.QUEUE
    assert ar.verdict("critical", 0.0, 500.0, waited_ms=500.0) == ar.ADMIT  # a pool that starts it at once
    assert ar.verdict("critical", 10.0, 500.0, waited_ms=500.0) == ar.SHED


def test_an_arrival_does_not_overtake_a_request_of_its_band_or_a_higher_one() -> None:
    """``ahead_waiting``: however good the prediction, an arrival joins the queue behind them (the
    dispatch order decides), or is shed when sheddable or its budget is spent."""
    assert ar.verdict("critical", 100.0, 1000.0, 0.0, ahead_waiting=True) == ar.QUEUE
    assert ar.verdict("standard", 100.0, 1000.0, 0.0, ahead_waiting=True) == ar.QUEUE
    assert ar.verdict("sheddable", 100.0, 1000.0, 0.0, ahead_waiting=True) == ar.SHED
    assert ar.verdict("standard", 100.0, 1000.0, 1000.0, ahead_waiting=True) == ar.SHED
    assert ar.waits_ahead("standard", [0, 1, 0]) and ar.waits_ahead("standard", [1, 0, 0])
    assert not ar.waits_ahead("standard", [0, 0, 5]) and not ar.waits_ahead("critical", [0, 3, 5])
    assert ar.waits_ahead("sheddable", [0, 0, 1])


def test_the_judged_ttft_counts_the_queue_wait_more_the_lower_the_band() -> None:
    """No wait predicted: the prediction as is (a free pool changes nothing); a predicted wait counts
    its band's margin times (critical the least), so the lower bands leave the queues short."""
    for band in ar.BANDS:
        assert ar.judged_ttft(band, 300.0, 0.0) == 300.0
        assert ar.judged_ttft(band, 1300.0, 1.0) == 1300.0 + (ar.wait_margin(band) - 1.0) * 1000.0
    assert 1.0 <= ar.wait_margin("critical") < ar.wait_margin("standard") < ar.wait_margin("sheddable")
    with pytest.raises(ValueError, match="one of critical, standard, sheddable"):
        ar.wait_margin("urgent")


def test_an_unknown_band_names_the_bands() -> None:
    with pytest.raises(ValueError, match="unknown priority 'urgent': one of critical, standard, sheddable"):
        ar.band_index("urgent")
    assert [ar.band_index(b) for b in ar.BANDS] == [0, 1, 2]


def test_service_weighs_output_twice_and_divides_by_the_weight() -> None:
    assert ar.service(100, 50, 1.0) == 200.0
    assert ar.service(100, 50, 2.0) == 100.0
    assert ar.correction(50, 80, 2.0) == 30.0
    assert ar.correction(80, 50, 1.0) == -60.0
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="weight must be > 0"):
            ar.service(1, 1, bad)


def test_a_tenant_back_from_idle_is_lifted_to_the_lowest_backlogged_counter() -> None:
    assert ar.lift(10.0, [50.0, 30.0]) == 30.0
    assert ar.lift(40.0, [50.0, 30.0]) == 40.0
    assert ar.lift(10.0, []) == 10.0


def test_dispatch_order_bands_then_counters_then_arrival() -> None:
    waiting = [(1, "a", 0.0), (2, "b", 0.1), (0, "c", 0.2), (1, "b", 0.3), (1, "a", 0.4)]
    counters = {"a": 100.0, "b": 10.0, "c": 1e9}
    assert ar.dispatch_order(waiting, counters) == [2, 3, 0, 4, 1]


@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from("abcd"), st.floats(0, 100)), max_size=30),
       st.dictionaries(st.sampled_from("abcd"), st.floats(0, 1e6)))
def test_dispatch_order_is_a_permutation_never_serving_a_lower_band_first(
        waiting: list[tuple[int, str, float]], counters: dict[str, float]) -> None:
    order = ar.dispatch_order(waiting, counters)
    assert sorted(order) == list(range(len(waiting)))
    bands = [waiting[i][0] for i in order]
    assert bands == sorted(bands)
    for x, y in itertools.pairwise(order):  # within a band, never a higher counter before a lower one
        if waiting[x][0] == waiting[y][0]:
            assert counters.get(waiting[x][1], 0.0) <= counters.get(waiting[y][1], 0.0)


def test_jain_is_one_when_equal_and_one_over_n_when_one_takes_everything() -> None:
    assert ar.jain([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert ar.jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert ar.jain([]) == 1.0
    assert ar.jain([1.0, 3.0]) == pytest.approx(16 / 20)


def test_fair_shares_water_fill_by_weight_capped_at_demand() -> None:
    assert ar.fair_shares([10.0, 100.0], [1.0, 1.0], 60.0) == pytest.approx([10.0, 50.0])  # quiet one in full
    assert ar.fair_shares([100.0, 100.0], [1.0, 3.0], 40.0) == pytest.approx([10.0, 30.0])
    assert ar.fair_shares([5.0, 5.0], [1.0, 1.0], 100.0) == pytest.approx([5.0, 5.0])  # enough for all
    assert ar.fair_shares([0.0, 30.0, 30.0], [1.0, 1.0, 1.0], 20.0) == pytest.approx([0.0, 10.0, 10.0])
    with pytest.raises(ValueError, match="weight must be > 0"):
        ar.fair_shares([1.0], [0.0], 1.0)


@given(st.lists(st.tuples(st.floats(0, 1e4), st.floats(0.1, 10)), min_size=1, max_size=8), st.floats(0, 1e5))
def test_fair_shares_never_exceed_demand_or_capacity_and_use_what_is_asked(
        rows: list[tuple[float, float]], capacity: float) -> None:
    demands, weights = [d for d, _ in rows], [w for _, w in rows]
    s = ar.fair_shares(demands, weights, capacity)
    assert all(-1e-9 <= x <= d + 1e-6 for x, d in zip(s, demands))
    assert sum(s) == pytest.approx(min(capacity, sum(demands)), rel=1e-6, abs=1e-6)
