"""Train with THOR, export for serving, serve where tf_msopt is not installed.

``model.export`` writes an inference SavedModel: the model's forward pass and weights,
nothing of the optimizer (THOR's statistics capture runs only where a gradient is
taken, so it never enters an inference graph). This trains an MLP on scikit-learn's
handwritten digits (no download) with THOR, exports it, and serves the export from a
separate Python process that imports TensorFlow alone, checking that it answers what
``model.predict`` does.

Run: python examples/thor_export.py [--epochs 3] [--out DIR]
"""
import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tf_msopt as mso  # noqa: E402

# What a serving process runs: TensorFlow and the SavedModel, no tf_msopt.
SERVE = """
import sys
import numpy as np
import tensorflow as tf
served = tf.saved_model.load(sys.argv[1])
x = np.load(sys.argv[2])
np.save(sys.argv[3], served.serve(tf.constant(x)).numpy())
print("served", len(x), "images; tf_msopt imported:", "tf_msopt" in sys.modules)
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", help="where to write the export (default: a temporary folder)")
    args = parser.parse_args()
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype("float32"), digits.target, test_size=0.25, random_state=0,
        stratify=digits.target)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=mso.thor(model, 0.1, 0.1, 0.9, frequency=10),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=64, epochs=args.epochs, verbose=0)
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    print(f"THOR, {args.epochs} epochs: test accuracy {accuracy:.4f}")

    with tempfile.TemporaryDirectory() as scratch:
        path = args.out or os.path.join(scratch, "digits_mlp")
        model.export(path, verbose=False)
        inputs, outputs = os.path.join(scratch, "x.npy"), os.path.join(scratch, "y.npy")
        np.save(inputs, x_test)
        result = subprocess.run([sys.executable, "-c", SERVE, path, inputs, outputs],
                                capture_output=True, text=True, check=True)
        print(result.stdout.strip())
        served = np.load(outputs)
    difference = np.abs(served - model.predict(x_test, verbose=0)).max()
    print(f"largest difference between the served and predicted probabilities: {difference:.2e}")
    served_accuracy = float(np.mean(served.argmax(axis=1) == y_test))
    print(f"served test accuracy {served_accuracy:.4f}")


if __name__ == "__main__":
    main()
