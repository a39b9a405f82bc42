"""Save at a stale step, resume in a fresh process: equal to an uninterrupted run."""
import json

import keras
import numpy as np
import pytest
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
