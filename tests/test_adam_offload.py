"""AdamOffload: MindSpore's golden values, the host kernel against its pure-TF path,
groups, arguments. Training, placement, distribution and saving: test_adam_offload_training."""
import contextlib
import functools

import helpers
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from tf_msopt.ops import _loader
from tf_msopt.ops.adam import adam_offload_step, adam_offload_steps


use_backend = functools.partial(helpers.use_backend, kernel="ms_opt_adam_offload_deltas",
                                source="adam_offload.cc")


#: Instruction sets the kernels' loops can be capped to (TF_MSOPT_ADAM_ISA; "best": uncapped,
#: AVX-512 where the CPU has it): a user's CPU may have any of them.
ISAS = ["best", "avx2", "sse2", "scalar"]


def cap_isa(monkeypatch, isa):
    if isa == "best":
        monkeypatch.delenv("TF_MSOPT_ADAM_ISA", raising=False)
    else:
        monkeypatch.setenv("TF_MSOPT_ADAM_ISA", isa)


@pytest.fixture(params=["kernel", "pure_tf"])
def backend(request, monkeypatch):
    use_backend(monkeypatch, request.param)
    return request.param


def variable(value, path, dtype="float32"):
    """A keras.Variable whose path is ``path`` (layer scopes, then the weight name)."""
    *scopes, name = path.split("/")
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(keras.name_scope(scope))
        return keras.Variable(np.asarray(value, dtype), name=name)


def numpy_adam_offload(weights, grads_per_step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       use_nesterov=False, decay=None, loss_scale=1.0):
    """AdamOffload's update in float64; returns the weights after each step. ``decay[i]`` is
    variable i's weight decay; ``lr`` a number, or ``lr(step, i)``: variable i's rate at step 0, 1, ..."""
    weights = [np.asarray(w, np.float64) for w in weights]
    m = [np.zeros_like(w) for w in weights]
    v = [np.zeros_like(w) for w in weights]
    decay = decay or [0.0] * len(weights)
    history = []
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            rate = lr(t - 1, i) if callable(lr) else lr
            g = np.asarray(g, np.float64) / loss_scale + decay[i] * weights[i]
            lr_t = rate * np.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            step = beta1 * m[i] + (1 - beta1) * g if use_nesterov else m[i]
            weights[i] = weights[i] - lr_t * step / (np.sqrt(v[i]) + eps)
        history.append([w.copy() for w in weights])
    return history


# -- MindSpore golden values (nn.AdamOffload and its op, MindSpore 2.10 on CPU) --------------

def test_a1_adam_no_update_param_example(backend):
    m = tf.Variable(np.array([[0.1] * 3, [0.2] * 3], np.float32))
    v = tf.Variable(np.array([[0.1] * 3, [0.2] * 3], np.float32))
    delta = adam_offload_step(m, v, np.full((2, 3), 0.1, np.float32), beta1_power=0.9,
                              beta2_power=0.999, lr=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8)
    np.testing.assert_allclose(delta.numpy()[:, 0], [-1.0004e-4, -1.3441e-4], rtol=0, atol=5e-9)
    np.testing.assert_allclose(m.numpy(), [[0.1] * 3, [0.19] * 3], rtol=0, atol=1e-7)
    np.testing.assert_allclose(v.numpy(), [[0.09991] * 3, [0.19981] * 3], rtol=0, atol=1e-7)
    # The same in float64 from the float32 inputs (1 - float32(0.999) is not 0.001).
    beta1_power, beta2_power, lr = (np.float64(np.float32(x)) for x in (0.9, 0.999, 0.001))
    lr_t = lr * np.sqrt(1 - beta2_power) / (1 - beta1_power)
    want = -lr_t * m.numpy()[:, 0] / (np.sqrt(v.numpy()[:, 0].astype(np.float64)) + 1e-8)
    np.testing.assert_allclose(delta.numpy(), np.repeat(want[:, None], 3, axis=1), rtol=1e-6)


A2_GRADS = [([[0.1, -0.2], [0.3, 0.0]], [0.05, 0.5]),
            ([[-0.1, 0.4], [0.0, 1.0]], [0.0, -0.5]),
            ([[0.2, 0.2], [-0.3, 0.1]], [0.1, 0.1])]
A2_TABLES = {
    "plain": (dict(learning_rate=1e-3), 1.0, [
        ([0.499, -0.999, 1.999, 0.0], [0.999, -0.501]),
        ([0.49905264, -0.9993661, 1.9983299, -0.00074413413], [0.99832994, -0.50094736]),
        ([0.49855441, -0.99988532, 1.9984157, -0.0013800878], [0.997527, -0.5009966])]),
    "nesterov_wd_loss_scale": (
        dict(learning_rate=0.1, use_nesterov=True, weight_decay=0.01, loss_scale=8.0, eps=1e-6),
        8.0, [
            ([0.31005722, -0.8100286, 1.8100188, 0.0], [0.8101201, -0.689988]),
            ([0.3616509, -0.90618515, 1.7418284, -0.14138106], [0.7498532, -0.63262236]),
            ([0.26278403, -0.97580695, 1.78505, -0.20481244], [0.62047756, -0.64600456])]),
}


