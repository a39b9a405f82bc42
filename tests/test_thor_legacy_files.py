"""Files written by an earlier THOR (tests/data/make_thor_legacy_files.py) still load and resume:
a ``.keras`` file and a ``tf.train.Checkpoint``, THOR with every option on inside a
LossScaleOptimizer.

Exact comparisons stay within this process: the old files resume bit for bit as files the
current code writes from them, and as each other. The continuation committed beside them was
computed on another CPU, where TensorFlow's kernels sum in other orders and fuse other
multiply-adds, so it is met within float32's rounding (see ``rounding_tolerance``).
"""
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
sys.path.insert(0, DATA)
import make_thor_legacy_files as legacy  # noqa: E402

KERAS_FILE = os.path.join(DATA, "thor_legacy.keras")
CHECKPOINT = os.path.join(DATA, "thor_legacy_ckpt")


def committed_continuation():
    stored = np.load(os.path.join(DATA, "thor_legacy_expected.npz"))
    count = sum(key.startswith("weight_") for key in stored.files)
    return ([stored[f"weight_{i}"] for i in range(count)]
            + [stored[f"variable_{i}"] for i in range(len(stored.files) - count)])


def load_keras_file(path):
    model = keras.models.load_model(path, safe_mode=True)
    mso.thor.connect(model)
    return model


def restore_checkpoint(path):
    model = legacy.make_model(seed=5)        # other initial weights: the checkpoint sets them
    optimizer = legacy.make_optimizer(model)
    legacy.compile_model(model, optimizer)
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(path).assert_consumed()
    return model


def write_checkpoint(model, path):
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(path)
    return path


def resumed(model):
    """The weights and every optimizer variable after the continuation's steps."""
    legacy.train(model, legacy.batches()[legacy.BEFORE:])
    weights, variables = legacy.state(model)
    return weights + variables


def assert_same_run(got, want):
    assert len(got) == len(want)
    for got_array, want_array in zip(got, want):
        np.testing.assert_array_equal(got_array, want_array)


@pytest.fixture(scope="module")
def keras_file():
    """``(tolerance, run)``: :func:`rounding_tolerance` of the old ``.keras`` file's state, and
    its continuation."""
    model = load_keras_file(KERAS_FILE)
    return rounding_tolerance(model.optimizer.inner_optimizer), resumed(model)


@pytest.fixture(scope="module")
def keras_file_run(keras_file):
    return keras_file[1]


@pytest.mark.equivalence
def test_keras_file_resumes_as_the_file_the_current_code_saves_from_it(
        keras_file_run, tmp_path):
    path = str(tmp_path / "current.keras")
    load_keras_file(KERAS_FILE).save(path)
    assert_same_run(resumed(load_keras_file(path)), keras_file_run)


@pytest.mark.equivalence
def test_checkpoint_resumes_as_the_keras_file_and_as_a_current_checkpoint(
        keras_file_run, tmp_path):
    model = restore_checkpoint(CHECKPOINT)
    current = write_checkpoint(model, str(tmp_path / "current"))
    assert_same_run(resumed(model), keras_file_run)
    assert_same_run(resumed(restore_checkpoint(current)), keras_file_run)


def real_eigenvalues(inverse, dim):
    """The eigenvalues of a stored inverse over its factor's ``dim`` dimensions (blocks are
    padded to one size; a diagonal factor is a vector)."""
    if inverse.ndim == 1:
        return inverse
    size = inverse.shape[-1]
    return np.concatenate([np.linalg.eigvalsh(block[:dim - i * size, :dim - i * size])
                           for i, block in enumerate(inverse)])


def rounding_tolerance(thor):
    """How far, relative to an array's largest entry, another CPU's float32 arithmetic can
    take the continuation from ``thor``'s state. There each op's result moves by about
    float32's roundoff ``u = 2^-24``, and each THOR step applies a layer's ``(A + d) kron
    (G + d)`` inverse, which magnifies a relative perturbation by up to its condition number
    ``kappa_A kappa_G`` (at most 15 in these files); the continuation's steps add up to
    ``steps * kappa * u`` (6.3e-6). A state a file lost moves the continuation by 0.1 or more
    (a momentum slot, an average, the step count, the loss scale); runs on AVX-512, AMX and
    AVX2, with oneDNN on and off, stayed within 1.5e-6."""
    def condition(inverse, dim):
        values = real_eigenvalues(inverse.numpy(), dim)
        return values.max() / values.min()

    kappa = max(condition(state.a_inverse, state.block.a_dim)
                * condition(state.g_inverse, state.block.g_dim)
                for state in thor.curvature.values())
    return (len(legacy.batches()) - legacy.BEFORE) * kappa * 2.0**-24


def test_continuation_matches_the_committed_one_within_float32_rounding(keras_file):
    tolerance, keras_file_run = keras_file
    want = committed_continuation()
    assert len(keras_file_run) == len(want)
    for got_array, want_array in zip(keras_file_run, want):
        assert got_array.dtype == want_array.dtype and got_array.shape == want_array.shape
        scale = np.abs(want_array).max(initial=0)
        np.testing.assert_allclose(got_array, want_array, rtol=0, atol=tolerance * scale)
