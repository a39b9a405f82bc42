"""Interleaved timing shared by the benchmarks: every case in one process, round after round."""
import statistics
import time


def time_cases(steps, rounds, calls_per_round, warmup=3):
    """Median seconds per call of each zero-argument callable in ``steps``.

    Cases run interleaved, one batch of ``calls_per_round`` each per round, so
    noise on a shared machine hits them alike. Each round starts one case further on, so
    no case always runs right after the same other one: a case that follows another
    library's OpenMP loop (whose workers spin on for a while after it returns) or any
    case that leaves the machine busy runs slower, by up to 20 % on a 2-core machine.
    """
    for step in steps.values():  # trace and warm up
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(rounds):
        first = round_index % len(names)
        for name in names[first:] + names[:first]:
            step = steps[name]
            start = time.perf_counter()
            for _ in range(calls_per_round):
                step()
            samples[name].append((time.perf_counter() - start) / calls_per_round)
    return {name: statistics.median(times) for name, times in samples.items()}
