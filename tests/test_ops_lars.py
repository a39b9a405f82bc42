"""LARS + SGD-momentum update (tf_msopt/ops/lars.py): kernel, pure-TF path, NumPy formula."""
import functools

import helpers
import keras
import numpy as np
import pytest
import tensorflow as tf
from test_lars import lars_reference

import tf_msopt as mso
from tf_msopt.ops.lars import _kernel, apply_lars_momentum, lars_gradient, lars_momentum_kernel


use_backend = functools.partial(helpers.use_backend,
                                kernel="ms_opt_resource_apply_lars_momentum", source="lars_ops.cc")


@pytest.fixture(params=["kernel", "pure_tf"])
def backend(request, monkeypatch):
    use_backend(monkeypatch, request.param)
    return request.param


def numpy_lars_momentum(w, a, g, lr, momentum, weight_decay, coefficient, epsilon, use_clip,
                        use_nesterov):
    """MindSpore's LARS with Keras SGD's momentum step, in float64."""
    w, a = np.asarray(w, np.float64), np.asarray(a, np.float64)
    step = lr * lars_reference(w, g, weight_decay, lr, coefficient, epsilon, use_clip)
    a = momentum * a - step
    w = w + (momentum * a - step if use_nesterov else a)
    return w, a


def run_steps(dtype, size, use_clip, use_nesterov, weight_decay=1e-4, lr=0.1, steps=3,
              zero_weights=False, function=True):
    rng = np.random.default_rng(3)
    w0 = np.zeros(size, dtype) if zero_weights else (rng.normal(size=size) * 0.1).astype(dtype)
    w, a = tf.Variable(w0), tf.Variable(np.zeros(size, dtype))
    grads = [(rng.normal(size=size) * 0.01).astype(dtype) for _ in range(steps)]
    step = tf.function(apply_lars_momentum) if function else apply_lars_momentum
    ref_w, ref_a = w0.astype(np.float64), np.zeros(size)
    for g in grads:
        step(w, a, tf.constant(g), lr, 0.9, weight_decay, 0.001, 1e-5, use_clip, use_nesterov)
        ref_w, ref_a = numpy_lars_momentum(ref_w, ref_a, g.astype(np.float64), lr, 0.9,
                                           weight_decay, 0.001, 1e-5, use_clip, use_nesterov)
    return (w.numpy(), a.numpy()), (ref_w, ref_a)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size", [1, 13, 100_003])
@pytest.mark.parametrize("use_clip", [False, True])
@pytest.mark.parametrize("use_nesterov", [False, True])
def test_matches_numpy_formula(dtype, size, use_clip, use_nesterov, backend):
    (w, a), (ref_w, ref_a) = run_steps(dtype, size, use_clip, use_nesterov)
    rtol = 1e-6 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(a, ref_a, rtol=rtol, atol=rtol * np.max(np.abs(ref_a)))
    np.testing.assert_allclose(w, ref_w, rtol=rtol, atol=rtol * np.max(np.abs(ref_w)))


@pytest.mark.parametrize("use_clip", [False, True])
@pytest.mark.parametrize("use_nesterov", [False, True])
def test_kernel_and_pure_tf_agree(use_clip, use_nesterov, monkeypatch):
    results = {}
    for name in ("kernel", "pure_tf"):
        use_backend(monkeypatch, name)
        results[name], _ = run_steps("float32", 1_000_003, use_clip, use_nesterov)
    for got, want in zip(results["kernel"], results["pure_tf"]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.max(np.abs(want)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size", [1, 13, 100_003])
@pytest.mark.parametrize("use_clip", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-4])
def test_lars_gradient_matches_numpy_formula(dtype, size, use_clip, weight_decay, backend):
    """The gradient LARS hands a wrapped optimizer other than SGD-momentum: trust * (g + wd * w),
    from the compiled kernel (both norms in one read) and from the TensorFlow ops."""
    rng = np.random.default_rng(5)
    w, g = ((rng.normal(size=size) * scale).astype(dtype) for scale in (0.1, 0.01))
    variable = tf.Variable(w)
    got = tf.function(lars_gradient)(variable, tf.constant(g), 0.1, weight_decay, 0.001, 1e-5,
                                     use_clip).numpy()
    w64, g64 = w.astype(np.float64), g.astype(np.float64)
    w_norm, g_norm = np.linalg.norm(w64), np.linalg.norm(g64)
    trust = 0.001 * w_norm / (weight_decay * w_norm + g_norm + 1e-5)
    trust = np.clip(trust / 0.1, 0.0, 1.0) if use_clip else trust
    want = trust * (g64 + weight_decay * w64)
    rtol = 1e-6 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.abs(want)))
    kernel_ops = {op.type for op in tf.function(lars_gradient).get_concrete_function(
        variable, tf.constant(g), 0.1, weight_decay, 0.001, 1e-5, use_clip).graph.get_operations()}
    assert ("MsOptLarsGradient" in kernel_ops) == (backend == "kernel")


