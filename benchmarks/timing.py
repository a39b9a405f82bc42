"""Interleaved timing shared by the benchmarks: every case in one process, round after round."""
import statistics
import time


def balanced_orders(count):
    """Orders of ``count`` cases in which each case runs right after every other one equally
    often (a Williams design): ``count`` orders for an even count, twice that for an odd one.
    """
    first = [0]
    low, high = 1, count - 1
    for position in range(1, count):
        if position % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(case + shift) % count for case in first] for shift in range(count)]
    if count % 2:
        orders += [order[::-1] for order in orders]
    return orders


def time_cases(steps, rounds, calls_per_round, warmup=3, idle=0.0):
    """Median seconds per call of each zero-argument callable in ``steps``.

    With ``idle`` (seconds), the process sleeps that long before each call, outside
    the timed span: a step that follows other work, as an offloaded optimizer's host
    step follows the accelerator's forward and backward pass, instead of a step that
    finds the caches and thread pools hot from its own previous call.

    Cases run interleaved, one batch of ``calls_per_round`` each per round, so
    noise on a shared machine hits them alike. The order changes every round
    (:func:`balanced_orders`), so that no case always runs right after the same other
    one: a case that follows another library's OpenMP loop (whose workers spin on for a
    while after it returns) or any case that leaves the machine busy runs slower, by up to
    20 % on a 2-core machine. Rotating one fixed order would not do: each case would still
    follow the same neighbour.
    """
    for step in steps.values():  # trace and warm up
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    names = list(steps)
    orders = balanced_orders(len(names))
    for round_index in range(rounds):
        for position in orders[round_index % len(orders)]:
            name = names[position]
            step = steps[name]
            seconds = 0.0
            if idle:
                for _ in range(calls_per_round):
                    time.sleep(idle)
                    start = time.perf_counter()
                    step()
                    seconds += time.perf_counter() - start
            else:
                start = time.perf_counter()
                for _ in range(calls_per_round):
                    step()
                seconds = time.perf_counter() - start
            samples[name].append(seconds / calls_per_round)
    return {name: statistics.median(times) for name, times in samples.items()}