@pytest.mark.parametrize("config", sorted(A2_TABLES))
@pytest.mark.parametrize("compiled", [False, True])
def test_a2_tables(config, compiled, backend):
    """MindSpore's CPU run: ``w`` is decayed, ``bn/gamma`` is not (its path has 'gamma')."""
    kwargs, grad_factor, table = A2_TABLES[config]
    w = variable([[0.5, -1.0], [2.0, 0.0]], "fc/kernel")
    gamma = variable([1.0, -0.5], "bn/gamma")
    opt = mso.AdamOffload(**kwargs)
    apply = lambda grads: opt.apply(grads, [w, gamma])  # noqa: E731
    if compiled:  # the first trace also builds the optimizer inside the tf.function
        apply = tf.function(apply)
    for (grad_w, grad_gamma), (want_w, want_gamma) in zip(A2_GRADS, table):
        apply([tf.constant(np.float32(grad_w) * grad_factor),
               tf.constant(np.float32(grad_gamma) * grad_factor)])
        np.testing.assert_allclose(w.numpy().ravel(), want_w, rtol=0, atol=1e-6)
        np.testing.assert_allclose(gamma.numpy(), want_gamma, rtol=0, atol=1e-6)
    assert int(opt.iterations.numpy()) == 3
    decay = [kwargs.get("weight_decay", 0.0), 0.0]
    reference = numpy_adam_offload(
        [[[0.5, -1.0], [2.0, 0.0]], [1.0, -0.5]],
        [[np.float32(g) * grad_factor for g in step] for step in A2_GRADS],
        lr=kwargs["learning_rate"], eps=kwargs.get("eps", 1e-8),
        use_nesterov=kwargs.get("use_nesterov", False), decay=decay,
        loss_scale=kwargs.get("loss_scale", 1.0))[-1]
    np.testing.assert_allclose(w.numpy(), reference[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gamma.numpy(), reference[1], rtol=1e-5, atol=1e-7)


# -- the kernel ----------------------------------------------------------------------------------

def run_host_steps(backend, monkeypatch, use_nesterov, in_place, size=100_003):
    """Three steps on random data (an odd size, so vector loops have a tail)."""
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(7)
    m = tf.Variable(rng.random(size).astype(np.float32))
    v = tf.Variable(rng.random(size).astype(np.float32))
    var = tf.Variable(rng.normal(size=size).astype(np.float32))
    results = []
    step = tf.function(adam_offload_step)
    for t in (1, 2, 3):
        grad = tf.constant(rng.normal(size=size).astype(np.float32) * 8)
        delta = step(m, v, grad, 0.9 ** t, 0.999 ** t, 0.01, 0.9, 0.999, 1e-8, 0.125,
                     use_nesterov=use_nesterov, var=var if in_place else None)
        results.append(var.numpy() if in_place else delta.numpy())
    ops = {op.type for op in step.get_concrete_function(
        m, v, grad, 0.9, 0.999, 0.01, 0.9, 0.999, 1e-8, 0.125, use_nesterov=use_nesterov,
        var=var if in_place else None).graph.get_operations()}
    return results + [m.numpy(), v.numpy()], ops


@pytest.mark.parametrize("use_nesterov", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_kernel_and_pure_tf_agree(use_nesterov, in_place, monkeypatch):
    """The contract is 1e-6 relative (the kernel may fuse multiply-adds where the CPU has
    FMA; the pure-TF path rounds every product)."""
    kernel, kernel_ops = run_host_steps("kernel", monkeypatch, use_nesterov, in_place)
    plain, plain_ops = run_host_steps("pure_tf", monkeypatch, use_nesterov, in_place)
    op = "MsOptAdamOffloadUpdates" if in_place else "MsOptAdamOffloadDeltas"
    assert op in kernel_ops and not any(name.startswith("MsOpt") for name in plain_ops)
    for got, want in zip(kernel, plain):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * np.max(np.abs(want)))


@pytest.mark.parametrize("in_place", [False, True])
def test_values_read_before_a_step_do_not_change(in_place, backend):
    """The kernel writes variables as TensorFlow's training ops do: a buffer that a tensor
    read earlier still references is copied first, so that tensor keeps its value."""
    m, v, var = (tf.Variable(np.full(1000, x, np.float32)) for x in (0.5, 0.25, 1.0))
    before = [x.read_value() for x in (m, v, var)]
    adam_offload_step(m, v, tf.ones(1000), 0.9, 0.999, 0.1, 0.9, 0.999, 1e-8,
                      var=var if in_place else None)
    for old, value in zip(before, (0.5, 0.25, 1.0)):
        np.testing.assert_array_equal(old.numpy(), value)
    assert np.all(m.numpy() != 0.5) and np.all(v.numpy() != 0.25)
    assert np.all(var.numpy() != 1.0) == in_place


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_other_float_dtypes(dtype, backend):
    """float64 runs the kernel's scalar loop, float16 the pure-TF path. The step's scalars
    (beta powers, rate) are float32, as in MindSpore, whatever the variable's dtype."""
    rng = np.random.default_rng(1)
    init = rng.normal(size=(3, 5))
    grads = [[rng.normal(size=(3, 5))] for _ in range(3)]
    w = variable(init, "d/kernel", dtype)
    opt = mso.AdamOffload(0.01, weight_decay=0.1)
    for (g,) in grads:
        opt.apply([tf.constant(g, dtype)], [w])
    # half-precision variables keep float32 moments on the host
    assert opt.moments[0][0].dtype == ("float32" if dtype == "float16" else dtype)
    want = numpy_adam_offload([init], grads, lr=0.01, decay=[0.1])[-1][0]
    tolerance = {"float16": 2e-3, "float64": 1e-6}[dtype]
    np.testing.assert_allclose(w.numpy(), want, rtol=tolerance, atol=tolerance)


def test_beta1_power_of_one_is_refused(backend):
    m, v = tf.Variable(tf.zeros(3)), tf.Variable(tf.zeros(3))
    with pytest.raises(tf.errors.InvalidArgumentError, match="'beta1_power' can not be 1"):
        adam_offload_step(m, v, tf.ones(3), 1.0, 0.999, 0.1, 0.9, 0.999, 1e-8)


def test_step_contract_errors():
    m = tf.Variable(tf.zeros(3))
    with pytest.raises(ValueError, match="must have the same shape"):
        adam_offload_step(m, tf.Variable(tf.zeros(3)), tf.ones(4), 0.9, 0.999, 0.1, 0.9, 0.999,
                          1e-8)
    with pytest.raises(TypeError, match="must have one float dtype"):
        adam_offload_step(m, tf.Variable(tf.zeros(3, tf.float64)), tf.ones(3), 0.9, 0.999, 0.1,
                          0.9, 0.999, 1e-8)


def test_kernel_checks_its_inputs(monkeypatch):
    use_backend(monkeypatch, "kernel")
    op = _loader.load_custom_ops().ms_opt_adam_offload_deltas
    m, v = tf.Variable(tf.zeros(3)), tf.Variable(tf.zeros(3))
    other_m, other_v = tf.Variable(tf.zeros(2)), tf.Variable(tf.zeros(2))
    scalars = [tf.constant(x) for x in (0.9, 0.999, 0.1, 0.9, 0.999, 1e-8, 1.0)]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"'m\[0\]' must have the gradient's dtype"):
        op([tf.Variable(tf.zeros(3, tf.float64)).handle], [v.handle], [tf.ones(3)], *scalars)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"'v\[1\]' and 'grad\[1\]' must have the same"):
        op([m.handle, other_m.handle], [v.handle, tf.Variable(tf.zeros(4)).handle],
           [tf.ones(3), tf.ones(2)], *scalars)
    with pytest.raises(tf.errors.InvalidArgumentError, match="'lr' must be a scalar"):
        op([m.handle, other_m.handle], [v.handle, other_v.handle], [tf.ones(3), tf.ones(2)],
           *scalars[:2], tf.ones(2), *scalars[3:])
    for moment in (m, v, other_m, other_v):
        np.testing.assert_array_equal(moment.numpy(), 0.0)  # nothing was written