def test_zero_weights_get_trust_one(backend):
    """|w| = 0: trust 1 (MindSpore would freeze zero-initialised weights)."""
    (w, a), (ref_w, ref_a) = run_steps("float32", 1000, False, False, steps=1,
                                       zero_weights=True)
    np.testing.assert_allclose(a, ref_a, rtol=1e-6)
    assert np.any(w != 0)


def test_eager_call(backend):
    (w, a), (ref_w, ref_a) = run_steps("float32", 4097, True, False, function=False)
    np.testing.assert_allclose(w, ref_w, rtol=1e-6, atol=1e-7)


def test_kernel_choice(monkeypatch):
    use_backend(monkeypatch, "kernel")
    w = tf.Variable(np.ones(4, np.float32))
    assert lars_momentum_kernel(w, tf.ones(4)) is not None
    assert lars_momentum_kernel(keras.Variable(np.ones(4, np.float32)), tf.ones(4)) is not None
    assert lars_momentum_kernel(tf.Variable(np.ones(4, np.float16)), tf.ones(4, "float16")) is None
    sparse = tf.IndexedSlices(tf.ones([1, 4]), tf.constant([0]), tf.constant([2, 4]))
    assert lars_momentum_kernel(tf.Variable(np.ones([2, 4], np.float32)), sparse) is None
    seen = {}

    @tf.function(jit_compile=True)
    def compiled():
        seen["kernel"] = lars_momentum_kernel(w, tf.ones(4))
        return tf.constant(0)

    compiled()
    assert seen["kernel"] is None
    use_backend(monkeypatch, "pure_tf")
    assert lars_momentum_kernel(w, tf.ones(4)) is None


def apply_function(optimizer, variable):
    return tf.function(lambda gradient: optimizer.apply([gradient], [variable]))


def test_lars_optimizer_uses_the_kernel(monkeypatch):
    """LARS(SGD momentum) runs the compiled kernel, and its numbers match the pure-TF path."""
    rng = np.random.default_rng(5)
    w0 = rng.normal(size=(64, 32)).astype("float32")
    grads = [rng.normal(size=(64, 32)).astype("float32") for _ in range(3)]
    results, op_types = {}, {}
    for name in ("kernel", "pure_tf"):
        use_backend(monkeypatch, name)
        w = keras.Variable(w0, name="kernel")
        opt = mso.LARS(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True,
                                            weight_decay=1e-4), use_clip=True)
        opt.build([w])
        step = apply_function(opt, w)
        for g in grads:
            step(tf.constant(g))
        results[name] = (w.numpy(), opt.inner_optimizer.momentums[0].numpy())
        op_types[name] = {op.type for op in step.get_concrete_function(
            tf.TensorSpec([64, 32], tf.float32)).graph.get_operations()}
    assert "MsOptResourceApplyLarsMomentum" in op_types["kernel"]
    assert "MsOptResourceApplyLarsMomentum" not in op_types["pure_tf"]
    for got, want in zip(results["kernel"], results["pure_tf"]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.max(np.abs(want)))


def test_lars_gradient_kernel_checks_its_inputs(monkeypatch):
    use_backend(monkeypatch, "kernel")
    kernel = _kernel("ms_opt_lars_gradient", tf.Variable(np.ones(4, np.float32)), tf.ones(4))
    scalars = dict(lr=0.1, weight_decay=0.0, coefficient=0.001, epsilon=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match="'lr' must be a scalar"):
        kernel(var=tf.ones(4), grad=tf.ones(4), **{**scalars, "lr": tf.ones(2)})
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="same shape|must be equal"):
        kernel(var=tf.ones(4), grad=tf.ones(3), **scalars)
