"""mso.ops.apply_add_sign / apply_power_sign: MindSpore's golden values and op contract."""
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from tf_msopt.ops import _loader
from tf_msopt.ops.sign import _custom_kernel, update_sign_variables

# MindSpore's S1 (the ApplyAddSign docstring example).
S1 = dict(var=[[0.6, 0.4], [0.1, 0.5]], m=[[0.6, 0.5], [0.2, 0.6]], lr=0.001, alpha=1.0,
          sign_decay=0.99, beta=0.9, grad=[[0.3, 0.7], [0.1, 0.8]])
S1_VAR = [[0.5994030237, 0.3986070156], [0.0998010039, 0.4984079897]]
S1_M = [[0.5700000525, 0.5199999809], [0.1899999976, 0.6200000644]]
S1_VAR_F16 = [[0.59961, 0.39844], [0.099792, 0.49829]]
# S2 / S3: old vs new m.
S2 = dict(var=[1.0, 1.0, 1.0, 1.0], m=[0.05, -0.5, 0.0, 0.3], lr=0.1, sign_decay=0.5, beta=0.9,
          grad=[-1.0, 0.3, 0.2, 0.0])
S2_M = [-0.055, -0.42, 0.02, 0.27]
S2_VAR = [1.15, 0.985, 0.97, 1.0]
S2_VAR_WITH_OLD_M = [1.05, 0.985, 0.98, 1.0]
S3_VAR = [1.3892847, 0.99229354, 0.92214304, 1.0]


def numpy_sign_step(rule, var, m, lr, coefficient, sign_decay, beta, grad):
    """The sign optimizers' formula in NumPy float64."""
    var, m, grad = (np.asarray(a, np.float64) for a in (var, m, grad))
    m = beta * m + (1 - beta) * grad
    sign_product = np.sign(grad) * np.sign(m)
    if rule == "add_sign":
        scale = coefficient + sign_decay * sign_product
    else:
        scale = np.exp(coefficient * sign_decay * sign_product)
    return var - lr * scale * grad, m


def _arrays(case, dtype):
    return {k: (np.asarray(v, dtype) if isinstance(v, list) else v) for k, v in case.items()}


@pytest.mark.parametrize("in_place", [False, True])
def test_s1_float32(in_place):
    c = _arrays(S1, np.float32)
    var, m = (tf.Variable(c["var"]), tf.Variable(c["m"])) if in_place else (c["var"], c["m"])
    new_var, new_m = mso.ops.apply_add_sign(var, m, c["lr"], c["alpha"], c["sign_decay"], c["beta"],
                                            c["grad"])
    np.testing.assert_allclose(new_var.numpy(), S1_VAR, rtol=0, atol=1e-6)
    np.testing.assert_allclose(new_m.numpy(), S1_M, rtol=0, atol=1e-6)
    if in_place:
        np.testing.assert_array_equal(var.numpy(), new_var.numpy())
        np.testing.assert_array_equal(m.numpy(), new_m.numpy())
    else:
        np.testing.assert_array_equal(var, np.asarray(S1["var"], np.float32))  # inputs left alone


@pytest.mark.parametrize("in_place", [False, True])
def test_s1_float16_to_half_precision(in_place):
    c = _arrays(S1, np.float16)
    var, m = (tf.Variable(c["var"]), tf.Variable(c["m"])) if in_place else (c["var"], c["m"])
    new_var, _ = mso.ops.apply_add_sign(var, m, np.float16(c["lr"]), np.float16(1.0),
                                        np.float16(0.99), np.float16(0.9), c["grad"])
    assert new_var.dtype == tf.float16
    half_ulp = np.spacing(np.abs(np.asarray(S1_VAR_F16, np.float16)))
    np.testing.assert_allclose(new_var.numpy().astype(np.float64), S1_VAR_F16, rtol=0,
                               atol=float(half_ulp.max()))