def run_grouped_steps(backend, monkeypatch, in_place, sizes=(1, 17, 0, 100_003, 40)):
    """Three steps of ``adam_offload_steps`` on variables of several sizes (shards of the
    kernel's one pass start and end inside variables, cover several small ones and skip
    an empty one)."""
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(11)
    ms, vs, weights = ([tf.Variable(rng.random(n).astype(np.float32)) for n in sizes]
                       for _ in range(3))
    step = tf.function(adam_offload_steps)
    for t in (1, 2, 3):
        grads = [tf.constant(rng.normal(size=n).astype(np.float32)) for n in sizes]
        deltas = step(ms, vs, grads, 0.9 ** t, 0.999 ** t, 0.01, 0.9, 0.999, 1e-8, 0.5,
                      variables=weights if in_place else None)
    kernel_ops = {op.type for op in step.get_concrete_function(
        ms, vs, grads, 0.9, 0.999, 0.01, 0.9, 0.999, 1e-8, 0.5,
        variables=weights if in_place else None).graph.get_operations()}
    values = [x.numpy() for x in (weights if in_place else deltas) + ms + vs]
    return values, kernel_ops


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("in_place", [False, True])
def test_grouped_kernel_equals_one_step_per_variable(in_place, isa, monkeypatch):
    """One kernel call for several variables gives each what its own pure-TF step gives,
    with each instruction set's loops."""
    cap_isa(monkeypatch, isa)
    grouped, ops = run_grouped_steps("kernel", monkeypatch, in_place)
    plain, plain_ops = run_grouped_steps("pure_tf", monkeypatch, in_place)
    kind = "MsOptAdamOffloadUpdates" if in_place else "MsOptAdamOffloadDeltas"
    assert kind in ops and not any(name.startswith("MsOpt") for name in plain_ops)
    assert len(grouped) == len(plain) == 15
    for got, want in zip(grouped, plain):
        np.testing.assert_allclose(got, want, rtol=1e-6,
                                   atol=1e-7 * np.max(np.abs(want), initial=0.0))


def test_grouped_step_contract_errors():
    m, v = tf.Variable(tf.zeros(3)), tf.Variable(tf.zeros(3))
    scalars = (0.9, 0.999, 0.1, 0.9, 0.999, 1e-8)
    with pytest.raises(ValueError, match="non-empty lists of one length"):
        adam_offload_steps([m], [v, v], [tf.ones(3)], *scalars)
    with pytest.raises(ValueError, match="non-empty lists of one length"):
        adam_offload_steps([], [], [], *scalars)
    with pytest.raises(ValueError, match=r"must have the same shape.*\(entry 1\)"):
        adam_offload_steps([m, tf.Variable(tf.zeros(2))], [v, tf.Variable(tf.zeros(2))],
                           [tf.ones(3), tf.ones(4)], *scalars)
    with pytest.raises(TypeError, match=r"one float dtype.*\(entry 1\)"):
        adam_offload_steps([m, tf.Variable(tf.zeros(3, tf.float64))], [v, v],
                           [tf.ones(3), tf.ones(3)], *scalars)


# -- the optimizer: formula, groups, Keras features -------------------------------------------

def test_equals_keras_adam_without_decay(backend):
    """Same arithmetic as keras.optimizers.Adam (rounded in another order)."""
    rng = np.random.default_rng(2)
    init = [rng.normal(size=(4, 3)), rng.normal(size=3)]
    ours = [variable(w, p) for w, p in zip(init, ["d/kernel", "d/bias"])]
    theirs = [variable(w, p) for w, p in zip(init, ["d/kernel", "d/bias"])]
    opt = mso.AdamOffload(0.01, eps=1e-7)
    keras_adam = keras.optimizers.Adam(0.01, epsilon=1e-7)
    for _ in range(5):
        grads = [tf.constant(rng.normal(size=w.shape), "float32") for w in init]
        opt.apply(grads, ours)
        keras_adam.apply(grads, theirs)
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)


