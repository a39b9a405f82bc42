"""Side-by-side training of the package's optimizers against Keras SGD-momentum and Adam.

Trains one MLP on scikit-learn's bundled digits data (no network) from the same
initial weights with each optimizer, shows Keras progress bars, prints a table
of final loss / accuracy / time and saves a plot of the loss curves.

    python -m tf_msopt compare [--epochs 15] [--output-dir demo_output]
"""
import argparse
import os
import time

import keras
import numpy as np


def load_digits_split(seed=0):
    """Standardized 8x8 digits, 80/20 train/validation split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)
    return train_test_split(x, digits.target.astype("int32"), test_size=0.2, random_state=seed,
                            stratify=digits.target)


def optimizer_factories():
    """Name -> zero-argument factory; learning rates chosen per optimizer family."""
    import tf_msopt as mso

    return {
        "AddSign": lambda: mso.AddSign(learning_rate=0.1),
        "PowerSign": lambda: mso.PowerSign(learning_rate=0.1, logbase=1.0),
        "SGD-momentum": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
        "Adam": lambda: keras.optimizers.Adam(learning_rate=1e-3),
    }


def make_mlp(inputs, classes):
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(classes, activation="softmax"),
    ])


def compare(epochs=15, batch_size=64, output_dir="demo_output", seed=0, verbose=1):
    """Trains with every optimizer; returns ``{name: {"loss": [...], "val_accuracy": [...], ...}}``."""
    x_train, x_val, y_train, y_val = load_digits_split(seed)
    keras.utils.set_random_seed(seed)
    initial = make_mlp(x_train.shape[1], 10).get_weights()
    results = {}
    for name, factory in optimizer_factories().items():
        print(f"\n== {name}")
        keras.utils.set_random_seed(seed)
        model = make_mlp(x_train.shape[1], 10)
        model.set_weights(initial)
        model.compile(optimizer=factory(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        start = time.perf_counter()
        history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
                            validation_data=(x_val, y_val), verbose=verbose)
        results[name] = dict(history.history, seconds=time.perf_counter() - start)
    print_table(results)
    if output_dir:
        print(f"\nloss curves saved to {plot_losses(results, output_dir)}")
    return results


def print_table(results):
    print(f"\n{'optimizer':<14}{'train loss':>12}{'val loss':>10}{'val acc':>9}{'time (s)':>10}")
    for name, r in results.items():
        print(f"{name:<14}{r['loss'][-1]:>12.4f}{r['val_loss'][-1]:>10.4f}"
              f"{r['val_accuracy'][-1]:>9.3f}{r['seconds']:>10.1f}")


def plot_losses(results, output_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(output_dir, exist_ok=True)
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        epochs = np.arange(1, len(r["loss"]) + 1)
        train_ax.plot(epochs, r["loss"], label=name)
        val_ax.plot(epochs, r["val_loss"], label=name)
    for ax, title in ((train_ax, "training loss"), (val_ax, "validation loss")):
        ax.set(title=title, xlabel="epoch", ylabel="cross-entropy", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("digits MLP: optimizers side by side")
    fig.tight_layout()
    path = os.path.join(output_dir, "loss_curves.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tf_msopt compare", description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output-dir", default="demo_output")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    compare(args.epochs, args.batch_size, args.output_dir, args.seed)


if __name__ == "__main__":
    main()
