"""LARS: MindSpore's golden values, NumPy references, distribution, XLA, saving."""
import contextlib
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import regression_data, small_mlp

import tf_msopt as mso

W = np.array([[0.5, 0.8, 0.2], [0.6, 0.4, 0.2]], "float32")
G = np.array([[0.4, 0.4, 0.5], [0.2, 0.4, 0.3]], "float32")


def lars_reference(w, g, weight_decay=0.0, lr=None, coefficient=0.001, epsilon=1e-5,
                   use_clip=False):
    """The LARS gradient in float64: ``trust * (g + wd * w)``, trust 1 for zero norms."""
    w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
    w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
    trust = coefficient * w_norm / (weight_decay * w_norm + g_norm + epsilon)
    if use_clip:
        trust = np.clip(trust / lr, 0.0, 1.0)
    if w_norm == 0 or g_norm == 0:
        trust = 1.0
    return trust * (g + weight_decay * w)


def variable(value, path):
    """A keras.Variable whose path is ``path`` (a layer scope, then the weight name)."""
    *scopes, name = path.split("/")
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(keras.name_scope(scope))
        return keras.Variable(np.asarray(value, "float32"), name=name)


class GenericSGD(keras.optimizers.SGD):
    """Keras' SGD step, run through LARS' generic path (LARS fuses only SGD itself)."""


# -- MindSpore golden values (ops.LARSUpdate and nn.LARS, MindSpore 2.10 on CPU) -------------

@pytest.mark.parametrize("weight_decay, use_clip, lr, expected", [
    # L1, the ops.LARSUpdate docstring
    (None, False, 0.1, [[0.0005265, 0.0005265, 0.00065813], [0.00026325, 0.0005265, 0.00039488]]),
    # L2, then L2 with use_clip at lr 0.1 and at lr 0.001 (clipped to 1: g + wd * w)
    (0.01, False, 0.1,
     [[0.00052616, 0.00053005, 0.00065217], [0.00026763, 0.00052486, 0.00039234]]),
    (0.01, True, 0.1,
     [[0.00526157, 0.00530054, 0.00652175], [0.00267625, 0.00524858, 0.00392344]]),
    (0.01, True, 0.001, G + 0.01 * W),
])
@pytest.mark.parametrize("inner_class", [keras.optimizers.SGD, GenericSGD])
def test_l1_l2_golden(weight_decay, use_clip, lr, expected, inner_class):
    # Keras SGD's first step from m = 0 stores m = -lr * g', so g' = -m / lr exactly
    # (reading g' from the weights would lose digits to float32 rounding of w).
    w = variable(W, "fc/kernel")
    inner = inner_class(learning_rate=lr, momentum=0.9, weight_decay=weight_decay)
    opt = mso.LARS(inner, use_clip=use_clip)
    opt.apply([tf.constant(G)], [w])
    lars_grad = -inner.momentums[0].numpy() / lr
    np.testing.assert_allclose(lars_grad, expected, rtol=0, atol=1e-6)
    want = lars_reference(W, G, weight_decay or 0.0, lr, use_clip=use_clip)
    np.testing.assert_allclose(lars_grad, want, rtol=2e-6)


# L3: MindSpore nn.LARS around Momentum(lr=0.1, momentum=0.9,
# weight_decay=0.01, loss_scale=4), fc.weight / fc.bias / bn.gamma, two steps.
L3_TABLE = {
    False: [([0.4999474, 0.799947, 0.19993478, 0.59997326, 0.39994752, 0.19996077],
             [0.09, -0.11], [0.9999553, 1.0001341]),
            ([0.49984744, 0.7998463, 0.19981088, 0.5999224, 0.3998478, 0.19988623],
             [0.071, -0.129], [0.9998703, 1.000389])],
    True: [([0.49947384, 0.79946995, 0.19934782, 0.5997324, 0.39947516, 0.19960766],
            [0.09, -0.11], [0.9995528, 1.0013416]),
           ([0.4984746, 0.7984633, 0.19810925, 0.59922415, 0.3984784, 0.19886254],
            [0.071, -0.129], [0.9987029, 1.0038912])],
}