@keras.saving.register_keras_serializable(package="tf_msopt_tests")
def head_variables(variable):
    return variable.path.startswith("head/")


def test_groups_set_learning_rate_and_weight_decay(backend):
    paths = ["body/kernel", "body/bias", "bn/gamma", "bn/beta", "head/kernel", "head/bias"]
    rng = np.random.default_rng(3)
    init = [rng.normal(size=(3, 2)), rng.normal(size=2), rng.normal(size=2), rng.normal(size=2),
            rng.normal(size=(2, 2)), rng.normal(size=2)]
    weights = [variable(w, p) for w, p in zip(init, paths)]
    rates = [0.05, 0.04, 0.03, 0.02]  # per step: MindSpore's 1-D learning rate
    opt = mso.AdamOffload(
        learning_rate=np.array(rates), weight_decay=0.1, loss_scale=4.0,
        groups=[{"params": ["^body/bias", "^bn/"], "weight_decay": 0.0},  # regexes, no decay
                {"params": head_variables, "lr": 0.01, "weight_decay": 0.3}])  # a callable
    opt.build(weights)
    assert opt._group_index == [None, 0, 0, 0, 1, 1]
    # Default decay skips 'beta'/'gamma' paths; a group's decay applies to all its members.
    assert opt._decay_factors == [0.1 * 4, 0.0, 0.0, 0.0, 0.3 * 4, 0.3 * 4]
    grads = [[rng.normal(size=w.shape) * 4 for w in init] for _ in range(3)]
    for step in grads:
        opt.apply([tf.constant(g, "float32") for g in step], weights)

    def lr(step, i):
        return 0.01 if i >= 4 else rates[step]

    want = numpy_adam_offload(init, grads, lr=lr, decay=[0.1, 0, 0, 0, 0.3, 0.3],
                              loss_scale=4.0)[-1]
    for got, expected in zip(weights, want):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_group_schedule_and_keras_clipping(backend):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    w = variable(np.ones(4), "d/kernel")
    opt = mso.AdamOffload(0.01, groups=[{"params": ["kernel"], "learning_rate": schedule}],
                          global_clipnorm=1.0)
    grads = [np.full(4, 3.0), np.full(4, -0.1)]
    for g in grads:
        opt.apply([tf.constant(g, "float32")], [w])
    clipped = [g * min(1.0, 1.0 / np.linalg.norm(g)) for g in grads]
    want = numpy_adam_offload([np.ones(4)], [[g] for g in clipped],
                              lr=lambda step, i: 0.1 * 0.5 ** step)[-1][0]
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-6)


def test_lars_and_loss_scale_wrappers(backend):
    """Inside mso.LossScaleOptimizer (which calls apply) and LARS (which calls update_step
    per variable, taking over the weight decay), AdamOffload acts as Keras' Adam would."""
    x = np.ones((4, 3), "float32")

    def run(wrap, inner):
        w = variable(np.full((3, 2), 0.5), "d/kernel")
        opt = wrap(inner)
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
                if hasattr(opt, "scale_loss"):
                    loss = opt.scale_loss(loss)
            opt.apply(tape.gradient(loss, [w]), [w])
        return w.numpy()

    def offload():
        return mso.AdamOffload(0.05, weight_decay=0.01)

    def keras_adam():
        return keras.optimizers.Adam(0.05, epsilon=1e-8, weight_decay=0.01)

    plain = run(lambda opt: opt, offload())
    assert np.abs(plain - 0.5).max() > 0.05
    np.testing.assert_allclose(run(lambda opt: mso.LossScaleOptimizer(opt, 1024.0), offload()),
                               plain, rtol=1e-6)

    def lars(opt):
        return mso.LARS(opt, coefficient=0.02, lars_filter=[])

    np.testing.assert_allclose(run(lars, offload()), run(lars, keras_adam()), rtol=1e-5)


