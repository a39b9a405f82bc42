"""Epochs and wall time to a target validation accuracy: THOR vs tuned SGD-momentum and Adam.

Every optimizer gets a grid of nine settings (learning rates; THOR learning rate x
damping) on the same model, data, initial weights and batches, and every setting
runs with several seeds (each seed draws its own train/validation split, initial
weights and batch order). A run stops at the first epoch whose validation accuracy
reaches the target. A setting is scored by its median over the seeds of the
epochs and of the wall time to the target (a run that never reaches it counts as
infinite), and each optimizer by its best setting. Data: scikit-learn's digits (no
network), through the same model builders as ``tf-msopt compare``. When
``kfac_jax`` is importable, the same model is also trained with kfac-jax
(``benchmarks/kfac_jax_baseline.py``, whose docstring gives the install line) and
reported beside THOR.

    python benchmarks/convergence.py [--model cnn|mlp] [--target 0.98] [--seeds 0,1,2]
                                     [--max-epochs 25] [--batch-size 64] [--frequency F]
                                     [--optimizers THOR,Adam]

Prints every run, a table of the best settings, the ratios THOR / best first-order
optimizer (target: <= 0.5x the epochs and < 1x the wall time) and one JSON line.
Wall time includes each run's tracing, as a user of ``fit`` sees it.
"""
import argparse
import json
import math
import os
import platform
import sys
from statistics import median

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from tf_msopt.compare import (first_reaching, load_digits_split, make_model, prepare,  # noqa: E402
                              train_one)

DEFAULT_TARGETS = {"cnn": 0.98, "mlp": 0.97}
FIRST_ORDER = ("SGD-momentum", "Adam")
# Nine settings each, centred on what works on digits for that model; the best
# setting should sit inside its grid, not on an edge.
SGD_RATES = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3)
ADAM_RATES = (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2)
THOR_GRIDS = {  # (learning rates, dampings)
    "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1)),
    "mlp": ((0.03, 0.05, 0.1), (1.0, 3.0, 10.0)),
}


def grids(kind, frequency):
    """Optimizer name -> list of (setting label, factory(model))."""
    learning_rates, dampings = THOR_GRIDS[kind]
    return {
        "THOR": [(f"lr={lr} damping={damping}",
                  lambda model, lr=lr, damping=damping: mso.thor(
                      model, learning_rate=lr, damping=damping, momentum=0.9,
                      frequency=frequency))
                 for lr in learning_rates for damping in dampings],
        "SGD-momentum": [(f"lr={lr}", lambda model, lr=lr: keras.optimizers.SGD(lr, momentum=0.9))
                         for lr in SGD_RATES],
        "Adam": [(f"lr={lr}", lambda model, lr=lr: keras.optimizers.Adam(lr))
                 for lr in ADAM_RATES],
    }


class StopAtTarget(keras.callbacks.Callback):
    """Ends training at the first epoch whose validation accuracy reaches ``target``."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def on_epoch_end(self, epoch, logs=None):
        if (logs or {}).get("val_accuracy", 0.0) >= self.target:
            self.model.stop_training = True


def to_target(history, target):
    """(epochs, seconds) until the validation accuracy first reaches ``target``; inf if never."""
    reached = first_reaching(history["val_accuracy"], target)
    if reached is None:
        return math.inf, math.inf
    return reached + 1, history["seconds"][reached]


def kfac_jax_runs(kind, target):
    """kfac-jax's (label, train(data, initial, epochs, batch, seed)) settings, or [] when
    kfac_jax is not importable or does not cover ``kind``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import kfac_jax_baseline
    except ImportError as err:
        print(f"kfac-jax not run: {err}")
        return []
    if kind not in kfac_jax_baseline.MODELS:
        print(f"kfac-jax not run: kfac_jax_baseline has no {kind!r} model")
        return []
    return [(label, lambda data, initial, epochs, batch, seed, kwargs=kwargs:
             kfac_jax_baseline.train_kfac_jax(kind, data, initial, epochs, batch, seed,
                                              target=target, **kwargs))
            for label, kwargs in kfac_jax_baseline.grid(kind)]


