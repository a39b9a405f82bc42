"""The shared base: learning-rate forms, variable filters, argument checks, schedules, the
entry points AutoGraph leaves unconverted."""
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from helpers import RECORD_AUTOGRAPH, run_fresh_python
from tf_msopt import _validation as v
from tf_msopt._common import register
from tf_msopt.optimizers.base import (MindSporeOptimizer, check_filter, make_variable_filter,
                                      resolve_learning_rate, serialize_filter)


# ---------------------------------------------------------------- learning rates
@pytest.mark.parametrize("form", [
    [0.3, 0.2, 0.1],
    (0.3, 0.2, 0.1),
    np.array([0.3, 0.2, 0.1], np.float32),
    tf.constant([0.3, 0.2, 0.1]),
    (x for x in [0.3, 0.2, 0.1]),
])
def test_per_step_forms_give_entry_i_at_step_i(form):
    schedule = resolve_learning_rate(form, "Test")
    assert isinstance(schedule, mso.schedules.PerStepSchedule)
    values = [float(schedule(step)) for step in range(5)]
    np.testing.assert_allclose(values, [0.3, 0.2, 0.1, 0.1, 0.1], rtol=1e-6)  # last value held


@pytest.mark.parametrize("form", [0.25, np.float32(0.25), tf.constant(0.25), np.array(0.25)])
def test_fixed_forms_give_a_float(form):
    assert resolve_learning_rate(form, "Test") == pytest.approx(0.25)


def test_int_learning_rate_is_accepted_as_float():
    assert resolve_learning_rate(1, "Test") == 1.0 and isinstance(resolve_learning_rate(1, "T"), float)


def test_keras_schedules_and_callables_pass_through():
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 100)
    assert resolve_learning_rate(schedule, "Test") is schedule
    fn = lambda: 0.1  # noqa: E731
    assert resolve_learning_rate(fn, "Test") is fn


@pytest.mark.parametrize("value, error", [
    (True, TypeError), ("0.1", TypeError), (None, TypeError), (object(), TypeError),
    (np.array(["a"]), TypeError), (-1.0, ValueError), (float("nan"), ValueError),
    (np.ones((2, 2)), ValueError), ([0.1, float("inf")], ValueError), ([[0.1]], TypeError),
    (keras.layers.Dense(2), TypeError),     # callable, but a layer (mso.AddSign(model))
])
def test_bad_learning_rates(value, error):
    with pytest.raises(error, match="For 'Test', .*'learning_rate'"):
        resolve_learning_rate(value, "Test")


def test_per_step_learning_rate_drives_training():
    var = keras.Variable(np.zeros(2, np.float32))
    opt = mso.AddSign(learning_rate=[0.1, 0.01], alpha=1.0, sign_decay=0.0)
    for _ in range(3):
        opt.apply([tf.constant([1.0, -1.0])], [var])
    # steps use 0.1, 0.01, then the last value again: total step 0.12 per coordinate.
    np.testing.assert_allclose(var.numpy(), [-0.12, 0.12], rtol=1e-6)


def test_per_step_schedule_config_round_trip():
    schedule = mso.schedules.PerStepSchedule([0.5, 0.25])
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert restored.get_config() == {"values": [0.5, 0.25]}
    with pytest.raises(ValueError, match="'values' must be a non-empty 1-D"):
        mso.schedules.PerStepSchedule([])


# ---------------------------------------------------------------- filters
def _variables():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc"),
                              keras.layers.LayerNormalization(name="LayerNorm_1"),
                              keras.layers.Dense(1, name="head")])
    return {v.path.split("/", 1)[1]: v for v in model.trainable_variables}


def test_default_excludes_regex_list_and_callable():
    variables = _variables()
    default = make_variable_filter(None, ["bias", "(?i)layer_?norm"], "lars_filter", "T")
    assert {k: default(x) for k, x in variables.items()} == {
        "fc/kernel": True, "fc/bias": False, "LayerNorm_1/gamma": False,
        "LayerNorm_1/beta": False, "head/kernel": True, "head/bias": False}
    regex = make_variable_filter(["^.*head"], [], "decay_filter", "T")
    assert [k for k, x in variables.items() if not regex(x)] == ["head/kernel", "head/bias"]
    by_shape = make_variable_filter(lambda x: len(x.shape) == 2, [], "decay_filter", "T")
    assert [k for k, x in variables.items() if by_shape(x)] == ["fc/kernel", "head/kernel"]


