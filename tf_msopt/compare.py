"""Side-by-side training of the package's optimizers against Keras' SGD-momentum, Adam and
Muon.

Trains the same model from the same initial weights with each optimizer, shows
Keras progress bars, prints a table (final loss, accuracy, time, and the epoch
and time at which the validation accuracy first reaches a target) and saves
plots of loss and accuracy against epochs and against wall time. THOR's runs also
log its state with ``tf_msopt.thor.Monitor`` (in the progress bars, the results
and a table of their last epoch).

By default it trains an MLP and a small CNN on scikit-learn's bundled digits
(no network). ``--data file.npz`` trains on your arrays instead: ``x_train`` and
``y_train`` (integer labels), optionally ``x_val`` and ``y_val`` (otherwise 20%
of the training data is held out).

    tf-msopt compare [--models mlp,cnn] [--optimizers THOR,Adam] [--epochs 15]
                     [--target-accuracy 0.95] [--data my.npz] [--output-dir demo_output]
"""
import argparse
import contextlib
import json
import os
import re
import time

import keras
import numpy as np
import tensorflow as tf

MODELS = ("mlp", "cnn")


def load_digits_split(seed=0):
    """Digits as 8x8x1 images in [0, 1], 80/20 train/validation split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    return train_test_split(x, digits.target.astype("int32"), test_size=0.2, random_state=seed,
                            stratify=digits.target)


def load_npz_split(path, seed=0):
    """``x_train``/``y_train`` (and ``x_val``/``y_val`` or a 20% hold-out) from a .npz file."""
    with np.load(path) as data:
        missing = {"x_train", "y_train"} - set(data.files)
        if missing:
            raise ValueError(f"--data {path}: missing arrays {sorted(missing)}; "
                             f"found {sorted(data.files)}")
        x, y = data["x_train"].astype("float32"), data["y_train"].astype("int32")
        if "x_val" in data.files and "y_val" in data.files:
            return x, data["x_val"].astype("float32"), y, data["y_val"].astype("int32")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    split = len(x) - max(1, len(x) // 5)
    return x[order[:split]], x[order[split:]], y[order[:split]], y[order[split:]]


def make_model(kind, input_shape, classes):
    """The ``mlp`` (flat input) or ``cnn`` (image input) of the comparison."""
    if kind == "mlp":
        layers = [keras.layers.Dense(64, activation="relu"),
                  keras.layers.Dense(64, activation="relu")]
    elif kind == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"--models cnn needs images (height, width, channels); the data has "
                             f"samples of shape {input_shape}")
        layers = [keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                  keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
                  keras.layers.Flatten(), keras.layers.Dense(64, activation="relu")]
    else:
        raise ValueError(f"unknown model {kind!r}; choose from {MODELS}")
    return keras.Sequential([keras.Input(input_shape), *layers,
                             keras.layers.Dense(classes, activation="softmax")])


def output_layer_pattern(model):
    """Muon's ``exclude_layers`` entry for ``model``'s output layer: the entries are regular
    expressions searched in variable paths ("sequential/dense_2/kernel"), so the layer's name
    is matched as one whole path component ("dense_2" alone would match "dense_20" too)."""
    return f"(^|/){re.escape(model.layers[-1].name)}/"


def muon(model, **kwargs):
    """Keras' Muon with ``model``'s output layer left to its AdamW step, as Muon's docs ask
    (its default also leaves embeddings and every variable that is not 2-D to AdamW)."""
    return keras.optimizers.Muon(exclude_layers=[output_layer_pattern(model)], **kwargs)


def optimizer_factories():
    """Name -> factory(model): THOR, Adam and Muon at their defaults (``tf_msopt.thor(model)``,
    ``keras.optimizers.Adam()``, :func:`muon`), the others at learning rates chosen per
    optimizer family on digits."""
    import tf_msopt as mso

    return {
        "THOR": lambda model: mso.thor(model),
        "LARS": lambda model: mso.LARS(keras.optimizers.SGD(learning_rate=0.5, momentum=0.9),
                                       coefficient=0.01),
        "AdamOffload": lambda model: mso.AdamOffload(learning_rate=1e-3),
        "AddSign": lambda model: mso.AddSign(learning_rate=0.1),
        "PowerSign": lambda model: mso.PowerSign(learning_rate=0.1, logbase=1.0),
        "SGD-momentum": lambda model: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
        "Adam": lambda model: keras.optimizers.Adam(),
        "Muon": muon,
    }


class _EpochClock(keras.callbacks.Callback):
    """Wall time at the end of each epoch since it was created, just before ``fit`` (whose
    setup, before ``on_train_begin``, may build the model's state)."""

    def __init__(self):
        super().__init__()
        self.start = time.perf_counter()

    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)


