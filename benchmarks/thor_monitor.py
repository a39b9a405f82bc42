"""Epoch time of ``fit`` with ``tf_msopt.thor.Monitor`` against the same ``fit`` without it.

Each case trains its own copy of one MLP (same initial weights, THOR's default
configuration, the same batches) for one epoch per call: without the monitor, with
``Monitor()`` (THOR's state read at the end of each epoch) and with
``Monitor(update_freq=N)`` (also every N batches). Cases run interleaved, round after
round (benchmarks/timing.py), so machine noise hits them alike; the median epoch time of
each is reported with its ratio to the epoch without the monitor (target: ``Monitor()``
<= 1.02x). The monitor changes no weight, so every copy does the same work. The last line
printed is JSON (``--out FILE`` also writes it to FILE, replacing the file).

    python benchmarks/thor_monitor.py [--hidden 512] [--batch 256] [--steps 40] [--rounds 15]
                                      [--update-freq 10]
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from loss_scale_step import make_model  # noqa: E402  (the same MLP)
from tf_msopt.compare import without_data_autotuning  # noqa: E402
from timing import emit, machine, time_cases  # noqa: E402

TARGET = 1.02


def epoch(args, x, y, callbacks):
    """A zero-argument callable: one epoch of ``fit`` of a fresh model and THOR, with
    ``callbacks``."""
    model = make_model(x.shape[1], args.hidden, args.classes)
    model.compile(optimizer=mso.thor(model),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return lambda: model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False,
                             verbose=0, callbacks=callbacks)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=784)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="batches per epoch")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--epochs-per-round", type=int, default=1)
    parser.add_argument("--update-freq", type=int, default=10,
                        help="the batch interval of the monitor's second case")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, args.features)).astype(np.float32)
    y = rng.integers(0, args.classes, size=len(x))
    every = f"monitor_every_{args.update_freq}"
    cases = {"without": epoch(args, x, y, []),
             "monitor": epoch(args, x, y, [mso.thor.Monitor()]),
             every: epoch(args, x, y, [mso.thor.Monitor(update_freq=args.update_freq)])}
    with without_data_autotuning():
        medians = time_cases(cases, args.rounds, args.epochs_per_round, warmup=2)
    plain = medians["without"]
    ratios = {f"{name}_vs_without": seconds / plain for name, seconds in medians.items()
              if name != "without"}

    print(f"MLP {args.features}-{args.hidden}-{args.hidden}-{args.classes}, mso.thor(model), "
          f"batch {args.batch}, {args.steps} batches per epoch, {os.cpu_count()} CPUs, "
          f"TF {tf.__version__}, Keras {keras.__version__}")
    print(f"{'case':<22}{'ms/epoch':>10}{'vs without':>12}")
    for name, seconds in medians.items():
        print(f"{name:<22}{seconds * 1e3:>10.1f}{seconds / plain:>11.3f}x")
    ratio = ratios["monitor_vs_without"]
    verdict = "meets" if ratio <= TARGET else "MISSES"
    print(f"target monitor_vs_without: {ratio:.3f}x (target <= {TARGET}x) {verdict}")
    emit({
        "benchmark": "thor_monitor", "hidden": args.hidden, "batch": args.batch,
        "steps_per_epoch": args.steps, "update_freq": args.update_freq,
        "machine": machine(),
        "ms_per_epoch": {name: round(seconds * 1e3, 3) for name, seconds in medians.items()},
        "ratios": {name: round(value, 4) for name, value in ratios.items()},
    }, args.out)


if __name__ == "__main__":
    main()
