"""Epochs and wall time to a target validation accuracy: THOR vs SGD-momentum, Adam, kfac-jax.

Four tasks (``--task``):

* ``mlp``: scikit-learn's digits, the ``tf-msopt compare`` MLP, target 0.97.
* ``cnn``: digits, the ``tf-msopt compare`` CNN, target 0.98.
* ``mnist1d``: MNIST-1D, generated locally by the ``mnist1d`` package's
  ``make_dataset`` with its default arguments and seed (42; 4000 training and 1000
  validation sequences of length 40; never its download path), a small Conv1D
  network (:func:`make_mnist1d_model`), target 0.90 (see ``TASKS``).
* ``transformer``: the same MNIST-1D data, a one-block transformer
  (:func:`make_mnist1d_transformer`: MultiHeadAttention, LayerNormalization, a Dense
  feed-forward), target 0.85.

Every optimizer gets its own grid of settings (learning rates; THOR and kfac-jax:
learning rate x damping) on the same model, data, initial weights and batches,
and every setting runs with several seeds (a digits seed draws its own
train/validation split; every seed draws its own initial weights and batch
order). THOR runs in several configurations (``THOR_CONFIGS``): MindSpore's
update (``THOR``) and the opt-in options of :class:`tf_msopt.THOR` that the docs
recommend. A run stops at the first epoch whose validation accuracy reaches the
target. A setting is scored by its median over the seeds of the epochs and of the
wall time to the target (a run that never reaches it counts as infinite), and
each optimizer by its best setting; a best setting on the edge of its grid is
flagged (the grid should be widened). Wall time is the sum of the epochs' times
up to the target, each timed by a Keras callback from ``on_epoch_begin`` to
``on_epoch_end`` (validation included; the first epoch includes tracing, as a user
of ``fit`` sees it, and ``fit``'s setup before ``on_train_begin``); not around
``fit``, which can return seconds after the last epoch. When ``kfac_jax`` is
importable, the same models are also trained with kfac-jax
(``benchmarks/kfac_jax_baseline.py``, whose docstring gives the install line), timed
the same way.

    python benchmarks/convergence.py [--task mlp,cnn,mnist1d,transformer] [--optimizers THOR,Adam]
                                     [--seeds 0,1,2] [--max-epochs 25] [--batch-size 64]
                                     [--frequency F] [--save results.json]
                                     [--rounds R] [--plot convergence.png]
    python benchmarks/convergence.py --from results/a.json results/b.json [--plot ...]
                                     [--rounds R [--optimizers A,B] --save retimed.json]

``--save`` (or ``--out``) writes every run (per seed: epochs and seconds to the target,
the validation accuracy and time of every epoch) to a JSON file, replacing it; ``--from`` reads one
or more such files instead of training (later files replace the same optimizer's
runs of the same task) and tabulates them. Prints every run, a table of the best
settings per task, the ratios of each THOR configuration to the best first-order
optimizer (target: <= 0.5x the epochs and < 1x the wall time) and to kfac-jax
(target: <= 1x the epochs), writes a plot and prints one JSON line. It also says
whether the epochs target is within reach of each grid at all: the per-seed best
validation accuracy that any setting reaches within half the best first-order epochs
bounds every setting, so a median of those below the target means no setting of that
grid can meet it.

``--rounds R`` then runs each optimizer's best setting (of the grids just run, or of the
``--from`` files, there only those of ``--optimizers`` if given) R more times, interleaved
(round ``r`` in order ``r`` of a balanced set of orders, as the step benchmarks do), and compares
THOR's median seconds with the best first-order optimizer's from those rounds: the grid
runs one optimizer after another, so a machine that drifts during the run (a shared one
can, by 10-20%) moves their seconds apart; the rounds share the drift.
"""
import argparse
import json
import math
import os
import platform
import random
import sys
import time
from statistics import median

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from tf_msopt.compare import first_reaching, load_digits_split, make_model, prepare  # noqa: E402
from timing import balanced_orders  # noqa: E402

TASKS = {  # name -> data set, target validation accuracy
    "mlp": {"data": "digits", "target": 0.97, "title": "digits MLP"},
    "cnn": {"data": "digits", "target": 0.98, "title": "digits CNN"},
    "mnist1d": {"data": "mnist1d", "target": 0.90, "title": "MNIST-1D Conv1D"},
    "transformer": {"data": "mnist1d", "target": 0.85, "title": "MNIST-1D transformer"},
}
DEFAULT_TARGETS = {task: spec["target"] for task, spec in TASKS.items()}
FIRST_ORDER = ("SGD-momentum", "Adam")
MNIST1D_SEED = 42          # mnist1d's own default: one fixed data set for every run

