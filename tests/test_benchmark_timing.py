"""The benchmarks' shared interleaved timing: every case timed, the order rotating by round."""
from helpers import benchmark_module

timing = benchmark_module("timing")


def test_each_round_starts_one_case_further_on():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    medians = timing.time_cases(steps, rounds=4, calls_per_round=2, warmup=1)
    assert calls[:3] == list("abc")            # the warm-up, in the given order
    timed = calls[3:]
    assert timed == list("aabbcc" "bbccaa" "ccaabb" "aabbcc")
    assert set(medians) == set("abc") and all(seconds >= 0 for seconds in medians.values())
