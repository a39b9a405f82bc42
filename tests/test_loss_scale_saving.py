"""Loss scaling across save and resume: ``.keras`` (in a fresh process) and ``tf.train.Checkpoint``.

A run of 10 steps with overflows at steps 2 and 6 and a growth window of 3 is
stopped after 4 steps (the window half full), saved, restored and continued;
the scale, the counters and the weights after each step must equal those of an
uninterrupted run.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from helpers import (loss_scale_state, loss_scale_trace, overflow_batches, run_fresh_python,
                     small_mlp)

STOP = 4


def compiled_model(seed=0):
    model = small_mlp(seed=seed)
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                       mso.DynamicLossScaleManager(2.0**10, 2, 3))
    model.compile(optimizer, "mse")
    return model


@pytest.fixture(scope="module")
def uninterrupted():
    trace = loss_scale_trace(compiled_model(), overflow_batches())
    keras.backend.clear_session()
    return trace


def test_reference_run_exercises_overflow_growth_and_a_half_full_window(uninterrupted):
    assert [t["last_skipped"] for t in uninterrupted] == [0, 0, 1, 0, 0, 0, 1, 0, 0, 0]
    assert [t["scale"] for t in uninterrupted] == [1024, 1024, 512, 512, 512, 1024, 512, 512,
                                                   512, 1024]
    assert uninterrupted[STOP - 1]["counter"] == 1       # resuming must restore the counter


def _assert_same_trace(resumed, uninterrupted):
    assert len(resumed) == len(uninterrupted)
    for step, (got, want) in enumerate(zip(resumed, uninterrupted), start=STOP):
        for key in ("scale", "counter", "skipped", "last_skipped"):
            assert got[key] == want[key], (step, key)
        for g, w in zip(got["weights"], want["weights"]):
            np.testing.assert_array_equal(g, w, err_msg=f"step {step}")


def test_checkpoint_restores_scale_counters_and_resumes_identically(tmp_path, uninterrupted):
    batches = overflow_batches()
    model = compiled_model()
    loss_scale_trace(model, batches[:STOP])
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))

    restored = compiled_model(seed=7)                     # other weights, fresh state
    optimizer = restored.optimizer
    optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=optimizer).restore(path).assert_consumed()
    state = uninterrupted[STOP - 1]
    assert float(optimizer.dynamic_scale.numpy()) == state["scale"]
    assert int(optimizer.step_counter.numpy()) == state["counter"]
    assert int(optimizer.skipped_steps.numpy()) == state["skipped"]
    assert int(optimizer.last_step_skipped.numpy()) == state["last_skipped"]
    _assert_same_trace(loss_scale_trace(restored, batches[STOP:]), uninterrupted[STOP:])


@pytest.mark.slow
def test_keras_file_loads_in_fresh_process_and_resumes_identically(tmp_path, uninterrupted):
    model = compiled_model()
    loss_scale_trace(model, overflow_batches()[:STOP])
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = keras.models.load_model(path, safe_mode=True)   # in process: config and state
    optimizer = loaded.optimizer
    assert type(optimizer) is mso.LossScaleOptimizer
    assert isinstance(optimizer.scale_sense, mso.DynamicLossScaleManager)
    assert optimizer.scale_sense.get_config() == model.optimizer.scale_sense.get_config()
    for got, want in zip(optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())

    result = run_fresh_python(f"""
        import json, sys
        sys.path.insert(0, "tests")
        import keras
        import tf_msopt  # registers the classes before loading
        from helpers import loss_scale_trace, overflow_batches
        model = keras.models.load_model({path!r}, safe_mode=True)
        trace = loss_scale_trace(model, overflow_batches()[{STOP}:])
        print(json.dumps({{"optimizer": type(model.optimizer).__name__, "trace": trace}}))
    """)
    assert result["optimizer"] == "LossScaleOptimizer"
    _assert_same_trace(result["trace"], uninterrupted[STOP:])


@pytest.mark.equivalence
def test_backup_and_restore_resumes_an_interrupted_fit_with_the_loss_scale_state(tmp_path):
    x, y = (np.concatenate(parts) for parts in zip(*overflow_batches()))

    class Killed(Exception):
        pass

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise Killed

    def fit(model, callbacks):
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
        return loss_scale_state(model)

    uninterrupted = fit(compiled_model(), [])
    with pytest.raises(Killed):
        fit(compiled_model(), [keras.callbacks.BackupAndRestore(str(tmp_path)), Interrupt()])
    keras.backend.clear_session()
    resumed = fit(compiled_model(seed=7), [keras.callbacks.BackupAndRestore(str(tmp_path))])
    assert uninterrupted["skipped"] == 6          # two overflows per epoch
    for key in ("scale", "counter", "skipped", "last_skipped"):
        assert resumed[key] == uninterrupted[key], key
    for got, want in zip(resumed["weights"], uninterrupted["weights"]):
        np.testing.assert_array_equal(got, want)