@pytest.mark.parametrize("spec, error", [("bias", TypeError), ([1], TypeError),
                                         (["("], ValueError), (3, TypeError)])
def test_bad_filters(spec, error):
    with pytest.raises(error, match="'lars_filter'"):
        check_filter(spec, "lars_filter", "LARS")


@register
def _only_kernels(variable):
    return variable.path.endswith("kernel")


def test_filter_serialization():
    assert serialize_filter(None, "f", "T") is None
    assert serialize_filter(("bias",), "f", "T") == ["bias"]
    config = serialize_filter(_only_kernels, "f", "T")
    assert keras.saving.deserialize_keras_object(config) is _only_kernels
    with pytest.raises(ValueError, match="'decay_filter' is the Python callable .* cannot be saved"):
        serialize_filter(lambda x: True, "decay_filter", "T")


@register
class FilteredSGD(MindSporeOptimizer):
    """Test optimizer: SGD with L2 decay on the variables that pass ``decay_filter``."""

    def __init__(self, learning_rate=0.1, weight_decay_l2=0.5, decay_filter=None, name="fsgd",
                 **kwargs):
        super().__init__(learning_rate, name=name, **kwargs)
        self.weight_decay_l2 = weight_decay_l2
        self.decay_filter = check_filter(decay_filter, "decay_filter", "FilteredSGD")

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        keep = make_variable_filter(self.decay_filter, ["bias"], "decay_filter", "FilteredSGD")
        self._decay = [keep(x) for x in var_list]

    def _update(self, gradient, variable, learning_rate):
        if self._decay[self._get_variable_index(variable)]:
            gradient = gradient + self.weight_decay_l2 * variable
        self.assign_sub(variable, learning_rate * gradient)

    def get_config(self):
        config = super().get_config()
        config.update(weight_decay_l2=self.weight_decay_l2,
                      decay_filter=serialize_filter(self.decay_filter, "decay_filter", "FilteredSGD"))
        return config


LOAD_SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import keras, numpy as np
import test_base  # registers FilteredSGD
model = keras.models.load_model({path!r}, safe_mode=True)
opt = model.optimizer
opt.build(model.trainable_variables)
print(json.dumps({{"filter": opt.decay_filter, "decay": opt._decay,
                   "type": type(opt).__name__}}))
