"""Steps and training time to a validation target against the batch size.

Two tasks (``--task``), their data made here, never downloaded:

* ``teacher``: 32 standard normal features, labelled by the argmax of a fixed random teacher
  network's ten outputs (32-64-10, tanh), keeping only inputs whose top two outputs differ by
  more than 0.5 (no near-ties); 131,072 training and 8,192 validation examples; the student is
  an MLP 32-256-256-10 (ReLU). With a constant learning rate the gradient's noise holds a
  small batch's accuracy below the target for long: the steps to the target fall steeply
  with the batch.
* ``mnist1d``: 128,000 MNIST-1D sequences made by the ``mnist1d`` package (seed 42), 102,400
  to train and 8,192 of the rest to validate, through ``convergence.py``'s Conv1D network.

Both are judged by the validation accuracy reaching 0.90.

Optimizers, at every batch size, each with a three-point learning-rate grid (x 1/3, 1, 3 of
the rate that centres it):

* ``THOR``: ``tf_msopt.thor(model)``, centred on its default: its middle point *is* the
  untuned default (``THOR default`` in the tables);
* ``THOR-MS``: MindSpore's THOR, ``tf_msopt.thor(model, learning_rate, damping=0.3,
  momentum=0.9, frequency=10)``, centred on the rate (0.05) of its best setting on
  ``convergence.py``'s MNIST-1D at batch 64 (its damping is that setting's too);
* ``Adam``: ``keras.optimizers.Adam``; ``Muon``: ``keras.optimizers.Muon`` (the output layer
  left to its AdamW step), centred on Adam's rates (Muon scales its step to Adam's RMS);
* ``LARS``: ``tf_msopt.LARS(SGD(momentum=0.9), coefficient=0.01)``.

First-order rates are centred per batch size: the task's ``rate_centres`` at batch 256,
times the square root of batch / 256 (the rule Adam's large-batch studies use; LARS too, as
it runs here without a warm-up).

Every run starts from the seed's initial weights and draws its batches in the seed's order.
Validation runs every ``--eval-every`` steps (one Keras "epoch" of ``fit``); a run stops at the
first validation that reaches the target, else after ``--max-steps``; a run whose validation
accuracy has stayed within 0.02 of the most frequent class's share for 10 validations in a row
has collapsed to a constant prediction, and stops there as a miss. Steps to target: the
steps up to that validation. Training time: the sum of the epochs' seconds up to it, each
timed by a Keras callback from ``on_epoch_begin`` to ``on_test_begin`` (the validation left
out; the first epoch counts ``fit``'s setup and tracing). A setting's figure is its median over
the seeds (a miss counts as infinite); each optimizer's best setting at a batch has the fewest
steps, then the least time. Seeds are rounds: in round ``r`` every batch size runs its
settings in order ``r`` of a balanced set of orders, so the machine's drift falls alike on all.

Critical batch size: the first measured batch from which the next one no longer cuts the
steps to target by at least 1.6x per doubling of the batch (2.56x for four times the batch);
">= B", the largest batch B, where every step up the measured batches still did.

    python benchmarks/batch_scaling.py [--task teacher|mnist1d] [--batches 64,256,1024,4096]
                                       [--seeds 0,1,2]
                                       [--optimizers THOR,THOR-MS,Adam,Muon,LARS]
                                       [--max-steps 1000] [--eval-every 10]
                                       [--save (or --out) results/batch_scaling_teacher.json]
    python benchmarks/batch_scaling.py --from results/batch_scaling_teacher.json
                                       [--optimizers NAMES] [--widen TIMES]
                                       [--rounds R] [--save FILE] [--plot f.svg]

``--widen TIMES`` runs, up to TIMES times, the rate 3x beyond each best point at an end of its
grid; ``--optimizers`` with ``--from`` measures those of the named optimizers the file does
not have yet, at its batches; ``--rounds R`` re-runs each batch's best settings and the
default THOR, R interleaved rounds of every seed, and the tables take their times from those
runs.
"""
import argparse
import json
import math
import os
import sys
from statistics import median

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from tf_msopt.compare import muon, without_data_autotuning  # noqa: E402
from convergence import (  # noqa: E402
    EpochTimer, StopAtTarget, load_mnist1d, make_mnist1d_model, to_target as epochs_to_target)
from timing import balanced_orders, machine  # noqa: E402

