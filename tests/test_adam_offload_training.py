"""AdamOffload in training: placement on a separate host device, fit, XLA, MirroredStrategy,
tf.train.Checkpoint / BackupAndRestore / .keras resume, and the example script."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO_ROOT, regression_data, run_fresh_python, small_mlp
from test_adam_offload import use_backend

import tf_msopt as mso


@pytest.fixture(params=["kernel", "pure_tf"])
def backend(request, monkeypatch):
    use_backend(monkeypatch, request.param)
    return request.param


def make_optimizer(host_device="/CPU:0", state_dtype="float32"):
    """Every feature that carries state: decay, Nesterov, loss scale, a group, a schedule."""
    return mso.AdamOffload(
        learning_rate=keras.optimizers.schedules.CosineDecay(0.02, decay_steps=16), beta1=0.8,
        use_nesterov=True, weight_decay=1e-3, loss_scale=4.0, host_device=host_device,
        groups=[{"params": ["head/"], "learning_rate": 0.01, "weight_decay": 0.0}],
        state_dtype=state_dtype)


def compiled_mlp(optimizer, **compile_kwargs):
    model = small_mlp()
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


def host_state(optimizer):
    return [v for v in optimizer.variables
            if v is not optimizer.iterations and v is not optimizer._learning_rate]


def test_state_on_host_device_update_on_variable_device(backend):
    """Two logical CPUs stand for accelerator (/CPU:0, the model) and host (/CPU:1)."""
    x, y = regression_data()
    reference = compiled_mlp(make_optimizer("/CPU:0"))
    offloaded = compiled_mlp(make_optimizer("/CPU:1"))
    for model in (reference, offloaded):
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # 8 steps
    assert offloaded.optimizer._group_index == [None, None, 0, 0]  # the head's two variables
    assert all(v.value.device.endswith("CPU:0") for v in offloaded.trainable_variables)
    state = host_state(offloaded.optimizer)
    assert len(state) == 2 * 4 + 3  # m and v per variable, two beta powers, their step
    assert all(v.value.device.endswith("CPU:1") for v in state)
    np.testing.assert_array_equal(offloaded.optimizer.moments[0][0].numpy(),
                                  reference.optimizer.moments[0][0].numpy())
    initial = small_mlp().get_weights()
    for got, want, w0 in zip(offloaded.get_weights(), reference.get_weights(), initial):
        assert np.abs(want - w0).max() > 1e-3
        np.testing.assert_array_equal(got, want)

    # Where the ops of a step run: the host math on /CPU:1, `w += delta` on /CPU:0.
    model = offloaded
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    step = tf.function(lambda: model.optimizer.apply(grads, model.trainable_variables))
    ops = step.get_concrete_function().graph.get_operations()
    host_math = [op for op in ops if op.type in ("MsOptAdamOffloadDeltas", "Sqrt")]
    device_ops = [op.type for op in ops if op.device.endswith("CPU:0")]
    assert host_math and all(op.device.endswith("CPU:1") for op in host_math)
    assert device_ops.count("AssignAddVariableOp") == 4  # one `w += delta` per variable
    assert not {"Sqrt", "RealDiv", "MsOptAdamOffloadDeltas"} & set(device_ops)


def test_xla_compiled_train_step_fails_clearly():
    x, y = regression_data()
    model = compiled_mlp(mso.AdamOffload(0.01), jit_compile=True)
    with pytest.raises(RuntimeError, match=r"compile\(\.\.\., jit_compile=False\)"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("simulated crash")


def test_backup_and_restore_resumes_exactly(tmp_path):
    x, y = regression_data()
    uninterrupted = compiled_mlp(make_optimizer())
    uninterrupted.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    backup = keras.callbacks.BackupAndRestore(os.path.join(tmp_path, "backup"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        compiled_mlp(make_optimizer()).fit(x, y, batch_size=16, epochs=3, shuffle=False,
                                           verbose=0, callbacks=[backup, _Interrupt()])
    restarted = compiled_mlp(make_optimizer())
    restarted.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[backup])
    assert int(restarted.optimizer.iterations.numpy()) == 12
    for got, want in zip(restarted.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.equivalence
def test_compact_state_mirrored_equals_one_device_and_checkpoints_in_its_dtype(
        state_dtype, backend, two_cpu_strategy, tmp_path):
    """Every stateful feature, compact moments: two replicas give one device's weights (to
    the rounding of the all-reduced gradients' sum, 1e-5) and, one step ahead, a stored
    moment that differs by at most one code (a bfloat16 ulp; an int8 level of the same
    block scale); a checkpoint holds the moments in their dtype and a restored optimizer
    continues exactly."""
    x, y = regression_data()
    one = compiled_mlp(make_optimizer(state_dtype=state_dtype))
    with two_cpu_strategy.scope():
        mirrored = compiled_mlp(make_optimizer(state_dtype=state_dtype))
    for model in (one, mirrored):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(mirrored.get_weights(), one.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(host_state(mirrored.optimizer), host_state(one.optimizer)):
        got, want = got.numpy(), want.numpy()
        if got.dtype == np.float32:   # beta powers, int8 scales
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
        else:
            got, want = (np.asarray(x).view(np.uint16).astype(np.int64) if x.dtype.itemsize == 2
                         else x.astype(np.int64) for x in (got, want))
            assert np.abs(got - want).max() <= 1 and np.mean(got != want) < 0.1

    path = tf.train.Checkpoint(model=one, optimizer=one.optimizer).write(str(tmp_path / "c"))
    stored = [dtype.name for dtype in
              tf.train.load_checkpoint(path).get_variable_to_dtype_map().values()]
    want = {"bfloat16": 8} if state_dtype == "bfloat16" else {"int8": 4, "uint8": 4}
    assert {name: stored.count(name) for name in want} == want   # m and v of 4 variables
    one.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    restored = compiled_mlp(make_optimizer(state_dtype=state_dtype))
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
        path).assert_consumed()
    restored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(restored.get_weights(), one.get_weights()):
        np.testing.assert_array_equal(got, want)


RESUME_SCRIPT = """
import json, sys
import keras, numpy as np
sys.path.insert(0, "tests")
import tf_msopt
from helpers import regression_data
x, y = regression_data()
model = keras.models.load_model({path!r}, safe_mode=True)
opt = model.optimizer
model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
print(json.dumps({{"weights": [w.tolist() for w in model.get_weights()],
                   "type": type(opt).__name__, "groups": opt.get_config()["groups"],
                   "group_index": list(opt._group_index),
                   "host": [v.value.device for v in opt.moments[0]],
                   "iterations": int(opt.iterations.numpy()),
                   "status": tf_msopt.ops.custom_ops_status()}}))
"""


@pytest.mark.slow
def test_example_runs_at_a_tiny_size():
    code = f"""
        import runpy, sys
        sys.argv = ["adam_offload.py", "--epochs", "2", "--steps", "3", "--vocab", "500",
                    "--width", "64", "--json"]
        runpy.run_path({os.path.join(REPO_ROOT, "examples", "adam_offload.py")!r},
                       run_name="__main__")
    """
    result = run_fresh_python(code)
    assert result["steps"] == 6 and len(result["loss"]) == 2
    assert result["loss"][-1] < result["loss"][0]
    assert result["optimizer_state_on"].endswith("CPU:0")
    # m and v in float32 per parameter; two float32 beta powers and an int64 step
    assert result["optimizer_state_bytes"] == 2 * 4 * result["parameters"] + 4 + 4 + 8