@pytest.mark.parametrize("use_clip", [False, True])
@pytest.mark.parametrize("inner_class", [keras.optimizers.SGD, GenericSGD])
def test_l3_table(use_clip, inner_class):
    """MindSpore's Momentum on Keras' SGD, term by term:

    - MindSpore: ``v = m * v + g; w -= lr * v``. Keras: ``v = m * v - lr * g; w += v``.
      From v = 0 with a constant lr, Keras' v is exactly ``-lr`` times MindSpore's, so
      the weights follow the same path.
    - MindSpore's ``loss_scale=4`` means the gradients arrive multiplied by 4 and the
      optimizer divides them (LARS takes the unscaling over, before the norms). Keras'
      equivalent is ``loss_scale_factor=4.0`` on the inner optimizer, which LARS takes
      over likewise; the test feeds the same x4 gradients.
    - MindSpore's default ``decay_filter`` gives ``gamma``/``beta`` no weight decay (they
      keep LARS). Keras spells it ``exclude_from_weight_decay(var_names=...)``.
    - MindSpore's ``fc.weight`` is ``(out, in)``; a Keras Dense kernel is ``(in, out)``.
    """
    kernel = variable(W.T, "fc/kernel")
    bias = variable([0.1, -0.1], "fc/bias")
    gamma = variable([1.0, 1.0], "bn/gamma")
    inner = inner_class(learning_rate=0.1, momentum=0.9, weight_decay=0.01,
                        loss_scale_factor=4.0)
    inner.exclude_from_weight_decay(var_names=["gamma", "beta"])
    opt = mso.LARS(inner, use_clip=use_clip)
    grads = [4 * G.T, 4 * np.array([0.1, 0.1]), 4 * np.array([0.1, -0.3])]
    bias_velocity, want_bias_exact = np.zeros(2), np.array([0.1, -0.1])
    for want_kernel, want_bias, want_gamma in L3_TABLE[use_clip]:
        opt.apply([tf.constant(g, "float32") for g in grads], [kernel, bias, gamma])
        np.testing.assert_allclose(kernel.numpy().T.ravel(), want_kernel, rtol=0, atol=1e-6)
        np.testing.assert_allclose(bias.numpy(), want_bias, rtol=0, atol=1e-6)
        np.testing.assert_allclose(gamma.numpy(), want_gamma, rtol=0, atol=1e-6)
        # The bias moves by exactly lr * v, with v MindSpore's velocity of the plain
        # (unscaled) gradient: no LARS, no decay.
        bias_velocity = 0.9 * bias_velocity + grads[1] / 4
        want_bias_exact = want_bias_exact - 0.1 * bias_velocity
        np.testing.assert_allclose(bias.numpy(), want_bias_exact, rtol=0, atol=1e-7)
    assert int(opt.iterations.numpy()) == int(inner.iterations.numpy()) == 2


# -- the formula around each kind of optimizer ------------------------------------------------

