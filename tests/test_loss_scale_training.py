"""Loss scaling in training: MindSpore's train-step table, custom loops, mixed_float16, logs.

The golden run is MindSpore 2.10's ``TrainOneStepWithLossScaleCell``
on CPU: ``y = x @ W``, mean-squared error, SGD(0.1),
``DynamicLossScaleUpdateCell(2**20, 2, 2)``; step 2 overflows.
"""
import glob
import math
import os
import re
import runpy
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from helpers import REPO_ROOT, regression_data, small_mlp
from tf_msopt.loss_scale import LossScaleMonitor

X = np.array([[1.0, 0.5]], np.float32)
X_OVERFLOW = np.array([[1e38, 0.5]], np.float32)
Y = np.array([[0.0, 1.0]], np.float32)
INPUTS = [X, X, X_OVERFLOW, X, X]
# loss, overflow, scale after the step, W after the step
TABLE = [
    (7.625, False, 1048576.0, [[0.75, 1.7], [2.875, 3.85]]),
    (5.8378906, False, 2097152.0, [[0.53125, 1.4375], [2.765625, 3.71875]]),
    (math.inf, True, 1048576.0, [[0.53125, 1.4375], [2.765625, 3.71875]]),
    (4.469635, False, 1048576.0, [[0.33984375, 1.2078125], [2.669921875, 3.603906]]),
    (3.4220643, False, 2097152.0, [[0.17236328, 1.0068359], [2.5861816, 3.5034180]]),
]


def linear_model():
    kernel = keras.initializers.Constant([[1.0, 2.0], [3.0, 4.0]])
    return keras.Sequential([keras.Input((2,)),
                             keras.layers.Dense(2, use_bias=False, kernel_initializer=kernel)])


def golden_optimizer():
    return mso.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                  mso.DynamicLossScaleUpdateCell(2**20, 2, 2))


def custom_step(model, optimizer, x, y, tf_keras_shims):
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, model(x))[0]
        scaled = (optimizer.get_scaled_loss(loss) if tf_keras_shims
                  else optimizer.scale_loss(loss))
    grads = tape.gradient(scaled, model.trainable_variables)
    if tf_keras_shims:   # tf-keras: unscale, then apply_gradients (which must not unscale again)
        grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    else:                # Keras 3: apply unscales
        optimizer.apply(grads, model.trainable_variables)
    return loss


def run_golden(mode):
    model, optimizer = linear_model(), golden_optimizer()
    if mode.startswith("fit"):
        model.compile(optimizer, "mse", jit_compile=(mode == "fit_jit"))
        step = lambda x: model.train_on_batch(x, Y)  # noqa: E731
    else:
        optimizer.build(model.trainable_variables)
        shims = "shims" in mode
        step = lambda x: custom_step(model, optimizer, x, Y, shims)  # noqa: E731
        if mode.endswith("tf_function"):
            step = tf.function(step)
    rows = []
    for x in INPUTS:
        loss = float(step(tf.constant(x)) if mode.endswith("tf_function") else step(x))
        rows.append((loss, bool(optimizer.last_step_skipped.numpy()),
                     float(optimizer.dynamic_scale.numpy()), model.get_weights()[0]))
    return rows, optimizer


@pytest.mark.parametrize("mode", ["fit", "fit_jit", "custom_keras3", "custom_shims",
                                  "custom_shims_tf_function"])
def test_train_step_table_reproduced_exactly(mode):
    rows, optimizer = run_golden(mode)
    for step, ((loss, overflow, scale, w), (g_loss, g_overflow, g_scale, g_w)) in enumerate(
            zip(rows, TABLE)):
        assert overflow == g_overflow, step
        assert scale == g_scale, step
        if math.isinf(g_loss):
            assert math.isinf(loss) or math.isnan(loss), step
        else:
            assert loss == pytest.approx(g_loss, rel=1e-6), step
        np.testing.assert_allclose(w, g_w, rtol=1e-6, err_msg=f"step {step}")
    np.testing.assert_array_equal(rows[2][3], rows[1][3])   # the skipped step changed nothing
    assert int(optimizer.skipped_steps.numpy()) == 1
    assert int(optimizer.iterations.numpy()) == 4