@pytest.mark.parametrize("in_place", [False, True])
def test_s2_uses_new_m(in_place):
    c = _arrays(S2, np.float32)
    var, m = (tf.Variable(c["var"]), tf.Variable(c["m"])) if in_place else (c["var"], c["m"])
    new_var, new_m = mso.ops.apply_add_sign(var, m, c["lr"], 1.0, c["sign_decay"], c["beta"],
                                            c["grad"])
    np.testing.assert_allclose(new_m.numpy(), S2_M, atol=1e-6)
    np.testing.assert_allclose(new_var.numpy(), S2_VAR, atol=1e-6)
    assert np.abs(new_var.numpy() - S2_VAR_WITH_OLD_M).max() > 0.05


@pytest.mark.parametrize("in_place", [False, True])
def test_s3_power_sign(in_place):
    c = _arrays(S2, np.float32)
    var, m = (tf.Variable(c["var"]), tf.Variable(c["m"])) if in_place else (c["var"], c["m"])
    new_var, new_m = mso.ops.apply_power_sign(var, m, c["lr"], float(np.e), c["sign_decay"],
                                              c["beta"], c["grad"])
    np.testing.assert_allclose(new_var.numpy(), S3_VAR, atol=1e-6)
    np.testing.assert_allclose(new_m.numpy(), S2_M, atol=1e-6)