# -- arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, text", [
    (dict(beta1=1), TypeError, "the type of 'beta1' should be 'float', but got type 'int'"),
    (dict(beta2=1), TypeError, "the type of 'beta2' should be 'float', but got type 'int'"),
    (dict(eps=1), TypeError, "the type of 'eps' should be 'float', but got type 'int'"),
    (dict(beta1=1.0), ValueError, "the 'beta1' must be in range of (0.0, 1.0), but got 1.0"),
    (dict(beta2=0.0), ValueError, "the 'beta2' must be in range of (0.0, 1.0), but got 0.0"),
    (dict(beta1=0.999999999), ValueError, "rounds to 1.0"),
    (dict(eps=0.0), ValueError, "the 'eps' must be float and must > 0, but got 0.0"),
    (dict(use_locking=1), TypeError, "the type of 'use_locking' should be 'bool'"),
    (dict(use_nesterov="yes"), TypeError, "the type of 'use_nesterov' should be 'bool'"),
    (dict(learning_rate=-0.1), ValueError, "the 'learning_rate' must be finite and >= 0"),
    (dict(learning_rate="0.1"), TypeError, "the 'learning_rate' must be a float, int"),
    (dict(learning_rate=np.zeros((2, 2))), ValueError, "must be 0-D"),
    (dict(weight_decay=-1e-4), ValueError, "the 'weight_decay' must be in range of [0.0, inf]"),
    (dict(weight_decay="0.1"), TypeError, "the 'weight_decay' should be int or float"),
    (dict(loss_scale=0.0), ValueError, "the 'loss_scale' must be in range of (0.0, inf]"),
    (dict(loss_scale="8"), TypeError, "the type of 'loss_scale' should be 'float'"),
    (dict(host_device=0), TypeError, "the type of 'host_device' should be 'str'"),
    (dict(host_device="CPU zero"), ValueError, "the 'host_device' must be a device name"),
    (dict(jit_compile=True), ValueError, "the 'jit_compile' must be False"),
    (dict(state_dtype="float16"), ValueError,
     "the 'state_dtype' must be one of ['float32', 'bfloat16', 'int8'], but got 'float16'"),
    (dict(state_dtype=tf.bfloat16), TypeError, "the type of 'state_dtype' should be 'str'"),
    (dict(jit_compile="no"), TypeError, "the type of 'jit_compile' should be 'bool'"),
    (dict(groups={"params": ["a"]}), TypeError, "the 'groups' must be a list of dicts"),
    (dict(groups=[["a"]]), TypeError, "each entry of 'groups' must be a dict"),
    (dict(groups=[{"lr": 0.1}]), KeyError, "must have the key 'params'"),
    (dict(groups=[{"params": ["a"], "momentum": 0.9}]), KeyError, "'momentum'"),
    (dict(groups=[{"params": []}]), ValueError, "groups[0]['params'] must name the group"),
    (dict(groups=[{"params": "bias"}]), TypeError, "the 'groups[0]['params']' must be None"),
    (dict(groups=[{"params": ["("]}]), ValueError, "invalid regular expression"),
    (dict(groups=[{"params": ["a"], "lr": -1.0}]), ValueError,
     "the 'groups[0]['learning_rate']' must be finite and >= 0"),
    (dict(groups=[{"params": ["a"], "weight_decay": -1.0}]), ValueError,
     "the 'groups[0]['weight_decay']' must be in range"),
])
def test_argument_errors(kwargs, error, text):
    with pytest.raises(error) as info:
        mso.AdamOffload(**kwargs)
    assert "For 'AdamOffload'" in str(info.value) and text in str(info.value)


def test_ints_where_mindspore_converts_them():
    opt = mso.AdamOffload(learning_rate=1, weight_decay=0, loss_scale=8)
    assert (opt.weight_decay, opt.loss_scale) == (0.0, 8.0)
    assert isinstance(opt.weight_decay, float) and isinstance(opt.loss_scale, float)


def test_build_time_errors():
    a, b = variable(np.ones(2), "a/kernel"), variable(np.ones(2), "b/kernel")
    opt = mso.AdamOffload(groups=[{"params": ["kernel"]}, {"params": ["^a/"]}])
    with pytest.raises(RuntimeError, match=r"'a/kernel' is in groups \[0, 1\]"):
        opt.build([a, b])


def test_config_round_trip():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.1, 0.01])
    opt = mso.AdamOffload(learning_rate=[0.3, 0.2, 0.1], beta1=0.8, beta2=0.99, eps=1e-6,
                          use_locking=True, use_nesterov=True, weight_decay=1e-4,
                          loss_scale=128.0, host_device="/CPU:1", clipnorm=2.0,
                          groups=[{"params": ["bias"], "weight_decay": 0.0},
                                  {"params": head_variables, "learning_rate": schedule}])
    config = keras.optimizers.serialize(opt)
    assert config["registered_name"] == "tf_msopt>AdamOffload"
    restored = keras.optimizers.deserialize(config)
    assert isinstance(restored, mso.AdamOffload)
    assert restored.get_config() == opt.get_config()
    assert restored.groups[1]["params"] is head_variables
    assert isinstance(restored.groups[1]["learning_rate"],
                      keras.optimizers.schedules.PiecewiseConstantDecay)
    assert restored.get_config()["groups"][0] == {"params": ["bias"], "weight_decay": 0.0}


def test_unsavable_groups_fail_clearly():
    with pytest.raises(ValueError, match=r"'groups\[0\]\['params'\]' is the Python callable"):
        mso.AdamOffload(groups=[{"params": lambda v: True}]).get_config()
    with pytest.raises(ValueError, match=r"groups\[0\]\['learning_rate'\] is the Python callable"):
        mso.AdamOffload(groups=[{"params": ["a"], "learning_rate": lambda: 0.1}]).get_config()


