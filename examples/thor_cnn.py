"""THOR on a small CNN, next to SGD with momentum.

THOR preconditions each Conv2D and Dense kernel with Kronecker factors that it
refreshes every ``frequency`` steps; between refreshes a step costs about what a
momentum step costs. This trains a small CNN on scikit-learn's handwritten
digits (no download) with the MindSpore model zoo's THOR schedules
(``thor_lr``, ``thor_damping``), prints which layers THOR preconditions, and
compares the loss and test accuracy with SGD with momentum at the same batch
size and number of epochs. It ends with a save / load / reconnect round trip.

Run: python examples/thor_cnn.py [--epochs 10]   (under a minute on a 2-core CPU)
"""
import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tf_msopt as mso  # noqa: E402

BATCH_SIZE = 64


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu", name="conv2"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu", name="fc"),
        keras.layers.Dense(10, name="head"),
    ])


def train(name, model, optimizer, data, epochs):
    x_train, x_test, y_train, y_test = data
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    history = model.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=epochs, verbose=0,
                        validation_data=(x_test, y_test)).history
    seconds = time.perf_counter() - start
    for epoch in sorted({0, epochs // 2, epochs - 1}):
        print(f"{name:>14}  epoch {epoch + 1:3d}  loss {history['loss'][epoch]:.4f}  "
              f"test accuracy {history['val_accuracy'][epoch]:.4f}")
    print(f"{name:>14}  {seconds:.1f} s for {epochs} epochs")
    return history


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    epochs = parser.parse_args().epochs
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    data = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                            stratify=digits.target)
    steps_per_epoch = int(np.ceil(len(data[0]) / BATCH_SIZE))

    # MindSpore's model-zoo schedules: one value per step, from step 0.
    learning_rate = mso.schedules.thor_lr(0, 0.05, 2.0, epochs + 1, steps_per_epoch,
                                          decay_epochs=epochs + 1)
    damping = mso.schedules.thor_damping(0, 0.3, 0.5, epochs + 1, steps_per_epoch)
    model = make_model()
    optimizer = mso.thor(model, learning_rate, damping, 0.9, weight_decay=1e-4,
                         batch_size=BATCH_SIZE, frequency=10)
    print(optimizer.report(), "\n")
    thor_history = train("THOR", model, optimizer, data, epochs)
    sgd_history = train("SGD momentum", make_model(),
                        keras.optimizers.SGD(0.05, momentum=0.9), data, epochs)
    print(f"\nfinal loss: THOR {thor_history['loss'][-1]:.4f}, "
          f"SGD momentum {sgd_history['loss'][-1]:.4f}")
    print(f"damping retries {int(optimizer.damping_retries.numpy())}, "
          f"inverses kept after a failed factorisation {int(optimizer.failed_inverses.numpy())}")

    # Save, load and reconnect: the loaded THOR resumes with its inverses and momenta.
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "thor_cnn.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        mso.thor.connect(loaded)
        loaded.fit(data[0], data[2], batch_size=BATCH_SIZE, epochs=1, verbose=0)
        print(f"reloaded and trained one more epoch: step {int(loaded.optimizer.iterations)}")


if __name__ == "__main__":
    main()