class _Recorder(keras.callbacks.Callback):
    """Keeps the logs that callbacks listed after the monitor (TensorBoard, CSVLogger) see."""

    def __init__(self):
        super().__init__()
        self.batches, self.epochs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def _fit_mixed_float16(callbacks):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = small_mlp()
        optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.05),
                                           mso.DynamicLossScaleManager(scale_window=4))
        model.compile(optimizer, "mse")
        assert model.optimizer is optimizer                  # not wrapped again
        assert model.layers[0].compute_dtype == "float16"
        x, y = regression_data(n=128)
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                            callbacks=[LossScaleMonitor(), *callbacks]).history
    finally:
        keras.config.set_dtype_policy("float32")
    return model, optimizer, history


@pytest.mark.half_precision
def test_mixed_float16_compile_keeps_our_optimizer_trains_and_logs():
    recorder = _Recorder()
    model, optimizer, history = _fit_mixed_float16([recorder])
    assert model.optimizer is optimizer
    assert history["loss"][-1] < 0.8 * history["loss"][0]
    assert all(np.isfinite(w).all() for w in model.get_weights())
    skipped = int(optimizer.skipped_steps.numpy())
    # 2**24 overflows float16 gradients: the first steps are skipped, visibly
    assert skipped >= 1
    assert skipped + int(optimizer.iterations.numpy()) == 3 * 8
    assert history["skipped_steps"][-1] == skipped
    assert history["loss_scale"][-1] == float(optimizer.dynamic_scale.numpy()) < 2.0**24
    assert history["last_step_skipped"][-1] == int(optimizer.last_step_skipped.numpy())
    # every batch's logs carry the state after that batch
    flags = [logs["last_step_skipped"] for logs in recorder.batches]
    counts = [logs["skipped_steps"] for logs in recorder.batches]
    assert len(flags) == 24 and sum(flags) == skipped
    assert counts == list(np.cumsum(flags))
    scales = [logs["loss_scale"] for logs in recorder.batches]
    for before, after, flag in zip([2.0**24] + scales, scales, flags):
        assert after == (max(before / 2, 1.0) if flag else before) or after == 2 * before
    assert [logs["loss_scale"] for logs in recorder.epochs] == history["loss_scale"]


def _read_scalars(log_dir):
    """{tag: [values by epoch]} of the epoch scalars in the TensorBoard events under ``log_dir``."""
    values = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if not value.tag.startswith("epoch_"):
                    continue          # the model-config text summary
                values.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return values


@pytest.mark.half_precision
def test_state_reaches_tensorboard(tmp_path):
    pytest.importorskip("tensorboard", reason="keras.callbacks.TensorBoard needs tensorboard")
    _, _, history = _fit_mixed_float16([keras.callbacks.TensorBoard(str(tmp_path))])
    scalars = _read_scalars(str(tmp_path / "train"))
    for name in ("loss_scale", "skipped_steps", "last_step_skipped"):
        assert scalars[f"epoch_{name}"] == [float(v) for v in history[name]]


@pytest.mark.half_precision
def test_mixed_precision_example_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["mixed_precision.py", "--epochs", "2"])
    try:
        runpy.run_path(os.path.join(REPO_ROOT, "examples", "mixed_precision.py"),
                       run_name="__main__")
    finally:
        keras.config.set_dtype_policy("float32")
    out = capsys.readouterr().out
    skipped, total = re.search(r"skipped steps: (\d+) of (\d+)", out).groups()
    assert int(total) == 2 * 23 and 1 <= int(skipped) < 23
    assert float(re.search(r"final validation accuracy ([\d.]+)", out).group(1)) > 0.8
