"""Files written by an earlier THOR (tests/data/make_thor_legacy_files.py) still load and resume
exactly: a ``.keras`` file and a ``tf.train.Checkpoint``, THOR with every option on inside a
LossScaleOptimizer."""
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_msopt as mso

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
sys.path.insert(0, DATA)
import make_thor_legacy_files as legacy  # noqa: E402


def expected():
    stored = np.load(os.path.join(DATA, "thor_legacy_expected.npz"))
    count = sum(key.startswith("weight_") for key in stored.files)
    return ([stored[f"weight_{i}"] for i in range(count)],
            [stored[f"variable_{i}"] for i in range(len(stored.files) - count)])


def assert_resumes_exactly(model):
    legacy.train(model, legacy.batches()[legacy.BEFORE:])
    weights, variables = legacy.state(model)
    want_weights, want_variables = expected()
    assert len(weights) == len(want_weights) and len(variables) == len(want_variables)
    for got, want in zip(weights + variables, want_weights + want_variables):
        np.testing.assert_array_equal(got, want)


def test_keras_file_loads_and_resumes_exactly():
    model = keras.models.load_model(os.path.join(DATA, "thor_legacy.keras"), safe_mode=True)
    mso.thor.connect(model)
    assert_resumes_exactly(model)


def test_checkpoint_restores_and_resumes_exactly():
    model = legacy.make_model(seed=5)        # other initial weights: the checkpoint sets them
    optimizer = legacy.make_optimizer(model)
    legacy.compile_model(model, optimizer)
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        os.path.join(DATA, "thor_legacy_ckpt")).assert_consumed()
    assert_resumes_exactly(model)