INNERS = {
    "sgd": lambda wd: keras.optimizers.SGD(0.5, weight_decay=wd),
    "sgd_nesterov": lambda wd: keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True,
                                                    weight_decay=wd),
    "adam": lambda wd: keras.optimizers.Adam(0.01, epsilon=1e-3, weight_decay=wd),
    # Nadam also updates state once a step, around its per-variable update step.
    "nadam": lambda wd: keras.optimizers.Nadam(0.01, epsilon=1e-3, weight_decay=wd),
    "add_sign": lambda wd: mso.AddSign(0.5, weight_decay=wd),
}


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("use_clip", [False, True])
def test_wrapper_equals_inner_on_numpy_lars_gradients(inner, use_clip):
    """LARS(inner) == the same inner optimizer fed the NumPy LARS gradient, step by step."""
    rng = np.random.default_rng(3)
    paths = ["dense/kernel", "dense/bias", "LayerNorm/gamma", "zero_init/kernel"]
    init = [rng.normal(size=(4, 3)), rng.normal(size=3), rng.normal(size=3), np.zeros((3, 2))]
    wrapped_vars = [variable(v, p) for v, p in zip(init, paths)]
    plain_vars = [variable(v, p) for v, p in zip(init, paths)]
    opt = mso.LARS(INNERS[inner](0.01), coefficient=0.02, use_clip=use_clip)
    plain = INNERS[inner](None)
    lars_flags = [True, False, False, True]  # default filter: not bias, not LayerNorm
    for step in range(3):
        grads = [rng.normal(size=v.shape).astype("float32") for v in init]
        grads[1] *= 0.0 if step == 1 else 1.0  # a zero gradient: trust 1, decay only
        opt.apply([tf.constant(g) for g in grads], wrapped_vars)
        lr = float(plain.learning_rate.numpy())
        reference = [lars_reference(v.numpy(), g, 0.01, lr, 0.02, use_clip=use_clip)
                     if flag else g for v, g, flag in zip(plain_vars, grads, lars_flags)]
        plain.apply([tf.constant(g, "float32") for g in reference], plain_vars)
        for got, want in zip(wrapped_vars, plain_vars):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
    # The zero-initialised kernel moved (MindSpore's trust would be 0 there).
    assert np.abs(wrapped_vars[3].numpy()).max() > 1e-3
    assert int(opt.iterations.numpy()) == int(opt.inner_optimizer.iterations.numpy()) == 3


def test_filters_select_variables():
    paths = ["m/dense/kernel", "m/dense/bias", "m/layer_normalization/gamma", "m/LayerNorm/beta",
             "m/head/kernel"]
    weights = [variable(np.ones((2, 2)), p) for p in paths]

    def flags(lars_filter):
        opt = mso.LARS(keras.optimizers.SGD(0.1), lars_filter=lars_filter)
        opt.build(weights)
        return opt._lars_flags

    assert flags(None) == [True, False, False, False, True]
    assert flags(["head"]) == [True, True, True, True, False]
    assert flags(lambda v: v.path.endswith("kernel")) == [True, False, False, False, True]


def test_filter_decides_the_numbers():
    # Same gradient on two identical weights: only the one LARS applies to is scaled.
    kernel = variable(np.ones((2, 2)), "m/dense/kernel")
    head = variable(np.ones((2, 2)), "m/head/kernel")
    opt = mso.LARS(keras.optimizers.SGD(1.0), coefficient=0.1, lars_filter=["head"])
    g = np.full((2, 2), 0.5, "float32")
    opt.apply([tf.constant(g), tf.constant(g)], [kernel, head])
    np.testing.assert_allclose(kernel.numpy(), 1.0 - lars_reference(np.ones((2, 2)), g, 0.0,
                                                                     coefficient=0.1), rtol=1e-6)
    np.testing.assert_allclose(head.numpy(), 0.5, rtol=1e-6)


# -- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make, error, text", [
    (lambda sgd: mso.LARS("sgd"), TypeError,
     "the 'optimizer' must be a keras.optimizers.Optimizer, but got type 'str'"),
    (lambda sgd: mso.LARS(keras.optimizers.LossScaleOptimizer(sgd)), TypeError,
     "must be an optimizer with its own update step"),
    (lambda sgd: mso.LARS(mso.LARS(sgd)), TypeError, "must be an optimizer with its own"),
    (lambda sgd: mso.LARS(mso.thor(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]))),
     TypeError, "must update each variable on its own, but 'THOR' computes its step"),
    (lambda sgd: mso.LARS(sgd, epsilon=1), TypeError,
     "the type of 'epsilon' should be 'float', but got type 'int'"),
    (lambda sgd: mso.LARS(sgd, coefficient=1), TypeError,
     "the type of 'coefficient' should be 'float', but got type 'int'"),
    (lambda sgd: mso.LARS(sgd, epsilon="1e-5"), TypeError, "'epsilon' should be 'float'"),
    (lambda sgd: mso.LARS(sgd, use_clip=1), TypeError,
     "the type of 'use_clip' should be 'bool', but got type 'int'"),
    (lambda sgd: mso.LARS(sgd, lars_filter="bias"), TypeError, "the 'lars_filter' must be None"),
    (lambda sgd: mso.LARS(sgd, lars_filter=["("]), ValueError, "invalid regular expression"),
    (lambda sgd: mso.LARS(sgd, jit_compile="yes"), TypeError, "'jit_compile' should be 'bool'"),
    (lambda sgd: mso.LARS(sgd, momentum=0.9), TypeError,
     "got an unexpected keyword argument 'momentum'"),
] + [(lambda sgd, key=key: mso.LARS(sgd, **{key: 1.0}), ValueError,
      f"'{key}' is the wrapped optimizer's setting: set it there")
     for key in ("learning_rate", "weight_decay", "clipnorm", "use_ema",
                 "gradient_accumulation_steps")])
