"""Large-batch training with LARS around SGD with momentum.

The LARS recipe (You et al. 2017; MLPerf's ResNet-50): a large batch, a large
base rate reached by a linear warm-up, then a polynomial (power 2) decay, with
the trust ratio keeping each layer's step in proportion to its weights. Here on
scikit-learn's handwritten digits (no download), with a batch of a third of the
training set, next to plain SGD with momentum on the same schedule shape and its
own peak rate.

Run: python examples/lars_large_batch.py [--epochs 40]   (about half a minute on a 2-core CPU)
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tf_msopt as mso  # noqa: E402

BATCH_SIZE = 448


class WarmupPolynomial(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to ``peak`` over ``warmup_steps``, then ``(1 - progress)**power`` decay."""

    def __init__(self, peak, warmup_steps, total_steps, end=1e-4, power=2.0):
        self.peak, self.warmup_steps, self.total_steps = peak, warmup_steps, total_steps
        self.end, self.power = end, power

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warmup = self.peak * (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        progress = keras.ops.clip((step - self.warmup_steps) / decay_steps, 0.0, 1.0)
        decay = (self.peak - self.end) * (1.0 - progress) ** self.power + self.end
        return keras.ops.where(step < self.warmup_steps, warmup, decay)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "end": self.end, "power": self.power}


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu", name="fc1"),
        keras.layers.LayerNormalization(name="layer_norm"),
        keras.layers.Dense(256, activation="relu", name="fc2"),
        keras.layers.Dense(10, name="head"),
    ])


def train(name, optimizer, data, epochs):
    x_train, x_test, y_train, y_test = data
    model = make_model()
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=epochs, verbose=0,
                        validation_data=(x_test, y_test))
    for epoch in sorted({e for e in (0, 4, 9, 19) if e < epochs} | {epochs - 1}):
        print(f"{name:>24}  epoch {epoch + 1:3d}  loss {history.history['loss'][epoch]:.4f}  "
              f"test accuracy {history.history['val_accuracy'][epoch]:.4f}")
    return history.history["val_accuracy"][-1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=40)
    epochs = parser.parse_args().epochs
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    data = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                            stratify=digits.target)
    steps_per_epoch = int(np.ceil(len(data[0]) / BATCH_SIZE))
    total = steps_per_epoch * epochs
    warmup = min(5, max(1, epochs // 2)) * steps_per_epoch

    # LARS takes SGD's weight decay over and applies it inside the trust ratio;
    # biases and the LayerNorm weights get plain SGD steps and no decay.
    # Without use_clip a LARS layer moves about lr * coefficient * |w| per step, so
    # the base rate is large next to plain SGD's (0.2 already diverges for SGD here).
    lars = mso.LARS(keras.optimizers.SGD(WarmupPolynomial(1.0, warmup, total), momentum=0.9,
                                         weight_decay=5e-4),
                    coefficient=0.02)
    sgd = keras.optimizers.SGD(WarmupPolynomial(0.1, warmup, total), momentum=0.9)

    print(f"{len(data[0])} training images, batch {BATCH_SIZE} ({steps_per_epoch} steps per epoch)")
    results = {"LARS(SGD momentum)": train("LARS(SGD momentum)", lars, data, epochs),
               "SGD momentum": train("SGD momentum", sgd, data, epochs)}
    for name, accuracy in results.items():
        print(f"final test accuracy  {name:>20}: {accuracy:.4f}")


if __name__ == "__main__":
    main()