# THOR configurations: keyword arguments of tf_msopt.thor on top of learning rate,
# damping, momentum 0.9 and frequency. "THOR" is MindSpore's update; "THOR-pi" its
# damping split by the factors' traces; "THOR-sampled" the sampled Fisher with moving
# averages of the statistics ("THOR-sampled-s2" the same with statistics every second
# step); "THOR-klclip" all the options K-FAC libraries use together (pi damping, sampled
# Fisher, moving averages, KL clip); "THOR-expand" the sampled Fisher with moving averages
# and G summed over a kernel's positions per example (weight_sharing="expand").
THOR_CONFIGS = {
    "THOR": {},
    "THOR-pi": {"damping_mode": "pi"},
    "THOR-sampled": {"fisher": "sampled", "statistics_decay": 0.95},
    "THOR-sampled-s2": {"fisher": "sampled", "statistics_decay": 0.95,
                        "statistics_frequency": 2},
    "THOR-klclip": {"damping_mode": "pi", "fisher": "sampled", "statistics_decay": 0.95,
                    "kl_clip": 1e-3},
    "THOR-expand": {"fisher": "sampled", "statistics_decay": 0.95, "weight_sharing": "expand"},
}
# (learning rates, dampings) per THOR configuration and task, or a list of them where a
# grid was widened around a best setting on its edge: the settings are their union, as run
# for docs/performance.md. The best setting should sit inside its grid, not on an edge. A
# configuration without an entry for a task is not run on it.
THOR_GRIDS = {
    "THOR": {"mlp": ((0.03, 0.05, 0.1), (1.0, 3.0, 10.0)),
             "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1)),
             "mnist1d": [((0.02, 0.03, 0.05), (0.3, 1.0, 3.0)), ((0.03,), (0.03, 0.1)),
                         ((0.1, 0.3), (0.03, 0.1, 0.3))],
             "transformer": [((0.003, 0.01, 0.03), (0.03, 0.1, 0.3)), ((0.1,), (0.1, 0.3, 1.0)),
                             ((0.03,), (1.0,))]},
    "THOR-pi": {"mlp": [((0.03, 0.05, 0.1), (0.3, 1.0, 3.0, 10.0)),
                        ((0.01, 0.02, 0.03), (0.03, 0.1, 0.3))],
                "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1, 0.2, 0.3)),
                "mnist1d": [((0.02, 0.03, 0.05), (0.3, 1.0, 3.0)), ((0.03,), (0.03, 0.1)),
                            ((0.1, 0.3), (0.03, 0.1, 0.3))]},
    "THOR-sampled": {"mlp": ((0.03, 0.05, 0.1), (0.3, 1.0, 3.0, 10.0)),
                     "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1, 0.2, 0.3)),
                     "mnist1d": [((0.01, 0.02, 0.03), (0.03, 0.1, 0.3)),
                                 ((0.005, 0.01, 0.02), (0.01, 0.03, 0.1)),
                                 ((0.0025, 0.005, 0.01), (0.003, 0.01, 0.03))],
                     "transformer": [((0.003, 0.01, 0.03), (0.01, 0.03, 0.1)),
                                     ((0.0003, 0.001, 0.003), (0.001, 0.003, 0.01))]},
    "THOR-sampled-s2": {"mlp": ((0.03, 0.05, 0.1), (0.3, 1.0, 3.0)),
                        "cnn": ((0.01, 0.02, 0.03), (0.03, 0.05, 0.1)),
                        "mnist1d": [((0.005, 0.01, 0.02), (0.01, 0.03, 0.1)),
                                    ((0.000625, 0.00125, 0.0025, 0.005), (0.001, 0.003, 0.01)),
                                    ((0.0003125, 0.000625), (0.0003, 0.001))]},
    "THOR-klclip": {"mlp": ((0.02, 0.03, 0.05), (0.03, 0.1, 0.3)),
                    "cnn": [((0.01, 0.02, 0.03), (0.05, 0.1, 0.2)),
                            ((0.005, 0.01, 0.02), (0.03, 0.05, 0.2))],
                    "mnist1d": ((0.005, 0.01, 0.02, 0.03, 0.05), (0.01, 0.03, 0.1)),
                    "transformer": [((0.01, 0.03, 0.1), (0.01, 0.03, 0.1)),
                                    ((0.003, 0.01, 0.03), (0.1, 0.3, 1.0))]},
    # The MLP has no shared positions: THOR-expand is THOR-sampled there.
    "THOR-expand": {"mlp": ((0.03, 0.05, 0.1), (0.3, 1.0, 3.0)),
                    "cnn": ((0.0003, 0.001, 0.003), (0.0003, 0.001, 0.003)),
                    "mnist1d": [((0.0025, 0.005, 0.01), (0.003, 0.01, 0.03)),
                                ((0.00125, 0.0025, 0.005), (0.001, 0.003, 0.01))],
                    "transformer": [((0.001, 0.003, 0.01), (0.003, 0.01, 0.03)),
                                    ((0.03,), (0.01, 0.03, 0.1)), ((0.003, 0.01), (0.1,))]},
}
# kfac-jax's (learning rates, dampings) per task, as THOR_GRIDS (its damping is not THOR's;
# see benchmarks/kfac_jax_baseline.py). How they were found:
# - mlp: at batch 64 the best setting is the middle one, lr=0.03 damping=0.3; at batch 256
#   it is lr=0.1 damping=0.1, where the settings beyond it (lr 0.3, or damping 0.03) diverge
#   without a norm constraint.
# - cnn: probed on seed 0, target 0.98, 15 epochs at most. Only lr=0.03 damping=0.1, the
#   middle setting, reached it (epoch 5); lr 0.02 with damping 0.05 or 0.1, lr 0.03 damping
#   0.2 and lr 0.05 damping 0.2 level off at 0.97-0.978; lr 0.03 damping 0.05 and lr 0.05
#   damping 0.1 diverge. So 0.98 is barely within kfac-jax's reach on this split. Outside
#   the grid: lr 0.01 (damping 0.03 or 0.1) and lr 0.03 damping 0.3 level off at 0.97, lr
#   0.1 (damping 0.1 or 0.3) and lr 0.03 damping 0.03 diverge or oscillate.
# - mnist1d: over lr 0.01-0.1 x damping 0.1-1.0 the best was a corner (lr=0.01 damping=0.1,
#   6 epochs); widened towards smaller values four times, the best is lr=0.003 damping=0.01
#   (4, 3, 4 epochs), inside.
# - transformer: over lr 0.003-0.03 x damping 0.01-0.1 the best was a corner (lr=0.003
#   damping=0.01, 5 epochs; lr 0.03 diverged below damping 0.1); widened towards smaller
#   values four times: 4 epochs along a ridge from lr=0.001 damping=0.003 to lr=0.0003
#   damping=0.0001, none fewer; damping 0.00003 and lr 0.0001 miss on two seeds.
KFAC_JAX_GRIDS = {
    "mlp": ((0.01, 0.03, 0.1), (0.1, 0.3, 1.0)),
    "cnn": ((0.02, 0.03, 0.05), (0.05, 0.1, 0.2)),
    "mnist1d": [((0.01, 0.03, 0.1), (0.1, 0.3, 1.0)), ((0.003,), (0.003, 0.01, 0.03, 0.1, 0.3)),
                ((0.01, 0.03), (0.01, 0.03)), ((0.001,), (0.003, 0.01, 0.03)),
                ((0.01,), (0.003,))],
    "transformer": [((0.003, 0.01, 0.03), (0.01, 0.03, 0.1)), ((0.001, 0.003), (0.003,)),
                    ((0.001,), (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03)),
                    ((0.0003,), (0.00003, 0.0001, 0.0003, 0.001, 0.003)),
                    ((0.0001,), (0.0001, 0.0003))],
}
FIRST_ORDER_RATES = {  # nine learning rates per optimizer and task
    "SGD-momentum": {"mlp": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "cnn": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "mnist1d": (0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),
                     "transformer": (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3)},
    "Adam": {"mlp": (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "cnn": (1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "mnist1d": (3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 3e-2),
             "transformer": (5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2)},
}
OPTIMIZERS = (*THOR_CONFIGS, *FIRST_ORDER, "kfac-jax")


# --- data and models

def load_mnist1d():
    """MNIST-1D from ``mnist1d.data.make_dataset`` (generated here, seed 42, no download):
    ``(x_train, x_val, y_train, y_val)``, x of shape (n, 40, 1), float32."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = MNIST1D_SEED
    py_state, np_state = random.getstate(), np.random.get_state()
    try:   # make_dataset seeds Python's and NumPy's global generators
        data = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return (data["x"].astype("float32")[..., None], data["x_test"].astype("float32")[..., None],
            data["y"].astype("int32"), data["y_test"].astype("int32"))


_MNIST1D = None


def load_task(task, seed):
    """``(x_train, x_val, y_train, y_val)`` of ``task`` for ``seed`` (digits: a split per
    seed; MNIST-1D: one fixed data set)."""
    global _MNIST1D
    if TASKS[task]["data"] == "digits":
        return prepare(task, load_digits_split(seed))
    if _MNIST1D is None:
        _MNIST1D = load_mnist1d()
    return _MNIST1D


def make_mnist1d_model(input_shape, classes):
    """(40, 1) -> Conv1D(32, 5, same, relu) -> Conv1D(32, 3, stride 2, same, relu)
    -> Conv1D(32, 3, stride 2, same, relu) -> Flatten -> Dense(64, relu) -> Dense(10)."""
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv1D(32, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv1D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(classes, activation="softmax"),
    ])


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position (THOR leaves it to first order, as any layer
    without a curvature block)."""

    def build(self, input_shape):
        self.position = self.add_weight(shape=input_shape[1:], initializer="random_normal",
                                        name="position")

    def call(self, inputs):
        return inputs + self.position


def make_mnist1d_transformer(input_shape, classes):
    """(40, 1) -> Conv1D(32, 4, stride 2) tokens (20) + learned positions -> one pre-norm
    block (LayerNormalization, MultiHeadAttention 2 heads of 16, residual;
    LayerNormalization, Dense(64, gelu), Dense(32), residual) -> LayerNormalization
    -> GlobalAveragePooling1D -> Dense(10)."""
    inputs = keras.Input(input_shape)
    x = PositionEmbedding()(keras.layers.Conv1D(32, 4, strides=2, padding="same")(inputs))
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.MultiHeadAttention(num_heads=2, key_dim=16)(h, h)
    h = keras.layers.Dense(64, activation="gelu")(keras.layers.LayerNormalization()(x))
    x = x + keras.layers.Dense(32)(h)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(x))
    return keras.Model(inputs, keras.layers.Dense(classes, activation="softmax")(x))


def build_model(task, input_shape, classes):
    if task == "mnist1d":
        return make_mnist1d_model(input_shape, classes)
    if task == "transformer":
        return make_mnist1d_transformer(input_shape, classes)
    return make_model(task, input_shape, classes)


# --- optimizers

def thor_factory(config, lr, damping, frequency, seed):
    kwargs = dict(THOR_CONFIGS[config])
    if kwargs.get("fisher") == "sampled":
        kwargs["seed"] = seed
    # Inverses on a statistics step: the next multiple of statistics_frequency.
    every = kwargs.get("statistics_frequency", 1)
    frequency = -(-frequency // every) * every
    return lambda model: mso.thor(model, learning_rate=lr, damping=damping, momentum=0.9,
                                  frequency=frequency, **kwargs)


def grid_settings(products):
    """The sorted (learning rate, damping) pairs of a product, or of a list of products."""
    return sorted({(lr, damping) for learning_rates, dampings in
                   (products if isinstance(products, list) else [products])
                   for lr in learning_rates for damping in dampings})


def grids(task, frequency):
    """Optimizer name -> list of (setting label, params, factory(seed) -> factory(model))."""
    out = {}
    for config in THOR_CONFIGS:
        products = THOR_GRIDS[config].get(task)
        if products is None:     # not run on this task
            continue
        out[config] = [(f"lr={lr} damping={damping}", {"lr": lr, "damping": damping},
                        lambda seed, config=config, lr=lr, damping=damping:
                        thor_factory(config, lr, damping, frequency, seed))
                       for lr, damping in grid_settings(products)]
    out["SGD-momentum"] = [(f"lr={lr}", {"lr": lr},
                            lambda seed, lr=lr: lambda model: keras.optimizers.SGD(
                                lr, momentum=0.9))
                           for lr in FIRST_ORDER_RATES["SGD-momentum"][task]]
    out["Adam"] = [(f"lr={lr}", {"lr": lr},
                    lambda seed, lr=lr: lambda model: keras.optimizers.Adam(lr))
                   for lr in FIRST_ORDER_RATES["Adam"][task]]
    return out


# --- training

class StopAtTarget(keras.callbacks.Callback):
    """Ends training at the first epoch whose validation accuracy reaches ``target``."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def on_epoch_end(self, epoch, logs=None):
        if (logs or {}).get("val_accuracy", 0.0) >= self.target:
            self.model.stop_training = True


class EpochTimer(keras.callbacks.Callback):
    """Seconds of each epoch, from ``on_epoch_begin`` to ``on_epoch_end`` (validation and,
    in the first epoch, tracing included). Call :meth:`fit_called` just before ``fit``: the
    first epoch then also counts ``fit``'s setup up to ``on_train_begin`` (where Keras, or
    THOR's ``connect``, may build the model's state before tracing)."""

    def fit_called(self):
        self._fit_called = time.perf_counter()

    def on_train_begin(self, logs=None):
        self.epoch_seconds = []
        self._setup = time.perf_counter() - self._fit_called

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        self.epoch_seconds.append(seconds + (self._setup if epoch == 0 else 0.0))


def train_keras(task, factory, data, initial_weights, epochs, batch_size, seed, target):
    """One run; returns ``{"val_accuracy": [...], "epoch_seconds": [...]}`` per epoch."""
    x_train, x_val, y_train, y_val = data
    # Untimed: the earlier runs' models and traced functions are freed here, not by a
    # garbage collection inside this run's epochs (as a run in a fresh process would).
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    model = build_model(task, x_train.shape[1:], int(max(y_train.max(), y_val.max())) + 1)
    model.set_weights(initial_weights)
    model.compile(optimizer=factory(model), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    timer = EpochTimer()   # first, so that its on_epoch_end runs before the others'
    timer.fit_called()
    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
                        validation_data=(x_val, y_val), verbose=0,
                        callbacks=[timer, StopAtTarget(target)])
    return {"val_accuracy": [float(v) for v in history.history["val_accuracy"]],
            "epoch_seconds": timer.epoch_seconds}


def to_target(history, target):
    """(epochs, seconds) until the validation accuracy first reaches ``target``; inf if
    never. Seconds: the sum of ``epoch_seconds`` up to that epoch, or ``seconds[epoch]``
    when the history has cumulative ``seconds`` instead."""
    reached = first_reaching(history["val_accuracy"], target)
    if reached is None:
        return math.inf, math.inf
    if "epoch_seconds" in history:
        return reached + 1, float(sum(history["epoch_seconds"][:reached + 1]))
    return reached + 1, history["seconds"][reached]


def kfac_jax_runs(task, target):
    """kfac-jax's (label, params, train(data, initial, epochs, batch, seed)) settings, or []
    when kfac_jax is not importable or does not cover ``task``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import kfac_jax_baseline
    except ImportError as err:
        print(f"kfac-jax not run: {err}")
        return []
    if task not in kfac_jax_baseline.MODELS:
        print(f"kfac-jax not run: kfac_jax_baseline has no {task!r} model")
        return []
    return [(f"lr={lr} damping={damping}", {"lr": lr, "damping": damping},
             lambda data, initial, epochs, batch, seed, lr=lr, damping=damping:
             kfac_jax_baseline.train_kfac_jax(task, data, initial, epochs, batch, seed,
                                              learning_rate=lr, damping=damping, target=target))
            for lr, damping in grid_settings(KFAC_JAX_GRIDS[task])]


def _prepare(task, seeds, batch_size):
    """Each seed's data and initial weights, and the steps of an epoch."""
    splits = {seed: load_task(task, seed) for seed in seeds}
    initial = {}
    for seed, data in splits.items():
        keras.utils.set_random_seed(seed)
        classes = int(max(data[2].max(), data[3].max())) + 1
        initial[seed] = build_model(task, data[0].shape[1:], classes).get_weights()
    return splits, initial, -(-len(splits[seeds[0]][0]) // batch_size)


def _runners(task, target, frequency, optimizers):
    """``{optimizer: [(setting label, params, train(data, weights, epochs, batch, seed))]}``."""
    runners = {}
    for name, settings in grids(task, frequency).items():
        runners[name] = [
            (label, params,
             lambda data, weights, epochs, batch, seed, make=make: train_keras(
                 task, make(seed), data, weights, epochs, batch, seed, target))
            for label, params, make in settings]
    if not optimizers or "kfac-jax" in optimizers:
        kfac = kfac_jax_runs(task, target)
        if kfac:
            runners["kfac-jax"] = kfac
    return {name: r for name, r in runners.items() if not optimizers or name in optimizers}


def _train_seeds(train, splits, initial, max_epochs, batch_size, seeds, target):
    histories = [train(splits[seed], initial[seed], max_epochs, batch_size, seed)
                 for seed in seeds]
    epochs, seconds = zip(*(to_target(h, target) for h in histories))
    return histories, list(epochs), list(seconds)


def run(task, target, seeds, max_epochs, batch_size, frequency=None, optimizers=None,
        progress=None):
    """``({optimizer: {setting: {"params", "epochs", "seconds", "val_accuracy",
    "epoch_seconds"}}}, THOR's frequency)``, each list one entry per seed.
    ``progress(results, frequency)`` is called after every setting."""
    splits, initial, steps_per_epoch = _prepare(task, seeds, batch_size)
    frequency = frequency or max(2, steps_per_epoch // 2)   # THOR: new inverses twice an epoch
    results = {}
    for name, settings in _runners(task, target, frequency, optimizers).items():
        results[name] = {}
        for label, params, train in settings:
            histories, epochs, seconds = _train_seeds(train, splits, initial, max_epochs,
                                                      batch_size, seeds, target)
            results[name][label] = {
                "params": params, "epochs": epochs, "seconds": seconds,
                "val_accuracy": [h["val_accuracy"] for h in histories],
                "epoch_seconds": [_epoch_seconds(h) for h in histories]}
            print(f"{task:<8}{name:<17}{label:<26}epochs to {target:g} per seed: "
                  f"{' '.join(_show(e) for e in epochs):<12} median {_show(median(epochs)):>4}"
                  f"   seconds median {median(seconds):6.2f}", flush=True)
            if progress:
                progress(results, frequency)
    return results, frequency


def retime(task, target, seeds, max_epochs, batch_size, frequency, results, rounds):
    """Runs each optimizer's best setting in ``results`` (those that reach the target) again,
    ``rounds`` times, interleaved: round ``r`` takes the optimizers in order ``r`` of a
    balanced set of orders, so that the machine's drift during a run, and whatever one run leaves
    behind, fall on every optimizer alike. Returns ``{optimizer: {"setting", "epochs",
    "seconds"}}``, one list of per-seed values per round."""
    best = {name: label for name, (label, epochs, _) in best_settings(results).items()
            if math.isfinite(epochs)}
    if not best:
        return {}
    runners = _runners(task, target, frequency, list(best))
    trains = {name: next(train for label, _, train in runners[name] if label == best[name])
              for name in best}
    splits, initial, _ = _prepare(task, seeds, batch_size)
    names = list(best)
    out = {name: {"setting": best[name], "epochs": [], "seconds": []} for name in names}
    orders = balanced_orders(len(names))
    for round_index in range(rounds):
        for case in orders[round_index % len(orders)]:
            name = names[case]
            _, epochs, seconds = _train_seeds(trains[name], splits, initial, max_epochs,
                                              batch_size, seeds, target)
            out[name]["epochs"].append(epochs)
            out[name]["seconds"].append(seconds)
            print(f"{task:<8}round {round_index + 1}/{rounds} {name:<17}{best[name]:<26}"
                  f"epochs {' '.join(_show(e) for e in epochs):<12} seconds median "
                  f"{median(seconds):6.2f}", flush=True)
    return out


def _epoch_seconds(history):
    if "epoch_seconds" in history:
        return [float(s) for s in history["epoch_seconds"]]
    cumulative = history["seconds"]
    return [float(b - a) for a, b in zip([0.0, *cumulative[:-1]], cumulative)]


# --- scoring

def best_settings(results):
    """{optimizer: (setting label, median epochs, median seconds)}: fewest epochs, then time."""
    best = {}
    for name, settings in results.items():
        label, r = min(settings.items(),
                       key=lambda item: (median(item[1]["epochs"]), median(item[1]["seconds"])))
        best[name] = (label, median(r["epochs"]), median(r["seconds"]))
    return best


def edge_of_grid(settings, label):
    """The grid axes (``"lr"``, ``"damping"``) on whose edge setting ``label`` lies: its value is
    the smallest or largest of that axis among the settings. [] inside the grid (or when a
    setting has no ``params``)."""
    params = settings[label].get("params")
    if not params:
        return []
    edges = []
    for axis, value in params.items():
        values = sorted({s["params"][axis] for s in settings.values() if "params" in s})
        if len(values) > 1 and value in (values[0], values[-1]):
            edges.append(axis)
    return edges


def ratios(best):
    """Per THOR configuration: its median epochs and seconds over the best first-order
    optimizer's (fewest epochs; least seconds) and its epochs over kfac-jax's."""
    first_order = [best[name] for name in FIRST_ORDER
                   if name in best and math.isfinite(best[name][1])]
    out = {}
    for name, (_, epochs, seconds) in best.items():
        if not name.startswith("THOR") or not math.isfinite(epochs):
            continue
        found = {}
        if first_order:
            found["epochs_vs_best_first_order"] = epochs / min(b[1] for b in first_order)
            found["seconds_vs_best_first_order"] = seconds / min(b[2] for b in first_order)
        if "kfac-jax" in best and math.isfinite(best["kfac-jax"][1]):
            found["epochs_vs_kfac_jax"] = epochs / best["kfac-jax"][1]
        if found:
            out[name] = found
    return out


def best_accuracy_by_epoch(settings, epochs):
    """Per seed, the best validation accuracy any setting of ``settings`` reaches within its
    first ``epochs`` epochs: a bound on every setting of the grid (a run stopped at the
    target counts its last accuracy)."""
    seeds = len(next(iter(settings.values()))["val_accuracy"])
    return [max(max(r["val_accuracy"][seed][:epochs], default=0.0) for r in settings.values())
            for seed in range(seeds)]


def epochs_for_half(best):
    """The most epochs that still meet the "<= 0.5x the best first-order optimizer" target,
    or None when no first-order optimizer reached the target."""
    epochs = [best[name][1] for name in FIRST_ORDER if name in best]
    finite = [e for e in epochs if math.isfinite(e)]
    return int(min(finite) // 2) if finite else None


TARGETS = (("epochs_vs_best_first_order", "<= 0.5x", lambda r: r <= 0.5),
           ("seconds_vs_best_first_order", "< 1x", lambda r: r < 1.0),
           ("epochs_vs_kfac_jax", "<= 1x", lambda r: r <= 1.0))


def _show(value):
    return "-" if math.isinf(value) else f"{value:g}"


def _json_number(value):
    return None if math.isinf(value) else round(value, 4)


def _from_json(value):
    return math.inf if value is None else value


# --- results files

def save_results(path, tasks):
    """Writes ``{"benchmark": "convergence", "tasks": {task: {..., "runs": ...}}}``; a run
    that never reached the target has ``null`` epochs and seconds."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"benchmark": "convergence", "tasks": {}}
    for task, info in tasks.items():
        runs = {name: {label: {**r, "epochs": [_json_number(e) for e in r["epochs"]],
                               "seconds": [_json_number(s) for s in r["seconds"]]}
                       for label, r in settings.items()}
                for name, settings in info["runs"].items()}
        payload["tasks"][task] = {**info, "runs": runs}
        if "retimed" in info:
            payload["tasks"][task]["retimed"] = _map_retimed(info["retimed"], _json_number)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def _map_retimed(retimed, convert):
    """:func:`retime`'s result with ``convert`` applied to every epoch count and time."""
    return {name: {**r, **{key: [[convert(value) for value in row] for row in r[key]]
                           for key in ("epochs", "seconds")}}
            for name, r in retimed.items()}


def load_results(paths):
    """Merges files written by :func:`save_results`: ``{task: info}``; a later file replaces
    an earlier one's runs of the same optimizer and task (settings are merged)."""
    tasks = {}
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        for task, info in payload["tasks"].items():
            merged = tasks.setdefault(task, {**info, "runs": {}})
            for key in ("target", "seeds", "batch_size", "max_epochs", "thor_frequency"):
                if key in info and merged.get(key) != info[key]:
                    if key in ("target", "batch_size"):
                        raise ValueError(f"{path}: {task} {key} {info[key]} differs from "
                                         f"{merged.get(key)} of an earlier file")
            merged.setdefault("sources", []).append(os.path.basename(path))
            if "retimed" in info:     # the latest file's re-timing
                merged["retimed"] = _map_retimed(info["retimed"], _from_json)
            for name, settings in info["runs"].items():
                merged["runs"].setdefault(name, {}).update({
                    label: {**r, "epochs": [_from_json(e) for e in r["epochs"]],
                            "seconds": [_from_json(s) for s in r["seconds"]]}
                    for label, r in settings.items()})
    return tasks


# --- report

def report(tasks, plot=None):
    """Prints the tables and targets of every task; returns the summary for the JSON line."""
    summary = {}
    for task, info in tasks.items():
        target, results = info["target"], info["runs"]
        order = _ordered(results)
        best = best_settings({name: results[name] for name in order})
        print(f"\n{TASKS.get(task, {}).get('title', task)}, target val acc {target:g}, seeds "
              f"{info.get('seeds')}, THOR frequency {info.get('thor_frequency')}: best setting "
              f"of each optimizer")
        print(f"| optimizer | best setting | epochs per seed | median epochs | "
              f"median seconds | grid |")
        print("| --- | --- | --- | --- | --- | --- |")
        edges = {}
        for name in order:
            label, epochs, seconds = best[name]
            r = results[name][label]
            edge = edge_of_grid(results[name], label) if math.isfinite(epochs) else []
            edges[name] = edge
            where = (f"**edge** ({', '.join(edge)}) of {len(results[name])}" if edge
                     else f"inside, {len(results[name])} settings")
            seconds_text = "-" if math.isinf(seconds) else f"{seconds:.2f}"
            print(f"| {name} | {label} | {', '.join(_show(e) for e in r['epochs'])} | "
                  f"{_show(epochs)} | {seconds_text} | {where} |")
        for name, edge in edges.items():
            if edge:
                print(f"WARNING {task}: {name}'s best setting {best[name][0]} is on the edge of "
                      f"its grid ({', '.join(edge)}): widen the grid")
        found = ratios(best)
        for name, r in found.items():
            parts = []
            for key, limit, ok in TARGETS:
                if key in r:
                    parts.append(f"{key} {r[key]:.2f}x (target {limit}: "
                                 f"{'meets' if ok(r[key]) else 'MISSES'})")
            print(f"{name}: " + "; ".join(parts))
        if not found:
            print("every THOR configuration missed the target, or nothing to compare with")
        within = epochs_for_half(best)
        reach = {}
        if within:
            # Whether the epochs target is within reach of the grid at all: no setting can
            # beat the per-seed best of all settings.
            reach = {name: best_accuracy_by_epoch(results[name], within) for name in order}
            print(f"<= 0.5x the best first-order epochs means {target:g} within {within} "
                  f"epoch(s); the best validation accuracy any setting reaches by then, per "
                  f"seed (a bound on every setting of the grid):")
            for name, values in reach.items():
                verdict = "within reach" if median(values) >= target else "out of reach"
                print(f"  {name}: {', '.join(f'{v:.3f}' for v in values)} "
                      f"(median {median(values):.3f}: {verdict})")
        retimed = report_retimed(info["retimed"]) if info.get("retimed") else None
        summary[task] = {
            "target": target, "seeds": info.get("seeds"),
            "thor_frequency": info.get("thor_frequency"),
            "best": {name: {"setting": label, "median_epochs": _json_number(epochs),
                            "median_seconds": _json_number(seconds),
                            "edge_of_grid": edges[name]}
                     for name, (label, epochs, seconds) in best.items()},
            "ratios": {name: {k: round(v, 3) for k, v in r.items()} for name, r in found.items()},
            "best_accuracy_by_epoch": ({"epochs": within, **{
                name: [round(v, 4) for v in values] for name, values in reach.items()}}
                if reach else None),
            "retimed": retimed,
        }
    if plot:
        print(f"plot saved to {plot_best(tasks, plot)}")
    return summary


def retimed_seconds(retimed):
    """``{optimizer: (median seconds of each round, their median)}``; a round's seconds are
    the median over its seeds."""
    out = {}
    for name, r in retimed.items():
        per_round = [median(seconds) for seconds in r["seconds"]]
        out[name] = (per_round, median(per_round))
    return out


def report_retimed(retimed):
    """Prints the re-timed best settings and THOR's seconds against the best first-order
    optimizer's; returns them for the JSON line."""
    seconds = retimed_seconds(retimed)
    rounds = len(next(iter(retimed.values()))["seconds"])
    print(f"Re-timed: each best setting again in {rounds} interleaved rounds (a balanced "
          f"order per round); seconds: the median over the seeds of a round, then over the "
          f"rounds")
    print("| optimizer | setting | epochs per seed, each round | seconds per round | "
          "median seconds |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in retimed.items():
        per_round, overall = seconds[name]
        epochs = "; ".join(", ".join(_show(e) for e in row) for row in r["epochs"])
        print(f"| {name} | {r['setting']} | {epochs} | "
              f"{', '.join(f'{x:.2f}' for x in per_round)} | {overall:.2f} |")
    first_order = [name for name in FIRST_ORDER if name in seconds]
    ratios_found = {}
    if first_order:
        reference = min(first_order, key=lambda name: seconds[name][1])
        for name in seconds:
            if name.startswith("THOR"):
                ratio = seconds[name][1] / seconds[reference][1]
                per_round = [a / b for a, b in zip(seconds[name][0], seconds[reference][0])]
                ratios_found[name] = round(ratio, 3)
                print(f"{name}: seconds_vs_best_first_order {ratio:.2f}x re-timed against "
                      f"{reference} (target < 1x: {'meets' if ratio < 1 else 'MISSES'}; per "
                      f"round {min(per_round):.2f}x-{max(per_round):.2f}x)")
    return {"seconds": {name: {"setting": retimed[name]["setting"],
                               "per_round": [_json_number(x) for x in per_round],
                               "median": _json_number(overall)}
                        for name, (per_round, overall) in seconds.items()},
            "seconds_vs_best_first_order": ratios_found}


def _ordered(results):
    """The optimizers of ``results``: those of ``OPTIMIZERS`` in its order, then any other
    (a configuration saved by an earlier version) in the file's."""
    return ([name for name in OPTIMIZERS if name in results]
            + [name for name in results if name not in OPTIMIZERS])


def plot_best(tasks, path):
    """Per task: epochs and seconds to the target of each optimizer's best setting (bars:
    medians; dots: seeds; a missed target drawn at the top as x), and the validation
    accuracy against wall time of each best setting's median-seed run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 4.2 * len(tasks)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (task, info) in enumerate(tasks.items()):
        results = info["runs"]
        order = _ordered(results)
        best = best_settings({name: results[name] for name in order})
        for col, key in ((0, "epochs"), (1, "seconds")):
            ax = axes[row, col]
            finite = [v for name in order for v in results[name][best[name][0]][key]
                      if math.isfinite(v)]
            top = 1.15 * max(finite) if finite else 1.0
            for i, name in enumerate(order):
                label, med_epochs, med_seconds = best[name]
                med = med_epochs if key == "epochs" else med_seconds
                ax.bar(i, med if math.isfinite(med) else top, color=colors[i % len(colors)],
                       alpha=0.35 if math.isfinite(med) else 0.1)
                for v in results[name][label][key]:
                    ax.plot(i, v if math.isfinite(v) else top, "x" if math.isinf(v) else "o",
                            color=colors[i % len(colors)])
            ax.set_xticks(range(len(order)), order, rotation=30, ha="right", fontsize="small")
            ax.set(ylabel=f"{key} to target", ylim=(0, top * 1.05),
                   title=f"{TASKS.get(task, {}).get('title', task)}: {key} to "
                         f"{info['target']:g} (bars: median)")
            ax.grid(axis="y", alpha=0.3)
        ax = axes[row, 2]
        for i, name in enumerate(order):
            r = results[name][best[name][0]]
            runs = sorted(zip(r["epochs"], r["seconds"], r["val_accuracy"], r["epoch_seconds"]),
                          key=lambda t: (t[0], t[1]))
            _, _, accuracy, epoch_seconds = runs[len(runs) // 2]
            ax.plot(np.cumsum(epoch_seconds), accuracy, marker=".", label=name,
                    color=colors[i % len(colors)])
        ax.axhline(info["target"], color="gray", linestyle="--", linewidth=1)
        ax.set(xlabel="wall time (s)", ylabel="validation accuracy",
               ylim=(max(0.0, info["target"] - 0.25), 1.0),
               title="median-seed run of each best setting")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _names(text, allowed, what):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default=",".join(TASKS),
                        help=f"comma-separated, from {', '.join(TASKS)} (default: all)")
    parser.add_argument("--model", dest="task", help=argparse.SUPPRESS)   # former name
    parser.add_argument("--target", type=float, default=None,
                        help="validation accuracy (default: " +
                             ", ".join(f"{t} {v}" for t, v in DEFAULT_TARGETS.items()) + ")")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated")
    parser.add_argument("--max-epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--frequency", type=int, default=None,
                        help="THOR's frequency (default: half the steps of an epoch)")
    parser.add_argument("--optimizers", default=None,
                        help=f"comma-separated subset of {', '.join(OPTIMIZERS)} (with --from "
                             f"and --rounds: the ones re-timed)")
    parser.add_argument("--save", "--out", dest="save", default=None,
                        help="write every run to this JSON file (replacing it)")
    parser.add_argument("--from", dest="sources", nargs="+", default=None,
                        help="tabulate these --save files instead of training")
    parser.add_argument("--note", default="",
                        help="conditions of the run, kept in the --save file")
    parser.add_argument("--plot", default="convergence.png", help="'' for no plot")
    parser.add_argument("--rounds", type=int, default=0,
                        help="after the grids, run each optimizer's best setting again this "
                             "many times, interleaved, and compare those seconds")
    args = parser.parse_args(argv)

    if args.sources:
        tasks = load_results(args.sources)
        wanted = _names(args.task, TASKS, "tasks")
        tasks = {t: info for t, info in tasks.items() if t in wanted}
        if args.rounds:
            optimizers = args.optimizers and _names(args.optimizers, OPTIMIZERS, "optimizers")
            for task, info in tasks.items():
                runs = {name: settings for name, settings in info["runs"].items()
                        if not optimizers or name in optimizers}
                info["retimed"] = retime(task, info["target"], info["seeds"], info["max_epochs"],
                                         info["batch_size"], info["thor_frequency"], runs,
                                         args.rounds)
            if args.save:
                save_results(args.save, tasks)
    else:
        wanted = _names(args.task, TASKS, "tasks")
        optimizers = args.optimizers and _names(args.optimizers, OPTIMIZERS, "optimizers")
        seeds = [int(s) for s in args.seeds.split(",")]
        meta = {"batch_size": args.batch_size, "max_epochs": args.max_epochs,
                "note": args.note,
                "machine": {"cpus": os.cpu_count(),
                            "processor": platform.processor() or platform.machine(),
                            "tensorflow": tf.__version__, "keras": keras.__version__}}
        tasks = {}
        for task in wanted:
            target = args.target or DEFAULT_TARGETS[task]
            print(f"{TASKS[task]['title']}, batch {args.batch_size}, target val acc {target}, "
                  f"seeds {seeds}, {os.cpu_count()} CPUs, TF {tf.__version__}, "
                  f"Keras {keras.__version__}", flush=True)

            def progress(results, frequency, task=task, target=target, **retimed):
                tasks[task] = dict(meta, target=target, seeds=seeds, thor_frequency=frequency,
                                   runs=results, **retimed)
                if args.save:   # after every setting: an interrupted run keeps what it did
                    save_results(args.save, tasks)

            results, frequency = run(task, target, seeds, args.max_epochs, args.batch_size,
                                     args.frequency, optimizers, progress)
            if args.rounds:
                progress(results, frequency, retimed=retime(
                    task, target, seeds, args.max_epochs, args.batch_size, frequency, results,
                    args.rounds))
    summary = report(tasks, args.plot or None)
    print(json.dumps({"benchmark": "convergence", "tasks": summary}))


if __name__ == "__main__":
    main()
