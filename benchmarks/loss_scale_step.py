"""Train-step time of tf_msopt.LossScaleOptimizer against Keras' own LossScaleOptimizer.

Both wrap the same inner optimizer (SGD with momentum) on the same small MLP and
batch, each in its own ``tf.function`` train step (forward, ``scale_loss``,
gradient, ``apply``), with the same initial scale and growth window. Cases run
interleaved, round after round, so machine noise hits them alike; the median
per-step time of each is reported with its ratio to Keras' optimizer (target
<= 1.02x). A step without loss scaling is timed as a reference. With
``--mirrored`` every case runs under MirroredStrategy over two logical CPUs,
where tf_msopt's optimizer also all-reduces the overflow verdict (Keras' does
not, which is its bug). The last line printed is JSON (``--out FILE`` also writes it to FILE, replacing the file).

    python benchmarks/loss_scale_step.py [--hidden 256] [--batch 128] [--rounds 21] [--mirrored]
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from timing import emit, machine, time_cases  # noqa: E402

INITIAL_SCALE = 2.0**15
WINDOW = 2000


def make_model(features, hidden, classes):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(classes),
    ])


def train_step(strategy, make_optimizer, args, x, y):
    """A compiled train step like Keras' own: forward, scaled loss, gradients, apply."""
    with strategy.scope():
        model = make_model(x.shape[1], args.hidden, args.classes)
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    replicas = strategy.num_replicas_in_sync

    def replica_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / (len(y) * replicas)
            loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    return tf.function(lambda: strategy.run(replica_step))


def cases(strategy, args, x, y):
    inner = lambda: keras.optimizers.SGD(0.01, momentum=0.9)  # noqa: E731
    makers = {
        "keras_loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
            inner(), initial_scale=INITIAL_SCALE, dynamic_growth_steps=WINDOW),
        "mso_loss_scale": lambda: mso.LossScaleOptimizer(
            inner(), mso.DynamicLossScaleManager(INITIAL_SCALE, 2, WINDOW)),
        "no_loss_scale": inner,
    }
    return {name: train_step(strategy, make, args, x, y) for name, make in makers.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls-per-round", type=int, default=100)
    parser.add_argument("--mirrored", action="store_true",
                        help="run under MirroredStrategy over two logical CPUs")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()

    strategy = tf.distribute.get_strategy()
    if args.mirrored:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(args.batch, args.features)).astype(np.float32))
    y = tf.constant(rng.integers(0, args.classes, size=args.batch))
    medians = time_cases(cases(strategy, args, x, y), args.rounds, args.calls_per_round,
                         warmup=20)
    keras_lso = medians["keras_loss_scale"]
    ratio = medians["mso_loss_scale"] / keras_lso

    where = "MirroredStrategy, 2 logical CPUs" if args.mirrored else "one device"
    print(f"MLP {args.features}-{args.hidden}-{args.hidden}-{args.classes}, batch {args.batch} "
          f"per replica, SGD momentum inside, {where}, {os.cpu_count()} CPUs, "
          f"TF {tf.__version__}, Keras {keras.__version__}")
    print(f"{'case':<20}{'ms/step':>10}{'vs Keras LSO':>14}")
    for name, seconds in medians.items():
        print(f"{name:<20}{seconds * 1e3:>10.3f}{seconds / keras_lso:>13.3f}x")
    verdict = "meets" if ratio <= 1.02 else "MISSES"
    print(f"target mso_vs_keras_loss_scale: {ratio:.3f}x (target <= 1.02x) {verdict}")
    emit({
        "benchmark": "loss_scale_step", "hidden": args.hidden, "batch": args.batch,
        "mirrored": args.mirrored,
        "machine": machine(),
        "ms_per_step": {k: round(s * 1e3, 4) for k, s in medians.items()},
        "ratios": {"mso_vs_keras_loss_scale": round(ratio, 4)},
    }, args.out)


if __name__ == "__main__":
    main()