def first_reaching(values, target):
    """Index of the first value >= target, or None."""
    return next((i for i, v in enumerate(values) if v >= target), None)


def prepare(kind, split):
    """The MLP sees flat features standardised with the training statistics."""
    if kind != "mlp":
        return split
    x_train, x_val, y_train, y_val = split
    x_train, x_val = (x.reshape(len(x), -1) for x in (x_train, x_val))
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0  # a feature constant in training (a blank pixel) is only centred
    return (x_train - mean) / std, (x_val - mean) / std, y_train, y_val


@contextlib.contextmanager
def without_data_autotuning():
    """tf.data's autotuning off for the datasets made inside (Keras' data adapters create
    ``tf.data.Options`` for each; the batches and their order are unchanged). With it,
    freeing the previous epoch's iterator can wait for its autotuning thread: on a
    character LM the first batch of a second epoch took 9-10 s instead of 0.05 s in about
    half the runs, a cost that falls on every epoch boundary and so on the optimizer that
    needs more epochs."""
    default_init = tf.data.Options.__init__

    def options_without_autotuning(options):
        default_init(options)
        options.autotune.enabled = False

    tf.data.Options.__init__ = options_without_autotuning
    try:
        yield
    finally:
        tf.data.Options.__init__ = default_init


def train_one(kind, factory, data, initial_weights, epochs, batch_size, seed, verbose,
              callbacks=()):
    from tf_msopt.thor.monitor import Monitor
    from tf_msopt.thor.optimizer import wrapped_thor

    x_train, x_val, y_train, y_val = data
    keras.utils.set_random_seed(seed)
    model = make_model(kind, x_train.shape[1:], int(max(y_train.max(), y_val.max())) + 1)
    model.set_weights(initial_weights)
    model.compile(optimizer=factory(model), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    clock = _EpochClock()     # first: the epoch's time leaves out the monitor's reads
    monitor = [Monitor()] if wrapped_thor(model.optimizer) is not None else []
    with without_data_autotuning():
        history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
                            validation_data=(x_val, y_val),
                            callbacks=[clock, *monitor, *callbacks], verbose=verbose)
    return dict(history.history, seconds=clock.seconds)