class _RecordingAdamOffload(mso.AdamOffload):
    """Records which variables go through the optimizer's assign methods."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.written = []

    def assign(self, variable, value):
        self.written.append(("assign", variable))
        super().assign(variable, value)

    def assign_add(self, variable, value):
        self.written.append(("assign_add", variable))
        super().assign_add(variable, value)


@pytest.mark.parametrize("in_place", [False, True])
def test_writes_go_through_the_optimizers_assign_methods(in_place, monkeypatch):
    """Keras' rule (its sparse and overwrite handling rely on it): the weights, and the
    moments where TensorFlow ops write them (the pure-TF path), are written with
    ``optimizer.assign*``, not ``Variable.assign*``."""
    use_backend(monkeypatch, "pure_tf")
    weight = variable([1.0, -2.0, 3.0], "fc/kernel")
    host = "/CPU:0" if in_place else "/CPU:1"   # in place: the weight lives on the host
    optimizer = _RecordingAdamOffload(0.1, host_device=host)
    optimizer.apply([tf.constant([0.5, 0.5, -1.0])], [weight])
    key = lambda v: id(v.value if isinstance(v, keras.Variable) else v)  # noqa: E731
    written = {(kind, key(v)) for kind, v in optimizer.written}
    assert ("assign_add", key(weight)) in written
    m, v = (moments[0] for moments in optimizer.moments)
    assert ("assign", key(m)) in written and ("assign", key(v)) in written
    np.testing.assert_allclose(weight.numpy(), [0.9, -2.1, 3.1], rtol=1e-5)


# -- compact state (state_dtype): the codes, a NumPy reference, the two paths ---------------

BLOCK = 2048


def numpy_bfloat16_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest even (finite values)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def numpy_bfloat16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def code_table(exponent_bits):
    """The values of the 8-bit float codes, from their definition: code 0 is 0; code c > 0,
    c = 8 * e + f (f < 8), is (1 + f / 8) * 2**(e - 2**exponent_bits + 1), the top code 1.0."""
    top = 2 ** exponent_bits - 1
    codes = np.arange(8 * top + 1)
    values = (1 + (codes % 8) / 8) * 2.0 ** (codes // 8 - top)
    values[0] = 0.0
    return values.astype(np.float32)


MOMENT_TABLE, SQUARE_TABLE = code_table(4), code_table(5)


def numpy_encode(units, table):
    """Each of ``units`` (in [0, 1]) as the index of the nearest table value, ties to the
    larger one, where code 0 stands for 2**-top (its binade's start) when rounding and is
    stored as 0: whatever rounds to 2**-top or below becomes 0."""
    units = np.asarray(units, np.float64)
    rounding = table.astype(np.float64)
    rounding[0] = table[8] / 2      # 2**-top
    index = np.clip(np.searchsorted(rounding, units), 1, len(table) - 1)
    below, above = rounding[index - 1], rounding[index]
    pick_above = above - units <= units - below
    return np.where(units < rounding[0], 0, np.where(pick_above, index, index - 1))


def test_codes_round_to_the_nearest_table_value():
    """``_encode_unit`` (integer operations on the float bits) picks the nearest 8-bit float
    of the table defined above; decoding gives the table's values."""
    from tf_msopt.ops import adam as ops
    rng = np.random.default_rng(0)
    for table, offset in ((MOMENT_TABLE, ops._MOMENT_OFFSET), (SQUARE_TABLE, ops._SQUARE_OFFSET)):
        mid = (table[1:].astype(np.float64) + table[:-1]) / 2
        units = np.concatenate([table, mid.astype(np.float32), np.float32([0.0, 1.0]),
                                np.exp(rng.uniform(np.log(table[1] / 4), 0, 20_000)),
                                rng.uniform(0, 1, 20_000)]).astype(np.float32)
        got = ops._encode_unit(tf.constant(units), offset).numpy()
        np.testing.assert_array_equal(got, numpy_encode(units, table))
        np.testing.assert_array_equal(
            ops._decode_unit(tf.range(len(table)), offset).numpy(), table)
        kept = units >= table[8]     # above the flush, the rounding error is half a step
        assert np.all(got[units < table[8] * 0.53125] == 0)   # below 1.0625 * 2**-top: flushed
        error = np.abs(table[got[kept]] - units[kept]) / units[kept]
        assert error.max() <= 2.0 ** -4


def numpy_compact_step(state, grad, powers, state_dtype, lr=0.01, beta1=0.9, beta2=0.999,
                       eps=1e-8, grad_scale=0.5, use_nesterov=False):
    """One compact step in float32 NumPy, operation for operation as documented in
    tf_msopt.ops.adam. ``state``: the stored moments (None: zeros); ``powers``: the float32
    ``(beta1**t, beta2**t)``. Returns ``(delta, new state)``."""
    f32 = np.float32
    beta1, beta2, eps, lr, grad_scale = (f32(x) for x in (beta1, beta2, eps, lr, grad_scale))
    size = grad.size
    neg_lr_t = -(lr * np.sqrt(f32(1) - powers[1]) / (f32(1) - powers[0]))
    if state is None:
        m = v = np.zeros(size, f32)
    elif state_dtype == "bfloat16":
        m, v = numpy_bfloat16_value(state["m"]), numpy_bfloat16_value(state["v"])
    else:
        m_value = np.sign(state["m"]) * MOMENT_TABLE[np.abs(state["m"].astype(np.int32))]
        m = (m_value.astype(f32) * np.repeat(state["m_scale"], BLOCK)[:size]).astype(f32)
        v = SQUARE_TABLE[state["v"]] * np.repeat(state["v_scale"], BLOCK)[:size]
    g = grad * grad_scale
    m = m * beta1 + (f32(1) - beta1) * g
    v = v * beta2 + (f32(1) - beta2) * g * g
    step = m * beta1 + (f32(1) - beta1) * g if use_nesterov else m
    delta = neg_lr_t * step / (np.sqrt(v) + eps)
    if state_dtype == "bfloat16":
        return delta, {"m": numpy_bfloat16_bits(m), "v": numpy_bfloat16_bits(v)}
    pad = -size % BLOCK
    m_blocks, v_blocks = (np.pad(x, (0, pad)).reshape(-1, BLOCK) for x in (m, v))
    m_scale, v_scale = (np.abs(x).max(axis=1) for x in (m_blocks, v_blocks))
    with np.errstate(divide="ignore"):
        m_inverse, v_inverse = (np.where(s > 0, f32(1) / s, f32(0)).astype(f32)
                                for s in (m_scale, v_scale))
    m_code = numpy_encode(np.abs(m_blocks) * m_inverse[:, None], MOMENT_TABLE)
    m_code = np.where(m_blocks < 0, -m_code, m_code).reshape(-1)[:size]
    v_code = numpy_encode(np.abs(v_blocks) * v_inverse[:, None], SQUARE_TABLE)
    return delta, {"m": m_code.astype(np.int8), "v": v_code.reshape(-1)[:size].astype(np.uint8),
                   "m_scale": m_scale, "v_scale": v_scale}


def compact_variables(state_dtype, size):
    from tf_msopt.ops.adam import COMPACT_MOMENT_DTYPES, scale_shape
    m_dtype, v_dtype = COMPACT_MOMENT_DTYPES[state_dtype]
    m, v = tf.Variable(tf.zeros(size, m_dtype)), tf.Variable(tf.zeros(size, v_dtype))
    scales = None
    if state_dtype == "int8":
        scales = tuple(tf.Variable(tf.zeros(scale_shape([size]))) for _ in range(2))
    return m, v, scales


def stored_state(m, v, scales):
    """The stored moments as NumPy arrays (flat), bfloat16 as their bits."""
    m, v = (np.asarray(x.numpy()).ravel() for x in (m, v))
    if m.dtype != np.int8:
        return {"m": m.view(np.uint16), "v": v.view(np.uint16)}
    return {"m": m, "v": v, "m_scale": np.asarray(scales[0]), "v_scale": np.asarray(scales[1])}


def spread_gradients(rng, size, steps):
    """Gradients over many orders of magnitude (so codes use their whole range)."""
    return [(rng.normal(size=size) * np.exp(rng.normal(size=size) * 3)).astype(np.float32)
            for _ in range(steps)]


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("use_nesterov", [False, True])
def test_compact_step_equals_numpy_reference(state_dtype, use_nesterov, backend):
    """Four steps (quantise, update, dequantise) on 5,003 elements (three int8 blocks, the
    last partial): the stored bits, codes and scales equal the NumPy reference exactly;
    ``delta`` to a few ulp."""
    size = 5003
    rng = np.random.default_rng(5)
    grads = spread_gradients(rng, size, 4)
    m, v, scales = compact_variables(state_dtype, size)
    step = tf.function(adam_offload_step)
    deltas = [step(m, v, tf.constant(g), 0.9 ** t, 0.999 ** t, 0.01, 0.9, 0.999, 1e-8, 0.5,
                   use_nesterov=use_nesterov, state_dtype=state_dtype, scales=scales).numpy()
              for t, g in enumerate(grads, start=1)]
    want, want_deltas = None, []
    for t, grad in enumerate(grads, start=1):
        delta, want = numpy_compact_step(want, grad, (np.float32(0.9 ** t), np.float32(0.999 ** t)),
                                         state_dtype, use_nesterov=use_nesterov)
        want_deltas.append(delta)
    got = stored_state(m, v, scales)
    for key, value in got.items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)
    for got_delta, want_delta in zip(deltas, want_deltas):
        np.testing.assert_allclose(got_delta, want_delta, rtol=2e-6, atol=0)
    if state_dtype == "int8":   # the codes use their range: m both signs, v many binades
        assert len(np.unique(got["m"])) > 150 and len(np.unique(got["v"])) > 150