def test_argument_errors(make, error, text):
    with pytest.raises(error) as info:
        make(keras.optimizers.SGD(0.1))
    assert "For 'LARS'" in str(info.value) and text in str(info.value)


def test_takes_over_weight_decay_scaling_and_clipping():
    inner = keras.optimizers.Adam(0.01, weight_decay=0.05, loss_scale_factor=8.0, clipnorm=1.0)
    opt = mso.LARS(inner)
    assert (opt.weight_decay, opt.loss_scale_factor, opt.clipnorm) == (0.05, 8.0, 1.0)
    assert (inner.weight_decay, inner.loss_scale_factor, inner.clipnorm) == (None, None, None)
    # The config keeps the inner optimizer as configured; loading takes it over again.
    config = opt.get_config()
    assert config["optimizer"]["config"]["weight_decay"] == 0.05
    restored = mso.LARS.from_config(config)
    assert (restored.weight_decay, restored.inner_optimizer.weight_decay) == (0.05, None)
    # Clipping happens before the trust ratio: a huge gradient is clipped to norm 1.
    w = variable(np.ones(4), "dense/kernel")
    opt.apply([tf.constant(np.full(4, 8e3, "float32"))], [w])  # /8 (scale), clip to 0.5 each
    reference = keras.optimizers.Adam(0.01)
    w_ref = variable(np.ones(4), "dense/kernel")
    reference.apply([tf.constant(lars_reference(np.ones(4), np.full(4, 0.5), 0.05), "float32")],
                    [w_ref])
    np.testing.assert_allclose(w.numpy(), w_ref.numpy(), rtol=1e-6)


def test_learning_rate_and_iterations_forward():
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = mso.LARS(inner)
    opt.learning_rate = 0.05
    assert float(inner.learning_rate.numpy()) == pytest.approx(0.05)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.05)
    w = variable(np.ones(3), "d/kernel")
    opt.apply([tf.ones(3)], [w])
    assert opt.iterations is inner.iterations and int(inner.iterations.numpy()) == 1
    assert opt.inner_optimizer is inner


def test_schedule_runs_on_inner_iterations():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.01])
    opt = mso.LARS(keras.optimizers.SGD(schedule), use_clip=True)
    w = variable(np.ones(4), "d/kernel")
    g = np.full(4, 0.5, "float32")
    expected = np.ones(4)
    for lr in (0.1, 0.1, 0.01):  # the schedule sees steps 0, 1, 2
        expected -= lr * lars_reference(expected, g, lr=lr, use_clip=True)
        opt.apply([tf.constant(g)], [w])
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6)


def test_loss_scale_optimizer_around_lars():
    x = np.ones((4, 3), "float32")

    def run(scaled):
        w = variable(np.full((3, 2), 0.5), "d/kernel")
        lars = mso.LARS(keras.optimizers.SGD(0.5, momentum=0.9), coefficient=0.05)
        opt = keras.optimizers.LossScaleOptimizer(lars, initial_scale=1024.0) if scaled else lars
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
                loss = opt.scale_loss(loss)
            opt.apply(tape.gradient(loss, [w]), [w])
        return w.numpy()

    np.testing.assert_allclose(run(True), run(False), rtol=1e-6)