"""


@pytest.mark.slow
def test_regex_filter_survives_load_model_safe_mode(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc"),
                              keras.layers.Dense(1, name="head")])
    model.compile(optimizer=FilteredSGD(decay_filter=["head"]), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    result = run_fresh_python(LOAD_SCRIPT.format(path=path))
    assert result == {"filter": ["head"], "decay": [True, True, False, False], "type": "FilteredSGD"}


def test_lambda_filter_refuses_to_save(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=FilteredSGD(decay_filter=lambda x: True), loss="mse")
    with pytest.raises(ValueError, match="cannot be saved"):
        model.save(os.path.join(tmp_path, "m.keras"))
    # Keras opens the file before serializing; the error leaves it empty, never a half model.
    path = os.path.join(tmp_path, "m.keras")
    assert not os.path.exists(path) or os.path.getsize(path) == 0


def test_filter_decides_the_update():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, name="fc",
                                                                     kernel_initializer="ones",
                                                                     bias_initializer="ones")])
    opt = FilteredSGD(learning_rate=0.1, weight_decay_l2=0.5)
    opt.apply([tf.zeros((1, 1)), tf.zeros((1,))], model.trainable_variables)
    kernel, bias = (x.numpy() for x in model.trainable_variables)
    np.testing.assert_allclose(kernel, [[0.95]])  # decayed: 1 - 0.1 * 0.5 * 1
    np.testing.assert_allclose(bias, [1.0])       # excluded by the default 'bias' pattern


# ---------------------------------------------------------------- argument checks
def test_validation_helpers():
    assert v.check_float(1, "x", "T") == 1.0
    with pytest.raises(TypeError, match="For 'LARS', the type of 'epsilon' should be 'float', "
                                        "but got type 'int'."):
        v.check_float(1, "epsilon", "LARS", allow_int=False)
    with pytest.raises(TypeError, match="should be 'float', but got type 'bool'"):
        v.check_float(True, "x", "T")
    with pytest.raises(TypeError, match="'frequency' should be 'int', but got type 'float'"):
        v.check_int(2.0, "frequency", "thor")
    with pytest.raises(ValueError, match="'frequency' must be at least 2, but got 1"):
        v.check_int(1, "frequency", "thor", min_value=2)
    with pytest.raises(TypeError, match="'use_clip' should be 'bool', but got type 'int'"):
        v.check_bool(1, "use_clip", "LARS")
    with pytest.raises(ValueError, match=r"'beta1' must be in range of \(0.0, 1.0\), but got 1.0"):
        v.check_number_range(1.0, "beta1", "AdamOffload", 0.0, 1.0, False, False)
    assert v.check_number_range(0.5, "beta1", "AdamOffload", 0.0, 1.0, False, False) == 0.5
    with pytest.raises(ValueError, match="'beta' must be in range of .* but got nan"):
        v.check_number_range(float("nan"), "beta", "AddSign", 0.0, 1.0)


# ---------------------------------------------------------------- sign decays
def test_sign_decay_schedules_match_their_formulas():
    steps = np.arange(0, 14)
    linear = mso.schedules.LinearSignDecay(10)
    cosine = mso.schedules.CosineSignDecay(10, num_periods=1.5, zero_after=1.0)
    restart = mso.schedules.RestartSignDecay(10, num_periods=3.0, zero_after=2.0)
    for t in steps:
        tc = min(t, 10)
        assert float(linear(t)) == pytest.approx(max(0.0, (10 - tc) / 10), abs=1e-6)
        fraction = 2 * 1.5 * tc / 10
        want = 0.0 if fraction >= 2.0 else 0.5 * (1 + math.cos(math.pi * fraction))
        assert float(cosine(t)) == pytest.approx(want, abs=1e-6)
        cycles = 3.0 * tc
        want = 0.0 if cycles / 10 >= 2.0 else 0.5 * (1 + math.cos(math.pi * (cycles % 10) / 10))
        assert float(restart(t)) == pytest.approx(want, abs=1e-6)
    assert float(mso.schedules.CosineSignDecay(10)(10)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("make, error", [
    (lambda: mso.schedules.LinearSignDecay(0), ValueError),
    (lambda: mso.schedules.LinearSignDecay(2.5), TypeError),
    (lambda: mso.schedules.CosineSignDecay(10, num_periods=0.0), ValueError),
    (lambda: mso.schedules.RestartSignDecay(10, zero_after="x"), TypeError),
])
def test_sign_decay_argument_errors(make, error):
    with pytest.raises(error):
        make()


OPS_AUTOGRAPH_CODE = RECORD_AUTOGRAPH + """
import numpy as np
import tf_msopt as mso
matrices = tf.constant(np.eye(4, dtype=np.float32)[None] * 2.0)
grad = tf.fill([8], 0.5)
def state():
    return tf.Variable(tf.ones([8])), tf.Variable(tf.zeros([8]))
calls = {
    "damped_inverse": (mso.ops.damped_inverse, matrices, 0.1),
    "apply_add_sign": (mso.ops.apply_add_sign, *state(), 0.1, 1.0, 1.0, 0.9, grad),
    "apply_power_sign": (mso.ops.apply_power_sign, *state(), 0.1, 2.718, 1.0, 0.9, grad),
    "adam_offload_step": (mso.ops.adam_offload_step, *state(), grad, 0.9, 0.999, 1e-3, 0.9,
                          0.999, 1e-8),
    "adam_offload_steps": (mso.ops.adam_offload_steps, *([x] for x in state()), [grad], 0.9,
                           0.999, 1e-3, 0.9, 0.999, 1e-8),
}
print(json.dumps({name: package_code_converted(*call) for name, call in calls.items()}))
"""


@pytest.mark.slow
def test_autograph_in_a_users_tf_function_converts_no_op_code():
    """The public ops in a custom loop's ``tf.function`` (AutoGraph on): converting them and
    what they call cost a first trace 0.3-0.6 s each."""
    results = run_fresh_python(OPS_AUTOGRAPH_CODE)
    assert set(results) == {"damped_inverse", "apply_add_sign", "apply_power_sign",
                            "adam_offload_step", "adam_offload_steps"}
    assert all(converted == [] for converted in results.values()), results