OPTIMIZERS = ("THOR", "THOR-MS", "Adam", "Muon", "LARS")
FIRST_ORDER = ("Adam", "Muon", "LARS")
NAMES_SHOWN = {"THOR-MS": "MindSpore's THOR"}
GRID = (1 / 3, 1.0, 3.0)
REFERENCE_BATCH = 256
# First-order grids are centred on the task's "rate_centres" at REFERENCE_BATCH, times
# RATE_SCALING's power of batch / REFERENCE_BATCH.
RATE_SCALING = {"THOR-MS": 0.0, "Adam": 0.5, "Muon": 0.5, "LARS": 0.5}
LARS_COEFFICIENT = 0.01
MINDSPORE_THOR = {"damping": 0.3, "momentum": 0.9, "frequency": 10}
# A run has collapsed when its validation accuracy stays within COLLAPSE_MARGIN of the most
# frequent class's share for COLLAPSE_PATIENCE validations in a row.
COLLAPSE_MARGIN, COLLAPSE_PATIENCE = 0.02, 10
DOUBLING_CUT = 1.6


# --- tasks

def make_teacher_data(task):
    """``(x_train, x_val, y_train, y_val)``: standard normal inputs labelled by a fixed random
    tanh network's argmax, those near a tie between two classes left out."""
    rng = np.random.default_rng(task["data_seed"])
    features, hidden = task["features"], task["teacher_hidden"]
    w1 = rng.normal(0.0, 1.0 / math.sqrt(features), (features, hidden))
    w2 = rng.normal(0.0, 3.0 / math.sqrt(hidden), (hidden, task["classes"]))
    n = task["train"] + task["validation"]
    x = rng.standard_normal((4 * n, features)).astype("float32")
    logits = np.tanh(x @ w1) @ w2
    top = np.sort(logits, axis=1)
    clear = top[:, -1] - top[:, -2] > task["margin"]
    x, y = x[clear][:n], np.argmax(logits[clear][:n], axis=1).astype("int32")
    n = task["train"]
    return x[:n], x[n:], y[:n], y[n:]


def make_teacher_student(task):
    """The MLP that learns the teacher's labels; it outputs logits."""
    return keras.Sequential([keras.Input((task["features"],)),
                             keras.layers.Dense(task["hidden"], activation="relu"),
                             keras.layers.Dense(task["hidden"], activation="relu"),
                             keras.layers.Dense(task["classes"])])


def make_mnist1d_data(task):
    """``task["samples"]`` MNIST-1D sequences generated by the ``mnist1d`` package (80% to
    train), the first ``task["validation"]`` of the rest to validate."""
    x_train, x_rest, y_train, y_rest = load_mnist1d(task["samples"])
    return x_train, x_rest[:task["validation"]], y_train, y_rest[:task["validation"]]


TASKS = {
    "teacher": {"title": "teacher-labelled MLP task", "target": 0.90, "data": make_teacher_data,
                "model": make_teacher_student, "logits": True, "features": 32,
                "teacher_hidden": 64, "classes": 10, "train": 131072, "validation": 8192,
                "margin": 0.5, "hidden": 256, "data_seed": 1234,
                "rate_centres": {"THOR-MS": 0.05, "Adam": 3e-3, "Muon": 3e-3, "LARS": 0.5}},
    "mnist1d": {"title": "MNIST-1D Conv1D, 102,400 training sequences", "target": 0.90,
                "data": make_mnist1d_data,
                "model": lambda task: make_mnist1d_model((40, 1), 10), "logits": False,
                "samples": 128000, "validation": 8192,
                "rate_centres": {"THOR-MS": 0.05, "Adam": 1e-2, "Muon": 1e-2, "LARS": 0.5}},
}


def task_record(task):
    """What a results file says of ``task``: its entries but the functions."""
    return {key: value for key, value in task.items() if not callable(value)}