def run(kind, target, seeds, max_epochs, batch_size, frequency=None, optimizers=None):
    """{optimizer: {setting: {"epochs": [...per seed], "seconds": [...]}}}."""
    splits = {seed: prepare(kind, load_digits_split(seed)) for seed in seeds}
    initial = {}
    for seed, data in splits.items():
        keras.utils.set_random_seed(seed)
        initial[seed] = make_model(kind, data[0].shape[1:], 10).get_weights()
    steps_per_epoch = -(-len(splits[seeds[0]][0]) // batch_size)
    frequency = frequency or max(2, steps_per_epoch // 2)   # THOR: new inverses twice an epoch

    def keras_run(factory):
        return lambda data, weights, epochs, batch, seed: train_one(
            kind, factory, data, weights, epochs, batch, seed, verbose=0,
            callbacks=[StopAtTarget(target)])

    runners = {name: [(label, keras_run(factory)) for label, factory in settings]
               for name, settings in grids(kind, frequency).items()}
    kfac = kfac_jax_runs(kind, target)
    if kfac:
        runners["kfac-jax"] = kfac
    runners = {name: r for name, r in runners.items() if not optimizers or name in optimizers}
    results = {}
    for name, settings in runners.items():
        results[name] = {}
        for label, train in settings:
            epochs, seconds = zip(*(to_target(train(splits[seed], initial[seed], max_epochs,
                                                    batch_size, seed), target)
                                    for seed in seeds))
            results[name][label] = {"epochs": list(epochs), "seconds": list(seconds)}
            print(f"{name:<14}{label:<26}epochs to {target:g} per seed: "
                  f"{' '.join(_show(e) for e in epochs):<12} median {_show(median(epochs)):>4}"
                  f"   seconds median {median(seconds):6.2f}", flush=True)
    return results


def best_settings(results):
    """{optimizer: (setting label, median epochs, median seconds)}: fewest epochs, then time."""
    best = {}
    for name, settings in results.items():
        label, r = min(settings.items(),
                       key=lambda item: (median(item[1]["epochs"]), median(item[1]["seconds"])))
        best[name] = (label, median(r["epochs"]), median(r["seconds"]))
    return best


def ratios(best):
    """THOR's median epochs and seconds over the best first-order optimizer's."""
    first_order = [best[name] for name in FIRST_ORDER
                   if name in best and math.isfinite(best[name][1])]
    if "THOR" not in best or not math.isfinite(best["THOR"][1]) or not first_order:
        return {}
    fewest_epochs = min(b[1] for b in first_order)
    least_time = min(b[2] for b in first_order)
    return {"thor_epochs_vs_best_first_order": best["THOR"][1] / fewest_epochs,
            "thor_seconds_vs_best_first_order": best["THOR"][2] / least_time}


def _show(value):
    return "-" if math.isinf(value) else f"{value:g}"


def _json_number(value):
    return None if math.isinf(value) else round(value, 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(THOR_GRIDS), default="cnn")
    parser.add_argument("--target", type=float, default=None,
                        help="validation accuracy (default: cnn 0.98, mlp 0.97)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated")
    parser.add_argument("--max-epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--frequency", type=int, default=None,
                        help="THOR's frequency (default: half the steps of an epoch)")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated subset of THOR, SGD-momentum, Adam, kfac-jax")
    args = parser.parse_args()
    target = args.target or DEFAULT_TARGETS[args.model]
    seeds = [int(s) for s in args.seeds.split(",")]

    print(f"digits {args.model}, batch {args.batch_size}, target val acc {target}, seeds {seeds}, "
          f"{os.cpu_count()} CPUs, TF {tf.__version__}, Keras {keras.__version__}")
    results = run(args.model, target, seeds, args.max_epochs, args.batch_size, args.frequency,
                  args.optimizers and args.optimizers.split(","))
    best = best_settings(results)
    print(f"\n{'best of each':<14}{'setting':<26}{'median epochs':>14}{'median s':>10}")
    for name, (label, epochs, seconds) in best.items():
        print(f"{name:<14}{label:<26}{_show(epochs):>14}{seconds:>10.2f}")
    found = ratios(best)
    if found:
        for key, limit, ok in (
                ("thor_epochs_vs_best_first_order", "<= 0.5x",
                 found["thor_epochs_vs_best_first_order"] <= 0.5),
                ("thor_seconds_vs_best_first_order", "< 1x",
                 found["thor_seconds_vs_best_first_order"] < 1.0)):
            print(f"target {key}: {found[key]:.2f}x (target {limit}) "
                  f"{'meets' if ok else 'MISSES'}")
    else:
        print("THOR or every first-order optimizer missed the target: no ratio")
    print(json.dumps({
        "benchmark": "convergence", "model": args.model, "target": target, "seeds": seeds,
        "batch_size": args.batch_size, "max_epochs": args.max_epochs,
        "thor_frequency": args.frequency,
        "machine": {"cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine()},
        "best": {name: {"setting": label, "median_epochs": _json_number(epochs),
                        "median_seconds": _json_number(seconds)}
                 for name, (label, epochs, seconds) in best.items()},
        "runs": {name: {label: {k: [_json_number(v) for v in values] for k, values in r.items()}
                        for label, r in settings.items()}
                 for name, settings in results.items()},
        "ratios": {k: round(v, 3) for k, v in found.items()},
    }))


if __name__ == "__main__":
    main()
