"""Writes the THOR files that tests/test_thor_legacy_files.py loads (run from the repository
root: ``python tests/data/make_thor_legacy_files.py``).

A small model with a Conv1D, a Dense on sequences, an Embedding and a LayerNormalization trains
with THOR, every option on, wrapped in a dynamic ``tf_msopt.LossScaleOptimizer``, for
``BEFORE`` steps; then ``thor_legacy.keras`` and the ``thor_legacy_ckpt`` checkpoint are written,
and ``thor_legacy_expected.npz`` holds the weights and optimizer variables after ``AFTER`` more
steps of the uninterrupted run, on the machine that wrote them. The files fix the layout of
THOR's state as it was written: the tests check that they still load and resume exactly as the
files the current code writes from them, and near that continuation (within float32's rounding
on another CPU).
"""
import os

import keras
import numpy as np
import tensorflow as tf

import tf_msopt as mso

HERE = os.path.dirname(os.path.abspath(__file__))
BEFORE, AFTER = 6, 7      # frequency 4: inversions at steps 0, 4, 8; saved at stale step 6
BATCH = 8
VOCAB, LENGTH, CLASSES = 11, 5, 3


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 6, name="emb")(ids)
    h = keras.layers.Conv1D(5, 3, padding="same", activation="tanh", name="conv")(h)
    h = keras.layers.Dense(6, activation="tanh", name="proj")(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(h))


def make_optimizer(model):
    """THOR with every option on, connected to ``model``, inside a LossScaleOptimizer."""
    thor = mso.thor(
        model, np.linspace(0.05, 0.02, 32), [0.1] * 32, 0.9, weight_decay=1e-3,
        use_nesterov=True, decay_filter=["bias"], split_indices=[1], enable_clip_grad=True,
        frequency=4, block_size=4, damping_mode="pi", statistics_decay=0.8,
        statistics_frequency=2, fisher="sampled", kl_clip=1e-3, trace_thresholds=(0.3, 0.01),
        seed=1234, weight_sharing="expand")
    return mso.LossScaleOptimizer(thor, initial_scale=2.0**8, dynamic_growth_steps=4)


def compile_model(model, optimizer):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def batches(count=BEFORE + AFTER):
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(count * BATCH, LENGTH)).astype("int32")
    y = rng.integers(0, CLASSES, size=(count * BATCH,)).astype("int32")
    return [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(count)]


def train(model, steps):
    for x, y in steps:
        model.train_on_batch(x, y)


def state(model):
    """The model's weights and every optimizer variable, by position."""
    return ([w.copy() for w in model.get_weights()],
            [np.array(v.numpy()) for v in model.optimizer.variables])


def main():
    data = batches()
    model = make_model()
    compile_model(model, make_optimizer(model))
    train(model, data[:BEFORE])
    model.save(os.path.join(HERE, "thor_legacy.keras"))
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(HERE, "thor_legacy_ckpt"))
    train(model, data[BEFORE:])
    weights, variables = state(model)
    np.savez(os.path.join(HERE, "thor_legacy_expected.npz"),
             **{f"weight_{i}": w for i, w in enumerate(weights)},
             **{f"variable_{i}": v for i, v in enumerate(variables)})


if __name__ == "__main__":
    main()
