"""The benchmarks' shared interleaved timing (every case timed, in balanced orders) and the
machine their results name."""
import itertools
import os

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


@pytest.mark.parametrize("before", [None, "0"])
def test_a_case_is_traced_with_the_custom_ops_off_and_the_switch_put_back(monkeypatch, before):
    import tensorflow as tf

    from tf_msopt.ops._loader import DISABLE_ENV

    if before is None:
        monkeypatch.delenv(DISABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(DISABLE_ENV, before)
    seen = []

    @tf.function
    def step():
        seen.append(os.environ.get(DISABLE_ENV))
        return tf.constant(1.0)

    assert timing.traced_without_custom_ops(step) is step
    assert seen == ["1"]
    assert step().numpy() == 1.0 and seen == ["1"]   # called later: not traced again
    assert os.environ.get(DISABLE_ENV) == before


@pytest.mark.parametrize("model, family, flags, cpu", [
    ("AMD EPYC", 25, "fpu avx2 avx512f", "AMD EPYC (Zen 4), AVX-512"),
    ("AMD EPYC", 25, "fpu avx2", "AMD EPYC (Zen 3), AVX2"),
    ("AMD EPYC 9654 96-Core Processor", 26, "avx512f", "AMD EPYC 9654 96-Core Processor "
                                                       "(Zen 5), AVX-512"),
    ("AMD Ryzen 9 7950X (Zen 4)", 25, "avx512f", "AMD Ryzen 9 7950X (Zen 4), AVX-512"),
    ("AMD EPYC 7742", 23, "avx2", "AMD EPYC 7742, AVX2"),
    ("Intel(R) Xeon(R) Platinum 8480+", 25, "avx512f", "Intel(R) Xeon(R) Platinum 8480+, AVX-512"),
])
def test_machine_names_an_amd_core_its_model_name_leaves_out(tmp_path, model, family, flags,
                                                             cpu):
    vendor = "GenuineIntel" if model.startswith("Intel") else "AuthenticAMD"
    first = f"vendor_id\t: {vendor}\ncpu family\t: {family}\nmodel name\t: {model}\n"
    cpuinfo = tmp_path / "cpuinfo"
    # The second processor's fields must not replace the first's.
    cpuinfo.write_text(f"{first}flags\t\t: {flags}\n\nmodel name\t: other\nflags\t: sse\n")
    assert timing.machine(str(cpuinfo))["cpu"] == cpu
