"""Epochs and wall time to a target validation accuracy: THOR vs tuned SGD-momentum and Adam.

Each optimizer gets a small grid of learning rates (THOR also of damping) on the
same model, data, initial weights and seed; the best run of each (fewest epochs to
the target, then least time) is reported. Data: scikit-learn's digits (no
network), through the same model builders as `tf-msopt compare`.

    python benchmarks/convergence.py [--model mlp|cnn] [--target 0.97] [--max-epochs 30]

Prints a table, the ratios THOR / best first-order run (target: <= 0.5x the epochs
and < 1x the wall time) and one JSON line.
"""
import argparse
import json
import os
import platform

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from tf_msopt.compare import (first_reaching, load_digits_split, make_model, prepare,  # noqa: E402
                              train_one)

BATCH_SIZE = 64


def grids(steps_per_epoch):
    """Optimizer -> list of (setting label, factory(model))."""
    sgd = [(f"lr={lr}", lambda model, lr=lr: keras.optimizers.SGD(lr, momentum=0.9))
           for lr in (0.01, 0.03, 0.1, 0.3)]
    adam = [(f"lr={lr}", lambda model, lr=lr: keras.optimizers.Adam(lr))
            for lr in (3e-4, 1e-3, 3e-3, 1e-2)]
    frequency = max(2, steps_per_epoch // 2)
    thor = [(f"lr={lr} damping={damping}",
             lambda model, lr=lr, damping=damping: mso.thor(
                 model, learning_rate=lr, damping=damping, momentum=0.9, frequency=frequency))
            for lr in (0.01, 0.03, 0.05) for damping in (0.3, 1.0)]
    return {"THOR": thor, "SGD-momentum": sgd, "Adam": adam}


def run(kind, target, max_epochs, seed):
    data = prepare(kind, load_digits_split(seed))
    keras.utils.set_random_seed(seed)
    initial = make_model(kind, data[0].shape[1:], 10).get_weights()
    steps_per_epoch = -(-len(data[0]) // BATCH_SIZE)
    best = {}
    for name, settings in grids(steps_per_epoch).items():
        for label, factory in settings:
            history = train_one(kind, factory, data, initial, max_epochs, BATCH_SIZE, seed,
                                verbose=0)
            reached = first_reaching(history["val_accuracy"], target)
            epochs = None if reached is None else reached + 1
            seconds = None if reached is None else history["seconds"][reached]
            print(f"{name:<14}{label:<26}epochs to {target:g}: {epochs or '-':>4}   "
                  f"seconds: {seconds or float('nan'):6.2f}   "
                  f"final val acc {history['val_accuracy'][-1]:.4f}", flush=True)
            key = (epochs is None, epochs or 0, seconds or 0.0)
            if name not in best or key < best[name]["key"]:
                best[name] = {"key": key, "setting": label, "epochs": epochs, "seconds": seconds}
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"digits {args.model}, batch {BATCH_SIZE}, target val acc {args.target}, "
          f"{os.cpu_count()} CPUs, TF {tf.__version__}, Keras {keras.__version__}")
    best = run(args.model, args.target, args.max_epochs, args.seed)
    print(f"\n{'best of each':<14}{'setting':<26}{'epochs':>7}{'seconds':>9}")
    for name, b in best.items():
        print(f"{name:<14}{b['setting']:<26}{b['epochs'] or '-':>7}"
              f"{b['seconds'] if b['seconds'] is not None else float('nan'):>9.2f}")
    ratios = {}
    first_order = [b for name, b in best.items() if name != "THOR" and b["epochs"] is not None]
    thor = best["THOR"]
    if thor["epochs"] is not None and first_order:
        fastest = min(first_order, key=lambda b: (b["epochs"], b["seconds"]))
        quickest = min(first_order, key=lambda b: b["seconds"])
        ratios = {"thor_epochs_vs_best_first_order": thor["epochs"] / fastest["epochs"],
                  "thor_seconds_vs_best_first_order": thor["seconds"] / quickest["seconds"]}
        epochs_ok = ratios["thor_epochs_vs_best_first_order"] <= 0.5
        seconds_ok = ratios["thor_seconds_vs_best_first_order"] < 1.0
        print(f"target thor_epochs_vs_best_first_order: "
              f"{ratios['thor_epochs_vs_best_first_order']:.2f}x (target <= 0.5x) "
              f"{'meets' if epochs_ok else 'MISSES'}")
        print(f"target thor_seconds_vs_best_first_order: "
              f"{ratios['thor_seconds_vs_best_first_order']:.2f}x (target < 1x) "
              f"{'meets' if seconds_ok else 'MISSES'}")
    else:
        print("a run did not reach the target: no ratio")
    print(json.dumps({
        "benchmark": "convergence", "model": args.model, "target": args.target,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or
                    platform.machine()},
        "best": {name: {k: v for k, v in b.items() if k != "key"} for name, b in best.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }))


if __name__ == "__main__":
    main()
