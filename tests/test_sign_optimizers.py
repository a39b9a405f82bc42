"""mso.AddSign / mso.PowerSign as Keras optimizers: numbers, modes, saving, distribution."""
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from helpers import regression_data, small_mlp
from test_ops_sign import S2, S2_M, S2_VAR, S3_VAR, numpy_sign_step

OPTIMIZERS = {"add_sign": (mso.AddSign, "alpha"), "power_sign": (mso.PowerSign, "logbase")}


def make_optimizer(rule, **kwargs):
    cls, coefficient = OPTIMIZERS[rule]
    kwargs.setdefault(coefficient, 0.7)
    return cls(**kwargs)


def linear_decay(step, decay_steps):
    return max(0.0, (decay_steps - min(step, decay_steps)) / decay_steps)


def run_steps(opt, var0, grads, mode):
    """Applies `grads` one per step in eager mode, in a tf.function, or in an XLA function."""
    var = keras.Variable(var0)
    opt.build([var])

    def apply(g):
        opt.apply([g], [var])

    if mode != "eager":
        apply = tf.function(apply, jit_compile=(mode == "xla"))
    for g in grads:
        apply(tf.constant(g))
    return var.numpy(), opt._momentums[0].numpy()


@pytest.mark.parametrize("rule", ["add_sign", "power_sign"])
@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize("jit_compile, fused", [(False, None), (False, False), (True, None)])
def test_optimizer_matches_numpy_over_steps(rule, mode, jit_compile, fused):
    rng = np.random.default_rng(7)
    var0 = rng.normal(size=(5, 4)).astype(np.float32)
    grads = rng.normal(size=(5, 5, 4)).astype(np.float32)
    lr_per_step = [0.1, 0.05, 0.02, 0.01, 0.01]
    opt = make_optimizer(rule, learning_rate=np.array(lr_per_step, np.float32), beta=0.8,
                         sign_decay=mso.schedules.LinearSignDecay(4), jit_compile=jit_compile)
    opt._fused = fused
    var, m = run_steps(opt, var0, grads, mode)
    expected_var, expected_m = var0, np.zeros_like(var0)
    for step, g in enumerate(grads):
        expected_var, expected_m = numpy_sign_step(rule, expected_var, expected_m,
                                                   lr_per_step[step], 0.7, linear_decay(step, 4),
                                                   0.8, g)
    np.testing.assert_allclose(var, expected_var, rtol=0, atol=1e-6)
    np.testing.assert_allclose(m, expected_m, rtol=0, atol=1e-6)
    assert int(opt.iterations.numpy()) == len(grads)


@pytest.mark.parametrize("rule, expected", [("add_sign", S2_VAR), ("power_sign", S3_VAR)])
def test_optimizer_reproduces_s2_s3(rule, expected):
    var = keras.Variable(np.asarray(S2["var"], np.float32))
    opt = make_optimizer(rule, learning_rate=S2["lr"], beta=S2["beta"],
                         sign_decay=S2["sign_decay"], **{OPTIMIZERS[rule][1]: 1.0 if rule ==
                                                         "add_sign" else math.e})
    opt.build([var])
    opt._momentums[0].assign(np.asarray(S2["m"], np.float32))
    opt.apply([tf.constant(S2["grad"], tf.float32)], [var])
    np.testing.assert_allclose(var.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(opt._momentums[0].numpy(), S2_M, atol=1e-6)


@pytest.mark.parametrize("rule", ["add_sign", "power_sign"])
def test_fit_lowers_the_loss(rule):
    x, y = regression_data()
    model = small_mlp()
    model.compile(optimizer=make_optimizer(rule, learning_rate=0.01), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=8, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.6 * losses[0]


def test_config_round_trip_and_keras_get():
    opt = mso.PowerSign(learning_rate=keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5),
                        logbase=0.5, beta=0.7,
                        sign_decay=mso.schedules.RestartSignDecay(100, 2.0, zero_after=1.5),
                        jit_compile=True, clipnorm=1.0)
    config = keras.optimizers.serialize(opt)
    restored = keras.optimizers.get(config)
    assert type(restored) is mso.PowerSign
    assert restored.get_config() == opt.get_config()
    assert isinstance(restored.sign_decay, mso.schedules.RestartSignDecay)
    assert restored.sign_decay.get_config() == {"decay_steps": 100, "num_periods": 2.0,
                                                "zero_after": 1.5}
    same = mso.AddSign.from_config(mso.AddSign(alpha=2.0, beta=0.5).get_config())
    assert (same.alpha, same.beta, same.sign_decay, same.jit_compile) == (2.0, 0.5, 1.0, False)
    assert keras.optimizers.get(opt) is opt


def test_export_serves_predictions(tmp_path):
    x, y = regression_data()
    model = small_mlp()
    model.compile(optimizer=mso.AddSign(learning_rate=0.01), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "export")
    model.export(path, verbose=False)
    served = tf.saved_model.load(path)
    np.testing.assert_allclose(served.serve(x).numpy(), model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.parametrize("kwargs, error, text", [
    ({"beta": 1.5}, ValueError, "'beta' must be in range of [0.0, 1.0]"),
    ({"beta": "0.9"}, TypeError, "'beta' should be 'float'"),
    ({"alpha": None}, TypeError, "'alpha' should be 'float'"),
    ({"sign_decay": "linear"}, TypeError, "'sign_decay' must be a float or a schedule"),
    ({"learning_rate": -0.1}, ValueError, "'learning_rate' must be finite and >= 0"),
    ({"learning_rate": "0.1"}, TypeError, "'learning_rate' must be a float"),
    ({"learning_rate": np.ones((2, 2))}, ValueError, "must be 0-D (a fixed value) or 1-D"),
    ({"learning_rate": [0.1, -0.1]}, ValueError, "must be finite and >= 0"),
    ({"jit_compile": 1}, TypeError, "'jit_compile' should be 'bool'"),
])
def test_add_sign_argument_errors(kwargs, error, text):
    with pytest.raises(error) as info:
        mso.AddSign(**kwargs)
    assert text in str(info.value)
    assert "AddSign" in str(info.value)


def test_power_sign_argument_errors():
    with pytest.raises(TypeError, match="'logbase' should be 'float'"):
        mso.PowerSign(logbase="e")
    with pytest.raises(ValueError, match="'beta' must be in range"):
        mso.PowerSign(beta=-0.1)
