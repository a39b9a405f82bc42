"""Average THOR train-step time at frequency=100 against SGD with momentum, same MLP, same run.

Each case is a compiled train step (forward, loss, gradients, ``apply``) on the
same MLP and batch. A timing round is ``--frequency`` consecutive steps, so each
THOR round holds exactly one THOR step (statistics, all-reduce, inverses) and
``frequency - 1`` stale steps; cases run interleaved, round after round, and the
median per-step time of each is reported with its ratio to SGD with momentum
(target <= 1.25x). ``thor stale`` is THOR with no refresh in the timed window:
what every stale step costs (preconditioning ``A_inv g G_inv`` and the momentum
update). The last line printed is JSON.

    python benchmarks/thor_step.py [--hidden 512] [--batch 512] [--rounds 5]
"""
import argparse
import json
import os
import platform

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from timing import time_cases  # noqa: E402


def make_model(features, hidden, classes):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(classes),
    ])


def train_step(make_optimizer, args, x, y):
    model = make_model(x.shape[1], args.hidden, args.classes)
    optimizer = make_optimizer(model)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=784)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--frequency", type=int, default=100)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(args.batch, args.features)).astype("float32"))
    y = tf.constant(rng.integers(0, args.classes, size=args.batch).astype("int32"))

    def thor(frequency):
        return lambda model: mso.thor(model, 0.01, 0.03, 0.9, frequency=frequency,
                                      block_size=args.block_size)

    steps = {
        "sgd momentum": train_step(lambda model: keras.optimizers.SGD(0.01, momentum=0.9),
                                   args, x, y),
        f"thor F={args.frequency}": train_step(thor(args.frequency), args, x, y),
        "thor stale": train_step(thor(10**9), args, x, y),   # one THOR step, in the warm-up
    }
    # A warm-up of `frequency` steps keeps each timed round aligned on one THOR step.
    times = time_cases(steps, args.rounds, args.frequency, warmup=args.frequency)
    baseline = times["sgd momentum"]
    print(f"MLP {args.features}-{args.hidden}-{args.hidden}-{args.classes}, batch {args.batch}, "
          f"blocks of {args.block_size}, inverse back-end "
          f"{mso.ops.inverse.inverse_backend()}")
    print(f"{'case':>16} {'ms/step':>9} {'vs SGD':>7}")
    for name, seconds in times.items():
        print(f"{name:>16} {1e3 * seconds:9.3f} {seconds / baseline:7.3f}x")
    print(json.dumps({
        "benchmark": "thor_step", "machine": platform.machine(), "cpus": os.cpu_count(),
        "args": vars(args), "ms_per_step": {k: 1e3 * v for k, v in times.items()},
        "ratio_vs_sgd": {k: v / baseline for k, v in times.items()},
        "target": {"ratio_vs_sgd": 1.25},
    }))


if __name__ == "__main__":
    main()