@pytest.mark.parametrize("rule", ["add_sign", "power_sign"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [300, 100_003])  # one shard, and many across threads
def test_all_kernel_paths_agree(rule, dtype, size):
    rng = np.random.default_rng(3)
    var0, m0 = rng.normal(size=(2, size)).astype(dtype)
    grads = rng.normal(size=(4, size)).astype(dtype)
    grads[:, :20] = 0.0  # sign(0) = 0 on every path
    # None: the package's one-pass kernel when loaded; True: TF's fused kernel; False: plain ops.
    paths = (None, True, False)
    results = {}
    for fused in paths:
        var, m = tf.Variable(var0), tf.Variable(m0)
        for g in grads:
            hyper = [tf.constant(x, dtype) for x in (0.05, 0.7, 0.5, 0.9)]
            update_sign_variables(rule, var, m, *hyper, tf.constant(g), fused=fused)
        results[fused] = (var.numpy(), m.numpy())
    expected_var, expected_m = var0, m0
    for g in grads:
        expected_var, expected_m = numpy_sign_step(rule, expected_var, expected_m, 0.05, 0.7, 0.5,
                                                   0.9, g)
    for fused in paths:
        np.testing.assert_allclose(results[fused][0], expected_var, rtol=0, atol=1e-6)
        np.testing.assert_allclose(results[fused][1], expected_m, rtol=0, atol=1e-6)
        np.testing.assert_allclose(results[fused][0], results[False][0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("rule", ["add_sign", "power_sign"])
def test_dispatch_uses_the_one_pass_kernel_unless_disabled(rule):
    """`make test` builds the ops, and runs the suite again with the kill switch."""
    kernel = _custom_kernel(rule, tf.float32, "/job:localhost/device:CPU:0")
    if os.environ.get(_loader.DISABLE_ENV):
        assert kernel is None
    else:
        assert mso.ops.custom_ops_available(), mso.ops.custom_ops_status()
        assert kernel is not None
    # Never inside XLA, which cannot compile the custom op, nor for dtypes it lacks.
    assert tf.function(lambda: tf.constant(_custom_kernel(rule, tf.float32, "CPU:0") is None),
                       jit_compile=True)().numpy()
    assert _custom_kernel(rule, tf.float16, "CPU:0") is None
    assert _custom_kernel(rule, tf.float32, "/device:GPU:0") is None


@pytest.mark.parametrize("rule, coefficient", [("add_sign", "alpha"),
                                               ("power_sign", "logbase")])
def test_one_pass_kernel_names_an_input_that_is_not_a_scalar(rule, coefficient):
    """The kernel's own check, behind the wrappers' (which reshape size-1 inputs)."""
    kernel = _custom_kernel(rule, tf.float32, "/job:localhost/device:CPU:0")
    if kernel is None:
        pytest.skip("custom ops not loaded (the kill-switch pass tests the TF path)")
    var, m = tf.Variable(np.ones(3, np.float32)), tf.Variable(np.zeros(3, np.float32))
    scalars = dict(lr=0.1, sign_decay=0.0, beta=0.9, **{coefficient: 1.0})
    for name in scalars:
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=f"'{name}' must be a scalar, but got shape \\[2\\]"):
            kernel(var=var.handle, m=m.handle, grad=tf.ones(3),
                   **{**scalars, name: tf.ones(2)})


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
def test_eager_function_and_xla_agree(mode):
    c = _arrays(S2, np.float32)
    var, m = tf.Variable(c["var"]), tf.Variable(c["m"])

    def step():
        return mso.ops.apply_power_sign(var, m, c["lr"], float(np.e), c["sign_decay"], c["beta"],
                                        c["grad"])

    if mode != "eager":
        step = tf.function(step, jit_compile=(mode == "xla"))
    new_var, _ = step()
    np.testing.assert_allclose(new_var.numpy(), S3_VAR, atol=1e-6)


def test_float16_grad_with_float32_var_promotes_to_float32():
    c = _arrays(S1, np.float32)
    new_var, new_m = mso.ops.apply_add_sign(c["var"], c["m"], 0.001, 1.0, 0.99, 0.9,
                                            c["grad"].astype(np.float16))
    assert new_var.dtype == tf.float32 and new_m.dtype == tf.float32
    np.testing.assert_allclose(new_var.numpy(), S1_VAR, atol=1e-4)


def test_float64_is_computed_in_float64():
    c = _arrays(S1, np.float64)
    new_var, _ = mso.ops.apply_add_sign(c["var"], c["m"], 0.001, 1.0, 0.99, 0.9, c["grad"])
    expected, _ = numpy_sign_step("add_sign", c["var"], c["m"], 0.001, 1.0, 0.99, 0.9, c["grad"])
    np.testing.assert_allclose(new_var.numpy(), expected, rtol=1e-14)


def _call(op="add", **overrides):
    args = _arrays(S1, np.float32)
    args.update(overrides)
    fn = mso.ops.apply_add_sign if op == "add" else mso.ops.apply_power_sign
    coefficient = args.pop("alpha")
    return fn(args["var"], args["m"], args["lr"], coefficient, args["sign_decay"], args["beta"],
              args["grad"])


@pytest.mark.parametrize("op", ["add", "power"])
@pytest.mark.parametrize("overrides, error, text", [
    ({"var": np.ones((2, 2), np.int32)}, TypeError, "var"),
    ({"grad": np.ones((2, 2), np.int32)}, TypeError, "grad"),
    ({"m": np.ones((2, 2), np.int64)}, TypeError, "m"),
    ({"m": np.ones((2, 3), np.float32)}, ValueError, "'m' and 'var' must have the same shape"),
    ({"grad": np.ones((3,), np.float32)}, ValueError, "'grad' and 'var' must have the same shape"),
    ({"lr": np.array([0.1, 0.2], np.float32)}, ValueError, "lr_shape[0] must be equal to 1"),
    ({"beta": np.ones((1, 1), np.float32)}, ValueError, "'beta' must have rank <= 1"),
    ({"lr": 1}, TypeError, "lr"),
    ({"lr": "0.1"}, TypeError, "lr"),
    ({"alpha": True}, TypeError, ""),
    ({"sign_decay": np.array(1, np.int32)}, TypeError, "sign_decay"),
    ({"beta": None}, TypeError, "beta"),
])
def test_op_contract_errors(op, overrides, error, text):
    with pytest.raises(error) as info:
        _call(op, **overrides)
    assert text in str(info.value)


def test_rank_one_scalar_of_size_one_is_accepted():
    new_var, _ = _call(lr=np.array([0.001], np.float32))
    np.testing.assert_allclose(new_var.numpy(), S1_VAR, atol=1e-6)