def run_compact_grouped_steps(backend, monkeypatch, state_dtype, in_place, use_nesterov,
                              sizes=(1, 17, 0, 4096, 10_003, 40)):
    use_backend(monkeypatch, backend)
    rng = np.random.default_rng(13)
    state = [compact_variables(state_dtype, n) for n in sizes]
    ms, vs, scales = zip(*state)
    scales = None if state_dtype == "bfloat16" else [list(s) for s in zip(*scales)]
    weights = [tf.Variable(rng.normal(size=n).astype(np.float32)) for n in sizes]
    step = tf.function(adam_offload_steps)
    for t in (1, 2, 3):
        grads = [tf.constant(g) for g in (spread_gradients(rng, n, 1)[0] for n in sizes)]
        deltas = step(list(ms), list(vs), grads, 0.9 ** t, 0.999 ** t, 0.01, 0.9, 0.999, 1e-8,
                      0.25, use_nesterov=use_nesterov, variables=weights if in_place else None,
                      state_dtype=state_dtype, scales=scales)
    ops = {op.type for op in step.get_concrete_function(
        list(ms), list(vs), grads, 0.9, 0.999, 0.01, 0.9, 0.999, 1e-8, 0.25,
        use_nesterov=use_nesterov, variables=weights if in_place else None,
        state_dtype=state_dtype, scales=scales).graph.get_operations()}
    stored = [stored_state(m, v, None if scales is None else (scales[0][i], scales[1][i]))
              for i, (m, v) in enumerate(zip(ms, vs))]
    return [x.numpy() for x in (weights if in_place else deltas)], stored, ops


