"""AddSign and PowerSign on a Keras model, with a sign-decay schedule.

Trains a small MLP on scikit-learn's bundled digits data (no download). The
sign term is annealed with the paper's linear decay: early on, steps where the
gradient agrees with its running average are amplified; by the end both
optimizers behave like plain SGD.

    python examples/sign_optimizers.py [--epochs 20]
"""
import argparse

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import tf_msopt as mso

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=20)
args = parser.parse_args()

digits = load_digits()
x_train, x_val, y_train, y_val = train_test_split(digits.data / 16.0, digits.target, test_size=0.2,
                                                  random_state=0)
steps = args.epochs * ((len(x_train) + 63) // 64)

for optimizer in (
    mso.AddSign(learning_rate=0.1, alpha=1.0, beta=0.9,
                sign_decay=mso.schedules.LinearSignDecay(decay_steps=steps)),
    mso.PowerSign(learning_rate=0.1, logbase=1.0, beta=0.9,
                  sign_decay=mso.schedules.CosineSignDecay(decay_steps=steps)),
):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(x_train, y_train, batch_size=64, epochs=args.epochs,
                        validation_data=(x_val, y_val), verbose=2)
    print(f"{type(optimizer).__name__}: final validation accuracy "
          f"{history.history['val_accuracy'][-1]:.3f}")