# -- training: fit, callbacks, XLA, distribution ----------------------------------------------

def make_lars(inner="sgd", jit_compile=None):
    inners = {"sgd": lambda: keras.optimizers.SGD(0.5, momentum=0.9, weight_decay=1e-3),
              "adam": lambda: keras.optimizers.Adam(0.01, epsilon=1e-3, weight_decay=1e-3)}
    return mso.LARS(inners[inner](), coefficient=0.02, jit_compile=jit_compile)


def test_fit_with_learning_rate_callbacks():
    x, y = regression_data()
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.5 * 0.5 ** epoch)
    model = small_mlp()
    model.compile(optimizer=make_lars(), loss="mse")
    history = model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0,
                        callbacks=[schedule])
    assert history.history["learning_rate"] == pytest.approx([0.5, 0.25, 0.125])

    # The same three steps in a custom loop, setting the inner rate by hand.
    reference = small_mlp()
    opt = make_lars()
    for lr in (0.5, 0.25, 0.125):
        opt.inner_optimizer.learning_rate = lr
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, reference(x)))
        opt.apply(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # ReduceLROnPlateau: no "improvement" is large enough, so every epoch after the
    # first halves the rate, and it is the inner optimizer's rate that changes.
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=1e9, min_lr=0.0)
    model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0, callbacks=[plateau])
    assert float(model.optimizer.inner_optimizer.learning_rate.numpy()) == pytest.approx(0.03125)
    assert int(model.optimizer.iterations.numpy()) == 6


# -- saving ------------------------------------------------------------------------------------

@keras.saving.register_keras_serializable(package="tf_msopt_tests")
def kernels_only(variable):
    return variable.path.endswith("kernel")


def test_config_round_trip():
    inner = mso.AddSign(0.1, weight_decay=0.01)
    inner.exclude_from_weight_decay(var_names=["gamma"])
    opt = mso.LARS(inner, epsilon=1e-6, coefficient=0.01, use_clip=True, lars_filter=["head"],
                   jit_compile=True, name="my_lars")
    config = keras.optimizers.serialize(opt)
    assert config["registered_name"] == "tf_msopt>LARS"
    restored = keras.optimizers.deserialize(json.loads(json.dumps(config)))
    assert isinstance(restored, mso.LARS) and isinstance(restored.inner_optimizer, mso.AddSign)
    assert restored.get_config() == opt.get_config()
    assert restored.weight_decay == 0.01 and restored.inner_optimizer.weight_decay is None
    gamma = variable(np.ones(2), "bn/gamma")
    kernel = variable(np.ones(2), "fc/kernel")
    restored.build([gamma, kernel])
    assert restored._decay_flags == [False, True]

    registered = mso.LARS(keras.optimizers.SGD(0.1), lars_filter=kernels_only)
    again = mso.LARS.from_config(registered.get_config())
    assert again.lars_filter is kernels_only


def test_unsavable_filters_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="'lars_filter' is the Python callable .* cannot be saved"):
        mso.LARS(keras.optimizers.SGD(0.1), lars_filter=lambda v: True).get_config()
    inner = keras.optimizers.SGD(0.1, weight_decay=0.01)
    inner.exclude_from_weight_decay(var_list=[variable(np.ones(2), "a/b")])
    with pytest.raises(ValueError, match=r"exclude_from_weight_decay\(var_names"):
        mso.LARS(inner).get_config()

    model = small_mlp()
    model.compile(optimizer=mso.LARS(keras.optimizers.SGD(0.1), lars_filter=lambda v: True),
                  loss="mse")
    path = os.path.join(tmp_path, "lambda.keras")
    with pytest.raises(ValueError, match="cannot be saved"):
        model.save(path)
    # Keras opens the file before serializing: an empty file is all that is left.
    assert os.path.getsize(path) == 0