@functools.cache
def pure_tf_compact_grouped_steps(state_dtype, in_place, use_nesterov):
    """:func:`run_compact_grouped_steps` on the pure-TF path, which no instruction-set cap
    reaches: run once per form in a test process, not once per cap."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_compact_grouped_steps("pure_tf", monkeypatch, state_dtype, in_place,
                                         use_nesterov)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("use_nesterov", [False, True])
def test_compact_kernel_and_pure_tf_store_the_same_bits(state_dtype, in_place, use_nesterov,
                                                        isa, monkeypatch):
    """One kernel call for variables of several sizes (vector loops with tails, an empty
    variable, blocks split over shards) against the pure-TF path, with each instruction
    set's loops: the same stored bits, codes and scales (nothing in either path fuses a
    multiply-add into the moments); weights and deltas within 1e-6 of the largest."""
    cap_isa(monkeypatch, isa)
    got, got_state, ops = run_compact_grouped_steps("kernel", monkeypatch, state_dtype,
                                                    in_place, use_nesterov)
    want, want_state, plain_ops = pure_tf_compact_grouped_steps(state_dtype, in_place,
                                                                use_nesterov)
    kind = "MsOptAdamOffloadCompact" + ("Updates" if in_place else "Deltas")
    assert kind in ops and not any(name.startswith("MsOpt") for name in plain_ops)
    for got_entry, want_entry in zip(got_state, want_state):
        for key in want_entry:
            np.testing.assert_array_equal(got_entry[key], want_entry[key], err_msg=key)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.max(np.abs(w), initial=0.0))


@pytest.mark.parametrize("isa", ["best", "avx2"])
@pytest.mark.parametrize("epsilon", [1e-8, 1e-40])
def test_compact_kernel_and_pure_tf_agree_at_edge_values(epsilon, isa, monkeypatch):
    """Second moments at zero, underflowing to zero and overflowing to inf, and a denormal
    epsilon, in whole vectors: where a denominator is not a normal float the kernel leaves
    its reciprocal estimate for the rounded division, so it still stores the pure-TF path's
    bits and returns its deltas (zeros and huge values alike)."""
    cap_isa(monkeypatch, isa)
    grad = np.tile(np.float32([0.0, 1e-30, 1e30, -1e30, 1.0, -3.0, 1e-20, 5e-4]), 8)
    results = []
    for backend in ("kernel", "pure_tf"):
        use_backend(monkeypatch, backend)
        m, v, _ = compact_variables("bfloat16", grad.size)
        step = tf.function(adam_offload_step)
        deltas = [step(m, v, tf.constant(grad), 0.9 ** t, 0.999 ** t, 0.01, 0.9, 0.999,
                       epsilon, 1.0, state_dtype="bfloat16").numpy() for t in (1, 2)]
        results.append((deltas, stored_state(m, v, None)))
    (got, got_state), (want, want_state) = results
    assert np.isinf(numpy_bfloat16_value(want_state["v"])).any()
    for key in want_state:
        np.testing.assert_array_equal(got_state[key], want_state[key], err_msg=key)
    for got_delta, want_delta in zip(got, want):
        np.testing.assert_allclose(got_delta, want_delta, rtol=1e-6, atol=0)


def test_compact_step_contract_errors():
    m, v, scales = compact_variables("int8", 3)
    scalars = (0.9, 0.999, 0.1, 0.9, 0.999, 1e-8)
    with pytest.raises(ValueError, match="needs 'scales'"):
        adam_offload_step(m, v, tf.ones(3), *scalars, state_dtype="int8")
    with pytest.raises(TypeError, match="takes 'm' of dtype int8, 'v' of dtype uint8"):
        adam_offload_step(v, m, tf.ones(3), *scalars, state_dtype="int8", scales=scales)
    with pytest.raises(ValueError, match=r"float32 of shape \(1,\)"):
        adam_offload_step(m, v, tf.ones(3), *scalars, state_dtype="int8",
                          scales=(tf.Variable(tf.zeros(2)), tf.Variable(tf.zeros(2))))
    with pytest.raises(ValueError, match="'state_dtype' must be one of"):
        adam_offload_step(m, v, tf.ones(3), *scalars, state_dtype="int4")




@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_optimizer_with_compact_state_equals_numpy_reference(state_dtype, backend):
    """Nesterov, L2 weight decay (not on 'gamma') and a loss scale, three steps, a variable
    of two int8 blocks and a small one: the weights and the stored moments equal the float32
    NumPy reference (weights to 1e-6, moments exactly)."""
    rng = np.random.default_rng(21)
    init = [rng.normal(size=(40, 75)).astype(np.float32), rng.normal(size=5).astype(np.float32)]
    paths = ["fc/kernel", "bn/gamma"]
    weights = [variable(w, p) for w, p in zip(init, paths)]
    loss_scale, weight_decay = 8.0, 0.01
    opt = mso.AdamOffload(0.05, use_nesterov=True, weight_decay=weight_decay,
                          loss_scale=loss_scale, state_dtype=state_dtype)
    grads = [[spread_gradients(rng, w.size, 1)[0].reshape(w.shape) * loss_scale for w in init]
             for _ in range(3)]
    for step in grads:
        opt.apply([tf.constant(g) for g in step], weights)
    assert [m.dtype for m in opt.moments[0] + opt.moments[1]] == (
        ["bfloat16"] * 4 if state_dtype == "bfloat16" else ["int8"] * 2 + ["uint8"] * 2)

    beta_powers = (np.float32(1), np.float32(1))
    want = [w.ravel().copy() for w in init]
    state = [None, None]
    for step in grads:
        beta_powers = (beta_powers[0] * np.float32(0.9), beta_powers[1] * np.float32(0.999))
        for i, (decay, g) in enumerate(zip([weight_decay * loss_scale, 0.0], step)):
            total = want[i] * np.float32(decay) + g.ravel() if decay else g.ravel()
            delta, state[i] = numpy_compact_step(
                state[i], total.astype(np.float32), beta_powers, state_dtype, lr=0.05,
                grad_scale=1.0 / loss_scale, use_nesterov=True)
            want[i] = (want[i] + delta).astype(np.float32)
    for i, w in enumerate(weights):
        np.testing.assert_allclose(w.numpy().ravel(), want[i], rtol=1e-6, atol=1e-7)
        got = stored_state(opt.moments[0][i], opt.moments[1][i],
                           None if state_dtype == "bfloat16" else
                           [scales[i].numpy() for scales in opt.moment_scales])
        for key in got:
            np.testing.assert_array_equal(got[key], state[i][key], err_msg=key)


def test_compact_state_config_and_sizes():
    opt = mso.AdamOffload(state_dtype="int8")
    assert opt.get_config()["state_dtype"] == "int8"
    assert keras.optimizers.deserialize(keras.optimizers.serialize(opt)).state_dtype == "int8"
    config = mso.AdamOffload().get_config()
    del config["state_dtype"]    # a file written before state_dtype existed
    assert mso.AdamOffload.from_config(config).state_dtype == "float32"
    w = variable(np.zeros((3, 2049)), "d/kernel")
    opt.build([w])
    assert [tuple(s.shape) for s in opt.moment_scales[0] + opt.moment_scales[1]] == [(4,), (4,)]