def compare(models=MODELS, optimizers=None, epochs=15, batch_size=64, target_accuracy=0.95,
            data=None, output_dir="demo_output", seed=0, verbose=1):
    """Trains every (model, optimizer) pair; returns ``{model: {optimizer: history}}``.

    Each history has Keras' per-epoch ``loss``, ``accuracy``, ``val_loss``,
    ``val_accuracy``, plus ``seconds`` (wall time at each epoch end) and
    ``epochs_to_target`` / ``seconds_to_target`` (None when never reached).
    """
    split = load_npz_split(data, seed) if data else load_digits_split(seed)
    factories = optimizer_factories()
    names = list(factories)
    unknown = set(optimizers or ()) - set(names)
    if unknown:
        raise ValueError(f"unknown optimizers {sorted(unknown)}; choose from {names}")
    chosen = [name for name in names if not optimizers or name in optimizers]
    results = {}
    for kind in models:
        data_for_model = prepare(kind, split)
        keras.utils.set_random_seed(seed)
        classes = int(max(split[2].max(), split[3].max())) + 1
        initial = make_model(kind, data_for_model[0].shape[1:], classes).get_weights()
        results[kind] = {}
        for name in chosen:
            print(f"\n== {kind}: {name}")
            r = train_one(kind, factories[name], data_for_model, initial, epochs, batch_size, seed,
                          verbose)
            reached = first_reaching(r["val_accuracy"], target_accuracy)
            r["epochs_to_target"] = None if reached is None else reached + 1
            r["seconds_to_target"] = None if reached is None else r["seconds"][reached]
            results[kind][name] = r
        print_table(kind, results[kind], target_accuracy)
        print_thor_state(kind, results[kind])
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        for kind, runs in results.items():
            print(f"plots saved to {plot_curves(kind, runs, output_dir)}")
        path = os.path.join(output_dir, "results.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"results saved to {path}")
    return results


def print_table(kind, runs, target_accuracy):
    print(f"\n{kind}: final epoch, and first epoch / time with val acc >= {target_accuracy:g}")
    print(f"{'optimizer':<14}{'train loss':>11}{'val loss':>10}{'val acc':>9}{'time (s)':>10}"
          f"{'epochs to target':>18}{'s to target':>13}")
    for name, r in runs.items():
        epochs = "-" if r["epochs_to_target"] is None else str(r["epochs_to_target"])
        seconds = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        print(f"{name:<14}{r['loss'][-1]:>11.4f}{r['val_loss'][-1]:>10.4f}"
              f"{r['val_accuracy'][-1]:>9.3f}{r['seconds'][-1]:>10.1f}{epochs:>18}{seconds:>13}")


def print_thor_state(kind, runs):
    """The last epoch's THOR state (:class:`tf_msopt.thor.Monitor`'s entries) of the runs
    that logged it."""
    from tf_msopt.thor.monitor import LOGGED

    monitored = {name: r for name, r in runs.items() if any(key in r for key in LOGGED)}
    if not monitored:
        return
    headers = [key[len("thor_"):].replace("_", " ") for key in LOGGED]
    print(f"\n{kind}: THOR's state at the last epoch (tf_msopt.thor.Monitor; - where the "
          f"configuration has none)")
    print(f"{'optimizer':<14}" + "".join(f"{header:>{len(header) + 2}}" for header in headers))
    for name, r in monitored.items():
        cells = [f"{r[key][-1]:.4g}" if key in r else "-" for key in LOGGED]
        print(f"{name:<14}" + "".join(f"{cell:>{len(header) + 2}}"
                                      for cell, header in zip(cells, headers)))


def plot_curves(kind, runs, output_dir):
    """Loss and validation accuracy against epochs (top) and wall time (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for name, r in runs.items():
        epochs = np.arange(1, len(r["loss"]) + 1)
        for row, x in ((0, epochs), (1, r["seconds"])):
            axes[row, 0].plot(x, r["loss"], label=name)
            axes[row, 1].plot(x, r["val_accuracy"], label=name)
    for row, xlabel in ((0, "epoch"), (1, "wall time (s)")):
        axes[row, 0].set(title="training loss", xlabel=xlabel, ylabel="cross-entropy",
                         yscale="log")
        axes[row, 1].set(title="validation accuracy", xlabel=xlabel, ylabel="accuracy")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(f"{kind}: optimizers side by side")
    fig.tight_layout()
    path = os.path.join(output_dir, f"{kind}_curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _names(text):
    return [name.strip() for name in text.split(",") if name.strip()]


def _names_from(allowed):
    """An argparse type: comma-separated names, each one of ``allowed``."""
    def names(text):
        chosen = _names(text)
        unknown = [name for name in chosen if name not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown} in {text!r}; choose from {list(allowed)}" if unknown
                else "no names given")
        return chosen
    return names


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _accuracy(text):
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _npz_file(path):
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="tf-msopt compare", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--models", type=_names_from(MODELS), default=list(MODELS),
                        help=f"comma-separated, from: {', '.join(MODELS)} (default: all)")
    names = list(optimizer_factories())
    parser.add_argument("--optimizers", type=_names_from(names), default=None,
                        help=f"comma-separated, from: {', '.join(names)} (default: all)")
    parser.add_argument("--epochs", type=_positive_int, default=15, help="(default: 15)")
    parser.add_argument("--batch-size", type=_positive_int, default=64, help="(default: 64)")
    parser.add_argument("--target-accuracy", type=_accuracy, default=0.95,
                        help="the validation accuracy whose first epoch and time the table "
                             "gives (default: 0.95)")
    parser.add_argument("--data", type=_npz_file, default=None,
                        help=".npz with x_train, y_train[, x_val, y_val] (default: "
                             "scikit-learn's digits)")
    parser.add_argument("--output-dir", default="demo_output",
                        help="where the plots and results.json go (default: demo_output)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    args = parser.parse_args(argv)
    compare(args.models, args.optimizers, args.epochs, args.batch_size, args.target_accuracy,
            args.data, args.output_dir, args.seed)


if __name__ == "__main__":
    main()
