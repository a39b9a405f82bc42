"""The benchmarks' shared interleaved timing: every case timed, in balanced orders."""
import itertools

import pytest

from helpers import benchmark_module

timing = benchmark_module("timing")


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8])
def test_each_case_follows_every_other_equally_often(count):
    orders = timing.balanced_orders(count)
    assert len(orders) == (count if count % 2 == 0 else 2 * count)
    assert all(sorted(order) == list(range(count)) for order in orders)
    follows = [pair for order in orders for pair in zip(order, order[1:])]
    expected = 1 if count % 2 == 0 else 2
    assert sorted(follows) == sorted(
        pair for pair in itertools.permutations(range(count), 2) for _ in range(expected))


def test_rounds_run_in_the_balanced_orders():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    medians = timing.time_cases(steps, rounds=5, calls_per_round=2, warmup=1)
    assert calls[:4] == list("abcd")            # the warm-up, in the given order
    timed = calls[4:]
    rounds = [timed[8 * r:8 * r + 8:2] for r in range(5)]
    assert rounds == [list("abdc"), list("bcad"), list("cdba"), list("dacb"), list("abdc")]
    assert timed[::2] == timed[1::2]            # each case's calls back to back
    assert set(medians) == set("abcd") and all(seconds >= 0 for seconds in medians.values())


def test_idle_time_before_each_call_is_not_timed():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "ab"}
    medians = timing.time_cases(steps, rounds=2, calls_per_round=3, warmup=0, idle=0.02)
    assert sorted(calls) == list("aaaaaabbbbbb")
    assert all(seconds < 0.01 for seconds in medians.values())  # the 20 ms sleeps excluded
