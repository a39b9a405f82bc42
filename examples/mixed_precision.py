"""Mixed-precision training with MindSpore-style dynamic loss scaling.

Trains a small MLP in ``mixed_float16`` (float16 compute, float32 weights) on
scikit-learn's bundled digits data (no download), with
``tf_msopt.LossScaleOptimizer`` driven by a ``DynamicLossScaleManager``:
MindSpore's default initial scale 2**24 overflows float16 gradients, so the
first steps are skipped and the scale drops until the gradients fit, then
grows again every ``scale_window`` clean steps. ``LossScaleMonitor`` shows the
scale and the skipped steps in the progress bar and in the history.

    python examples/mixed_precision.py [--epochs 20]
"""
import argparse

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import tf_msopt as mso
from tf_msopt.loss_scale import LossScaleMonitor

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--scale-window", type=int, default=50)
args = parser.parse_args()

digits = load_digits()
x_train, x_val, y_train, y_val = train_test_split(digits.data / 16.0, digits.target, test_size=0.2,
                                                  random_state=0)

keras.config.set_dtype_policy("mixed_float16")
keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(128, activation="relu"),
    # the last layer computes in float32 so the softmax and the loss are float32
    keras.layers.Dense(10, activation="softmax", dtype="float32"),
])
optimizer = mso.LossScaleOptimizer(
    keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    mso.DynamicLossScaleManager(init_loss_scale=2**24, scale_factor=2,
                                scale_window=args.scale_window))
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
assert model.optimizer is optimizer   # compile keeps it: no second LossScaleOptimizer

history = model.fit(x_train, y_train, batch_size=64, epochs=args.epochs,
                    validation_data=(x_val, y_val), verbose=2, callbacks=[LossScaleMonitor()])
keras.config.set_dtype_policy("float32")

print(f"loss scale per epoch: {history.history['loss_scale']}")
print(f"skipped steps: {int(optimizer.skipped_steps.numpy())} of "
      f"{int(optimizer.skipped_steps.numpy()) + int(optimizer.iterations.numpy())}")
print(f"final validation accuracy {history.history['val_accuracy'][-1]:.3f}")
