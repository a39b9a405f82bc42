"""Interleaved timing shared by the benchmarks: every case in one process, round after round."""
import statistics
import time


def time_cases(steps, rounds, calls_per_round, warmup=3):
    """Median seconds per call of each zero-argument callable in ``steps``.

    Cases run interleaved, one batch of ``calls_per_round`` each per round, so
    noise on a shared machine hits them alike.
    """
    for step in steps.values():  # trace and warm up
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(calls_per_round):
                step()
            samples[name].append((time.perf_counter() - start) / calls_per_round)
    return {name: statistics.median(times) for name, times in samples.items()}