def batches(x, y, batch, seed, steps):
    """The seed's first ``steps`` batches: passes over the data, each in a new random order
    (the tail that does not fill a batch left out)."""
    rng = np.random.default_rng(seed)
    per_pass = len(x) // batch
    order = np.concatenate([rng.permutation(len(x))[:per_pass * batch]
                            for _ in range(-(-steps // per_pass))]).reshape(-1, batch)[:steps]
    xs, ys = tf.constant(x), tf.constant(y)
    return tf.data.Dataset.from_tensor_slices(order).map(
        lambda i: (tf.gather(xs, i), tf.gather(ys, i))).prefetch(2)


# --- optimizers

def rate_centre(task, name, batch):
    if name == "THOR":
        return mso.thor.DEFAULTS["learning_rate"]
    return task["rate_centres"][name] * (batch / REFERENCE_BATCH) ** RATE_SCALING[name]


def shown(name):
    """``name`` as tables and plots show it."""
    return NAMES_SHOWN.get(name, name)


def make_optimizer(name, model, learning_rate):
    if name == "THOR":
        return mso.thor(model, learning_rate=learning_rate)
    if name == "THOR-MS":
        return mso.thor(model, learning_rate=learning_rate, **MINDSPORE_THOR)
    if name == "Adam":
        return keras.optimizers.Adam(learning_rate)
    if name == "Muon":
        return muon(model, learning_rate=learning_rate)
    if name == "LARS":
        return mso.LARS(keras.optimizers.SGD(learning_rate, momentum=0.9),
                        coefficient=LARS_COEFFICIENT)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def settings(task, optimizers, batch):
    """``[(optimizer, label, learning rate)]`` of every grid point at ``batch``; THOR's middle
    point is labelled ``default``."""
    out = []
    for name in optimizers:
        centre = rate_centre(task, name, batch)
        for scale in GRID:
            label = ("default" if name == "THOR" and scale == 1.0
                     else f"lr={centre * scale:.3g}")
            out.append((name, label, centre * scale))
    return out


# --- training

class StopWhenCollapsed(keras.callbacks.Callback):
    """Stops training once the validation accuracy has stayed within ``margin`` of ``chance``
    (the most frequent class's share) for ``patience`` validations in a row: the model
    predicts one class, as a diverged run does."""

    def __init__(self, chance, margin=COLLAPSE_MARGIN, patience=COLLAPSE_PATIENCE):
        super().__init__()
        self.ceiling, self.patience, self.low = chance + margin, patience, 0

    def on_epoch_end(self, epoch, logs=None):
        self.low = self.low + 1 if logs["val_accuracy"] <= self.ceiling else 0
        if self.low >= self.patience:
            self.model.stop_training = True


class TrainTimer(EpochTimer):
    """:class:`EpochTimer`'s seconds, each epoch's ending where its validation begins
    (``on_test_begin``): the validation left out."""

    def on_test_begin(self, logs=None):
        super().on_epoch_end(len(self.epoch_seconds))

    def on_epoch_end(self, epoch, logs=None):
        pass


def train(task, name, learning_rate, data, weights, batch, seed, max_steps, eval_every,
          target):
    """One run: ``{"val_accuracy": [...], "epoch_seconds": [...]}``, one entry per
    validation."""
    x_train, x_val, y_train, y_val = data
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    model = task["model"](task)
    model.set_weights(weights)
    model.compile(optimizer=make_optimizer(name, model, learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=task["logits"]),
                  metrics=["accuracy"])
    dataset = batches(x_train, y_train, batch, seed, max_steps)
    timer = TrainTimer()
    timer.fit_called()
    chance = np.bincount(y_val).max() / len(y_val)
    with without_data_autotuning():
        history = model.fit(dataset, epochs=max_steps // eval_every, steps_per_epoch=eval_every,
                            shuffle=False,
                            validation_data=(x_val, y_val), validation_batch_size=len(x_val),
                            verbose=0, callbacks=[timer, StopAtTarget(target),
                                                  StopWhenCollapsed(chance),
                                                  keras.callbacks.TerminateOnNaN()])
    return {"val_accuracy": [float(v) for v in history.history["val_accuracy"]],
            "epoch_seconds": [float(s) for s in timer.epoch_seconds]}


def to_target(run, target, eval_every):
    """(steps, seconds) to the first validation at ``target``; inf, inf if none."""
    validations, seconds = epochs_to_target(run, target)
    return validations * eval_every, seconds


def record(into, name, label, rate, steps, seconds, val_accuracy):
    """Appends one run's figures to ``into[name][label]``."""
    entry = into.setdefault(name, {}).setdefault(
        label, {"lr": rate, "steps": [], "seconds": [], "val_accuracy": []})
    entry["steps"].append(steps)
    entry["seconds"].append(seconds)
    entry["val_accuracy"].append(val_accuracy)


class Runner:
    """Trains one task's grid points from each seed's initial weights, recording each run."""

    def __init__(self, task, seeds, max_steps, eval_every, target):
        self.task, self.seeds, self.max_steps = task, seeds, max_steps
        self.eval_every, self.target = eval_every, target
        self.data = task["data"](task)
        self.weights = {}
        for seed in seeds:
            keras.utils.set_random_seed(seed)
            self.weights[seed] = task["model"](task).get_weights()

    def run(self, name, label, rate, batch, seed, into):
        """Trains ``name`` at ``rate``; appends its steps, seconds and accuracies to
        ``into[name][label]``."""
        run = train(self.task, name, rate, self.data, self.weights[seed], batch, seed,
                    self.max_steps, self.eval_every, self.target)
        steps, seconds = to_target(run, self.target, self.eval_every)
        record(into, name, label, rate, steps, seconds, run["val_accuracy"])
        print(f"seed {seed} batch {batch:<6}{name:<8}{label:<12}steps {steps!s:<6}"
              f"seconds {seconds:7.2f}  accuracy {run['val_accuracy'][-1]:.4f}", flush=True)


def measure(runner, batch_sizes, optimizers):
    """``{batch: {optimizer: {label: {"lr", "steps", "seconds", "val_accuracy"}}}}``, lists
    per seed; seeds are rounds, each batch's settings in a balanced order per round."""
    results = {str(batch): {} for batch in batch_sizes}
    for round_index, seed in enumerate(runner.seeds):
        for batch in batch_sizes:
            points = settings(runner.task, optimizers, batch)
            orders = balanced_orders(len(points))
            for case in orders[round_index % len(orders)]:
                name, label, rate = points[case]
                runner.run(name, label, rate, batch, seed, results[str(batch)])
    return results


def widen(runner, results, times=2):
    """Up to ``times`` times: where an optimizer's best setting at a batch is an end of its
    grid, runs the rate 3x beyond it (every seed) and adds it to ``results``."""
    for _ in range(times):
        beyond = []
        for batch, by_optimizer in results.items():
            for name, points in by_optimizer.items():
                label, steps, _ = best(points)
                if math.isfinite(steps) and on_edge(points, label):
                    rate = points[label]["lr"]
                    rate = rate * 3 if rate == max(p["lr"] for p in points.values()) else rate / 3
                    beyond.append((batch, name, rate))
        if not beyond:
            return
        for seed in runner.seeds:
            for batch, name, rate in beyond:
                runner.run(name, f"lr={rate:.3g}", rate, int(batch), seed, results[batch])


def retimed_cases(by_optimizer):
    """The settings a batch re-times: each optimizer's best where it reached the target, and
    the default THOR."""
    cases = [(name, label) for name, points in by_optimizer.items()
             for label, steps, _ in [best(points)] if math.isfinite(steps)]
    if "default" in by_optimizer.get("THOR", {}) and ("THOR", "default") not in cases:
        cases.append(("THOR", "default"))
    return cases


def retime(runner, results, rounds):
    """Runs :func:`retimed_cases` again, ``rounds`` times interleaved (round ``r`` takes each
    batch's cases in order ``r`` of a balanced set), every seed; returns them as
    :func:`measure` does, one entry per round and seed."""
    retimed = {batch: {} for batch in results}
    for round_index in range(rounds):
        for batch, by_optimizer in results.items():
            cases = retimed_cases(by_optimizer)
            orders = balanced_orders(len(cases))
            for case in orders[round_index % len(orders)]:
                name, label = cases[case]
                for seed in runner.seeds:
                    runner.run(name, label, by_optimizer[name][label]["lr"], int(batch), seed,
                               retimed[batch])
    return retimed


# --- scoring

def best(settings_of_optimizer):
    """(label, median steps, median seconds) of the setting with the fewest median steps,
    then the least median time."""
    label, r = min(settings_of_optimizer.items(),
                   key=lambda item: (median(item[1]["steps"]), median(item[1]["seconds"])))
    return label, median(r["steps"]), median(r["seconds"])


def on_edge(settings_of_optimizer, label):
    """Whether ``label``'s rate is the smallest or the largest of its grid."""
    rates = sorted(r["lr"] for r in settings_of_optimizer.values())
    return len(rates) > 1 and settings_of_optimizer[label]["lr"] in (rates[0], rates[-1])


def critical_batch(steps_by_batch, cut=DOUBLING_CUT):
    """The critical batch size of ``{batch: median steps}``, the batches where the target
    was reached (see the module's docstring), and whether it is only a lower bound (every
    step up the measured batches still paid)."""
    batch_sizes = sorted(steps_by_batch)
    for smaller, larger in zip(batch_sizes, batch_sizes[1:]):
        wanted = cut ** math.log2(larger / smaller)
        if steps_by_batch[smaller] / steps_by_batch[larger] < wanted:
            return smaller, False
    return batch_sizes[-1], True


def summary(results, retimed=None):
    """``{"batches": {batch: {"best": {optimizer: {...}}, "default THOR": {...},
    "ratios": {...}}}, "critical": {optimizer: {...}}}``: the steps of the grid's runs, the
    seconds of ``retimed``'s where it has the setting (:func:`retime`)."""
    out = {"batches": {}, "critical": {}}

    def seconds(batch, name, label, grid_seconds):
        again = (retimed or {}).get(batch, {}).get(name, {}).get(label)
        return median(again["seconds"]) if again else grid_seconds

    for batch, by_optimizer in results.items():
        row = {"best": {}}
        for name, points in by_optimizer.items():
            label, steps, grid_seconds = best(points)
            row["best"][name] = {"setting": label, "steps": steps,
                                 "seconds": seconds(batch, name, label, grid_seconds),
                                 "edge": on_edge(points, label)}
        if "THOR" in by_optimizer and "default" in by_optimizer["THOR"]:
            default = by_optimizer["THOR"]["default"]
            row["default THOR"] = {"steps": median(default["steps"]), "seconds": seconds(
                batch, "THOR", "default", median(default["seconds"]))}
            first = [row["best"][n] for n in FIRST_ORDER if n in row["best"]]
            if first:
                fewest = min(r["steps"] for r in first)
                fastest = min(r["seconds"] for r in first)
                row["ratios"] = {
                    "steps": row["default THOR"]["steps"] / fewest,
                    "seconds": row["default THOR"]["seconds"] / fastest,
                    "default_over_thor_best": (row["default THOR"]["steps"]
                                              / row["best"]["THOR"]["steps"])}
        out["batches"][batch] = row
    names = {name for row in out["batches"].values() for name in row["best"]}
    for name in sorted(names):
        steps = {int(b): row["best"][name]["steps"] for b, row in out["batches"].items()
                 if name in row["best"] and math.isfinite(row["best"][name]["steps"])}
        if len(steps) > 1:
            batch, lower_bound = critical_batch(steps)
            out["critical"][name] = {"batch": batch, "at_least": lower_bound}
    return out


def report(results, retimed=None):
    info = summary(results, retimed)
    for batch, row in info["batches"].items():
        for name, r in row["best"].items():
            edge = "  (on the edge of its grid)" if r["edge"] else ""
            print(f"batch {batch:<6}{name:<8} best {r['setting']:<12}"
                  f"steps {_show(r['steps']):>6}  seconds {r['seconds']:7.2f}{edge}")
        if "ratios" in row:
            ratios = row["ratios"]
            print(f"batch {batch:<6}default THOR / best first-order: steps "
                  f"{ratios['steps']:.2f}x, time {ratios['seconds']:.2f}x; "
                  f"default / THOR's best {ratios['default_over_thor_best']:.2f}x")
    for name, c in info["critical"].items():
        print(f"critical batch size of {name}: {'>= ' if c['at_least'] else ''}{c['batch']}")
    return info


def _show(value):
    return "miss" if not math.isfinite(value) else f"{value:g}"


def plot(payloads, path, description=None):
    """Steps and training seconds to the target against the batch, log-log, a row per results
    payload; an SVG is drawn the same, byte for byte, from the same results by the same
    matplotlib (``description`` goes into its metadata)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    with matplotlib.rc_context({"svg.hashsalt": "batch_scaling", "svg.fonttype": "none"}):
        figure, axes = plt.subplots(len(payloads), 2, figsize=(10, 3.6 * len(payloads)),
                                    squeeze=False)
        for row, payload in zip(axes, payloads):
            info = summary(payload["results"], payload.get("retimed"))
            batch_sizes = sorted(int(b) for b in info["batches"])
            rows = [info["batches"][str(b)] for b in batch_sizes]
            lines = ([(f"{shown(n)}, best", "-", [r["best"].get(n) for r in rows])
                      for n in OPTIMIZERS]
                     + [("default THOR", "--", [r.get("default THOR") for r in rows])])
            for label, style, points in lines:
                if not any(points):      # an optimizer this task did not run
                    continue
                points = [(b, r) for b, r in zip(batch_sizes, points)
                          if r and math.isfinite(r["steps"])]
                for axis, key in zip(row, ("steps", "seconds")):
                    axis.plot([b for b, _ in points], [r[key] for _, r in points], marker="o",
                              linestyle=style, label=label)
            for axis, key in zip(row, ("steps to target", "training seconds to target")):
                axis.set_xscale("log", base=2)
                axis.set_yscale("log")
                axis.set_xticks(batch_sizes, [f"{b:,}" for b in batch_sizes])
                axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                axis.yaxis.set_minor_formatter(ticker.NullFormatter())
                axis.set_xlabel("batch size")
                axis.set_ylabel(key)
                axis.set_title(payload["task"]["title"], fontsize="medium")
        axes[0][0].legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(path, metadata={"Date": None, "Description": description}
                       if path.endswith(".svg") else None)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="teacher", choices=sorted(TASKS))
    parser.add_argument("--batches", default="64,256,1024,4096")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--optimizers", help=f"default: {','.join(OPTIMIZERS)}; with --from, "
                        "those the file does not have yet are measured")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, help="default: the task's")
    parser.add_argument("--widen", type=int, default=0, metavar="TIMES",
                        help="widen a grid whose best rate is an end, up to TIMES times")
    parser.add_argument("--rounds", type=int, default=0,
                        help="re-time the best settings and the default THOR, interleaved")
    parser.add_argument("--save", "--out", dest="save",
                        help="the results file to write (or replace)")
    parser.add_argument("--from", dest="from_file", help="a results file to start from")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    if args.from_file:
        with open(args.from_file) as f:
            payload = json.load(f)
        code_task = TASKS[payload["task"]["name"]]
        task = {**code_task, **payload["task"], "rate_centres": {
            **code_task["rate_centres"], **payload["task"]["rate_centres"]}}
        payload["task"] = task_record(task)
        payload["rate_scaling"] = {**RATE_SCALING, **payload["rate_scaling"]}
        payload.setdefault("mindspore_thor", MINDSPORE_THOR)
        seeds, target = payload["seeds"], payload["target"]
        args.max_steps, args.eval_every = payload["max_steps"], payload["eval_every"]
        batch_sizes = list(payload["results"])
        optimizers = [n for n in (args.optimizers or "").split(",")    # those not measured yet
                      if n and not any(n in row for row in payload["results"].values())]
    else:
        task = {**TASKS[args.task], "name": args.task}
        seeds = [int(s) for s in args.seeds.split(",")]
        target = task["target"] if args.target is None else args.target
        payload = {"task": task_record(task), "target": target, "seeds": seeds,
                   "max_steps": args.max_steps, "eval_every": args.eval_every,
                   "grid": list(GRID), "rate_scaling": RATE_SCALING,
                   "lars_coefficient": LARS_COEFFICIENT, "mindspore_thor": MINDSPORE_THOR,
                   "thor_defaults": {k: v for k, v in mso.thor.DEFAULTS.items()
                                     if isinstance(v, (int, float, str, type(None)))},
                   "machine": machine(), "results": {}}
        batch_sizes = args.batches.split(",")
        optimizers = (args.optimizers or ",".join(OPTIMIZERS)).split(",")
    if optimizers or args.widen or args.rounds:
        runner = Runner(task, seeds, args.max_steps, args.eval_every, target)
        if optimizers:
            for batch, row in measure(runner, [int(b) for b in batch_sizes], optimizers).items():
                payload["results"].setdefault(batch, {}).update(row)
        widen(runner, payload["results"], args.widen)
        if args.rounds:
            payload["retimed"] = retime(runner, payload["results"], args.rounds)
            payload["rounds"] = args.rounds
    if args.save:
        with open(args.save, "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
    info = report(payload["results"], payload.get("retimed"))
    if args.plot:
        plot([payload], args.plot)
    print(json.dumps({"benchmark": "batch_scaling", "task": payload["task"]["name"],
                      "critical": info["critical"],
                      "ratios": {b: row.get("ratios") for b, row in info["batches"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
