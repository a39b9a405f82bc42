"""Save at a stale step, resume in a fresh process: equal to an uninterrupted run."""
import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO_ROOT, regression_data, small_mlp
from test_thor_training import mixed_data, mixed_model

import tf_msopt as mso

BEFORE, AFTER = 4, 4      # frequency 3: THOR steps 0, 3, 6; the save comes before stale step 4


def make(frequency=3):
    model = mixed_model()
    optimizer = mso.thor(model, np.linspace(0.05, 0.02, 16), [0.05] * 16, 0.9, frequency=frequency,
                         block_size=4, weight_decay=1e-3, decay_filter=["bias"])
    model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer


def steps(model, first, count):
    x, y = mixed_data(8 * (BEFORE + AFTER))
    for i in range(first, first + count):
        model.train_on_batch([x[0][8 * i:8 * i + 8], x[1][8 * i:8 * i + 8]], y[8 * i:8 * i + 8])


@pytest.mark.equivalence
def test_loaded_model_resumes_second_order_after_connect(tmp_path):
    """In-process: the loaded inverses are used (not reset to identity) once connected."""
    model, optimizer = make(frequency=100)
    steps(model, 0, 2)
    path = str(tmp_path / "thor.keras")
    model.save(path)
    keras.backend.clear_session()
    loaded = keras.models.load_model(path, safe_mode=True)
    for saved, restored in zip(optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())
    with pytest.raises(RuntimeError, match="not connected"):
        steps(loaded, 2, 1)
    mso.thor.connect(loaded)
    steps(loaded, 2, 1)
    steps(model, 2, 1)
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert json.dumps(loaded.optimizer.get_config()) == json.dumps(optimizer.get_config())


def test_export_during_fit_serves_predict_and_leaves_training_unchanged(tmp_path):
    """``model.export`` at each epoch's end of a THOR ``fit``: the export serves what
    ``predict`` gives then, and the training goes on exactly as without the exports."""
    x, y = regression_data(n=48)
    served, predicted = [], []

    class ExportEachEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            path = str(tmp_path / f"epoch_{epoch}")
            self.model.export(path, verbose=False)
            loaded = tf.saved_model.load(path)
            served.append(loaded.serve(tf.constant(x[:5])).numpy())
            predicted.append(self.model.predict(x[:5], verbose=0))

    def fit(callbacks):
        model = small_mlp()
        model.compile(optimizer=mso.thor(model, 0.05, 0.03, 0.9, frequency=4), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return model.get_weights()

    exported = fit([ExportEachEpoch()])
    for got, want in zip(exported, fit([])):
        np.testing.assert_array_equal(got, want)
    assert len(served) == 2
    for got, want in zip(served, predicted):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_export_example_serves_without_tf_msopt():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    result = subprocess.run([sys.executable, "examples/thor_export.py", "--epochs", "1"],
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tf_msopt imported: False" in result.stdout
    difference = re.search(r"predicted probabilities: (\S+)", result.stdout).group(1)
    assert float(difference) <= 1e-6, result.stdout
