"""What an untaken ``tf.cond`` costs in a compiled train step: the floor under THOR's stale
step on small models.

A THOR stale step runs one conditional per Kronecker-factored layer (the statistics
capture, in the backward pass) and one for the refresh of the inverses, none of them
taken. This benchmark times the digits MLP's train step (64-64-64-10, batch 64,
forward, loss, gradients, SGD update; random data made here) in one ``tf.function``
with 0, 1 and ``--conditionals`` untaken conditionals, each of whose branches would
write a 64x64 covariance of a gradient into a buffer, as THOR's capture does. Cases run
interleaved in one process (``timing.time_cases``); the ratios are to the step with none,
and the cost per conditional is the difference divided by the count. The last line
printed is JSON (``--out FILE`` also
writes it to FILE, replacing the file).

    python benchmarks/conditional_cost.py [--conditionals 4] [--rounds 15] [--calls 200]
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from timing import emit, machine, time_cases  # noqa: E402

WIDTHS = (64, 64, 64, 10)
BATCH = 64


def make_step(conditionals):
    """A compiled SGD train step of the MLP with ``conditionals`` untaken ``tf.cond``."""
    rng = np.random.default_rng(0)
    weights = [tf.Variable((rng.normal(size=(m, n)) / np.sqrt(m)).astype("float32"))
               for m, n in zip(WIDTHS[:-1], WIDTHS[1:])]
    # One buffer per conditional, for the covariance of one weight gradient (in turn).
    owners = [i % len(weights) for i in range(conditionals)]
    buffers = [tf.Variable(tf.zeros((WIDTHS[i + 1],) * 2)) for i in owners]
    step_counter = tf.Variable(1, dtype=tf.int64)
    x = tf.constant(rng.normal(size=(BATCH, WIDTHS[0])).astype("float32"))
    y = tf.constant(rng.integers(0, WIDTHS[-1], size=BATCH).astype("int32"))

    def record(buffer, gradient):
        with tf.control_dependencies([buffer.assign(tf.matmul(gradient, gradient,
                                                              transpose_a=True))]):
            return tf.constant(True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for w in weights[:-1]:
                h = tf.nn.relu(h @ w)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=h @ weights[-1]))
        gradients = tape.gradient(loss, weights)
        for buffer, owner in zip(buffers, owners):
            # A step counter that never hits: the branch is never taken, as on stale steps.
            tf.cond(tf.equal(tf.math.floormod(step_counter.read_value(), 10**9), 0),
                    lambda buffer=buffer, owner=owner: record(buffer, gradients[owner]),
                    lambda: tf.constant(False))
        for w, gradient in zip(weights, gradients):
            w.assign_sub(0.01 * gradient)
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conditionals", type=int, default=4,
                        help="THOR's digits-MLP stale step has 4 (3 captures, 1 refresh)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()
    counts = sorted({0, 1, args.conditionals})
    steps = {f"{n} conditional(s)": make_step(n) for n in counts}
    times = time_cases(steps, args.rounds, args.calls, warmup=20)
    baseline = times["0 conditional(s)"]
    print(f"digits-MLP train step, batch {BATCH}, {args.rounds} rounds x {args.calls} calls")
    print(f"{'case':>18} {'us/step':>9} {'ratio':>7} {'us per conditional':>19}")
    per = {}
    for n, (key, seconds) in zip(counts, times.items()):
        per[n] = 1e6 * (seconds - baseline) / n if n else 0.0
        print(f"{key:>18} {1e6 * seconds:9.1f} {seconds / baseline:6.3f}x {per[n]:19.1f}")
    emit({"benchmark": "conditional_cost", "machine": machine(),
          "us_per_step": {k: 1e6 * v for k, v in times.items()},
          "ratio": {k: v / baseline for k, v in times.items()},
          "us_per_conditional": {str(n): per[n] for n in counts if n}}, args.out)


if __name__ == "__main__":
    main()
