"""The Keras-optimizer contract, checked for every optimizer of the package.

Each test runs for AddSign, PowerSign, LARS around SGD and around Adam, AdamOffload and THOR,
each also inside ``mso.LossScaleOptimizer`` (``cases.py``), and checks numbers: a Keras
feature (clipping, weight-decay exclusion, EMA, gradient accumulation, ...) must give what
doing the same by hand gives, and saving, distribution, XLA and variable kinds must not change
the result. Where a feature cannot apply (AdamOffload under XLA) the test checks the error
says why.

Cases whose code differs without the compiled custom ops are marked ``ops_path``: the
kill-switch passes of ``make test`` and ``make test-all`` run only those.
"""
import contextlib
import functools
import json
import pickle
import re
from unittest import mock

import cases as C
import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import RECORD_AUTOGRAPH, run_fresh_python

import tf_msopt as mso

CASE_PARAMS = [pytest.param(name, id=name, marks=[pytest.mark.ops_path] if ops else [])
               for name, (_, ops) in C.CASES.items()]
#: Checks that never run an update step: the same on either op path.
CONFIG_PARAMS = [pytest.param(name, id=name) for name in C.CASES]

case = pytest.mark.parametrize("case", CASE_PARAMS)


def assert_same(got, want, rtol=1e-6, atol=1e-7):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, "float64"), np.asarray(w, "float64"),
                                   rtol=rtol, atol=atol)


def assert_moved(trace, start):
    assert any(np.abs(np.asarray(w) - s).max() > 1e-4 for w, s in zip(trace[-1], start))


def innermost(optimizer):
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


STEPS = 2   # THOR (frequency 3): a THOR step and a stale step


@functools.lru_cache(maxsize=None)
def _plain_trace(case):
    """The case's weights after each of STEPS custom-loop steps, no Keras feature set (shared
    by the tests that compare a feature against it)."""
    model = C.mlp()
    return tuple(tuple(step) for step in C.train(model, C.make(case, model), STEPS))


def plain_trace(case):
    return [list(step) for step in _plain_trace(case)]


# --------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("case", CONFIG_PARAMS)
def test_config_round_trips_and_keras_get(case):
    model = C.mlp()
    optimizer = C.make(case, model, weight_decay=0.01, clipnorm=2.0)
    config = optimizer.get_config()
    json.dumps(config)  # plain JSON, as .keras files store it
    clone = type(optimizer).from_config(config)
    assert type(clone) is type(optimizer)
    assert clone.get_config() == config
    fetched = keras.optimizers.get(keras.optimizers.serialize(optimizer))
    assert type(fetched) is type(optimizer)
    assert fetched.get_config() == config
    assert type(innermost(fetched)) is type(innermost(optimizer))


@pytest.mark.parametrize("case", CONFIG_PARAMS)
def test_default_instances_get_distinct_names(case):
    model = C.mlp()
    first, second = C.make(case, model), C.make(case, model)
    stem = re.sub(r"_\d+$", "", first.name)
    assert first.name != second.name
    assert re.fullmatch(re.escape(stem) + r"_\d+", second.name), (first.name, second.name)


# --------------------------------------------------------------------------- saving

RESUME_BEFORE, RESUME_AFTER = 4, 2   # THOR (frequency 3): the resumed steps are stale steps

RESUME_CODE = """
import json, sys
sys.path[:0] = ["tests", "tests/contract"]
import keras, numpy as np
import cases as C
import tf_msopt as mso
results = {{}}
for case, path in {paths!r}.items():
    try:
        model = keras.models.load_model(path, safe_mode=True)
        if C.is_thor(case):
            mso.thor.connect(model)
        for x, y in C.batches({before} + {after})[{before}:]:
            model.train_on_batch(x, y)
        results[case] = {{"weights": [w.tolist() for w in model.get_weights()],
                         "iterations": int(model.optimizer.iterations.numpy()),
                         "type": type(model.optimizer).__name__}}
    except Exception as error:  # reported per case by the test
        results[case] = {{"error": f"{{type(error).__name__}}: {{error}}"}}
print(json.dumps(results))
"""


@pytest.mark.slow
@pytest.mark.ops_path
def test_keras_files_load_in_one_fresh_process_safe_mode_and_resume_exactly(tmp_path):
    """Every case saved to ``.keras`` after RESUME_BEFORE steps and resumed in ONE fresh
    process (one TensorFlow start for the whole suite, and one test so that pytest-xdist runs
    it on one worker), against the uninterrupted run."""
    paths, uninterrupted = {}, {}
    for name in C.CASES:
        model = C.compiled(name)
        steps = C.batches(RESUME_BEFORE + RESUME_AFTER)
        for x, y in steps[:RESUME_BEFORE]:
            model.train_on_batch(x, y)
        paths[name] = str(tmp_path / f"{name}.keras")
        model.save(paths[name])
        for x, y in steps[RESUME_BEFORE:]:
            model.train_on_batch(x, y)
        uninterrupted[name] = (C.weights(model), int(model.optimizer.iterations.numpy()),
                               type(model.optimizer).__name__)
    resumed = run_fresh_python(RESUME_CODE.format(paths=paths, before=RESUME_BEFORE,
                                                  after=RESUME_AFTER), timeout=600)
    failures = {}
    for name, (want_weights, want_iterations, want_type) in uninterrupted.items():
        got = resumed[name]
        try:
            assert "error" not in got, got.get("error")
            assert got["type"] == want_type
            assert got["iterations"] == want_iterations == RESUME_BEFORE + RESUME_AFTER
            assert_same(got["weights"], want_weights, rtol=0, atol=0)
        except AssertionError as error:
            failures[name] = str(error)
    assert not failures, failures


@case
@pytest.mark.equivalence
def test_checkpoint_restores_and_resumes_exactly(case, tmp_path):
    model = C.mlp()
    optimizer = C.make(case, model)
    C.train(model, optimizer, RESUME_BEFORE)
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "ckpt"))
    want = C.train(model, optimizer, RESUME_AFTER, seed=1)[-1]

    restored_model = C.mlp(seed=5)          # other initial weights: the checkpoint sets them
    restored = C.make(case, restored_model)
    # Built first, as Keras' LossScaleOptimizer needs: scale_loss before the build would
    # use initial_scale while the restored step unscales by the restored scale.
    restored.build(restored_model.trainable_variables)
    tf.train.Checkpoint(model=restored_model, optimizer=restored).read(path).assert_consumed()
    got = C.train(restored_model, restored, RESUME_AFTER, seed=1)[-1]
    assert_same(got, want, rtol=0, atol=0)
    assert int(restored.iterations.numpy()) == RESUME_BEFORE + RESUME_AFTER


@case
def test_set_weights_transfers_the_whole_state(case):
    model = C.mlp()
    optimizer = C.make(case, model)
    C.train(model, optimizer, 2)

    other_model = C.mlp(seed=5)
    other_model.set_weights(model.get_weights())
    other = C.make(case, other_model)
    other.build(other_model.trainable_variables)
    values = [np.array(v) for v in optimizer.variables]
    assert len(other.variables) == len(values)
    other.set_weights(values)
    assert_same([np.array(v) for v in other.variables], values, rtol=0, atol=0)
    assert int(other.iterations.numpy()) == 2
    # The next step (a stale THOR step) needs every moment / inverse / counter.
    want = C.train(model, optimizer, 1, seed=1)[-1]
    got = C.train(other_model, other, 1, seed=1)[-1]
    assert_same(got, want, rtol=0, atol=0)


def test_set_weights_refuses_a_wrong_number_of_values():
    model = C.mlp()
    optimizer = C.make("lars_sgd", model)
    optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match="values for"):
        optimizer.set_weights([np.array(v) for v in optimizer.variables][:-1])


# --------------------------------------------------------------------------- execution

@functools.lru_cache(maxsize=None)
def _one_device_fit(case):
    return tuple(_fit_weights(case, jit_compile=False))


def _fit_weights(case, strategy=None, xla_step=False, steps=2, **kwargs):
    """Weights after ``steps`` steps of ``fit`` (batch 16); ``kwargs`` go to the optimizer."""
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        model = C.mlp()
        model.compile(optimizer=C.make(case, model, **kwargs), loss="mse",
                      jit_compile=xla_step)
    x, y = C.data(16 * steps)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return C.weights(model)


@case
@pytest.mark.equivalence
def test_mirrored_strategy_equals_one_device(case, two_cpu_strategy):
    want = list(_one_device_fit(case))
    got = _fit_weights(case, two_cpu_strategy)
    assert_same(got, want, rtol=1e-5, atol=1e-6)


@case
def test_created_outside_the_strategy_scope_is_refused_clearly(case, two_cpu_strategy):
    """Created outside the scope the model is trained under, the optimizer says to create it
    inside (TensorFlow's own error names two strategy objects)."""
    with two_cpu_strategy.scope():
        model = C.mlp()
    optimizer = C.make(case, model)
    with two_cpu_strategy.scope():
        model.compile(optimizer=optimizer, loss="mse")
    x, y = C.data(16)
    with pytest.raises(RuntimeError, match=r"created under one distribution strategy \(none\) "
                                           r"and is built under another \(MirroredStrategy\)"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


@case
@pytest.mark.equivalence
def test_jit_compile_on_equals_off(case):
    if "adam_offload" in case:
        # Host state cannot live in an XLA step: both switches say so.
        with pytest.raises(ValueError, match="jit_compile"):
            C.make(case, C.mlp(), jit_compile=True)
        with pytest.raises(Exception, match=r"jit_compile=False"):
            _fit_weights(case, xla_step=True)
        return
    want = list(_one_device_fit(case))
    # The optimizer's switch: each variable's update as an XLA function, step not compiled.
    assert_same(_fit_weights(case, jit_compile=True), want, rtol=1e-5, atol=1e-6)
    # Keras' switch: the whole train step compiled (the optimizer's math inlined).
    assert_same(_fit_weights(case, xla_step=True), want, rtol=1e-5, atol=1e-6)


AUTOGRAPH_CODE = RECORD_AUTOGRAPH + """
import cases as C
results = {}
for case in C.CASES:
    model = C.mlp()
    optimizer = C.make(case, model)
    x, y = C.batches(1)[0]
    before = C.weights(model)
    converted = package_code_converted(C.loop_step, model, optimizer, x, y)
    moved = max(float(abs(a - b).max()) for a, b in zip(C.weights(model), before))
    results[case] = {"converted": converted, "moved": moved}
print(json.dumps(results))
"""


@pytest.mark.slow
def test_autograph_in_a_users_tf_function_converts_no_package_code():
    """A custom loop's ``tf.function`` has AutoGraph on, which would convert the optimizer's
    ``apply`` and what it calls on the first trace (0.03-0.13 s per optimizer), though Keras'
    ``fit`` runs without it. One fresh process for every case."""
    results = run_fresh_python(AUTOGRAPH_CODE, timeout=600)
    assert set(results) == set(C.CASES)
    for case, result in results.items():
        assert result["converted"] == [], case
        assert result["moved"] > 1e-5, case


# --------------------------------------------------------------------------- variables

@case
@pytest.mark.equivalence
def test_plain_tf_variables_train_like_keras_variables(case):
    want = plain_trace(case)
    plain_model = C.mlp()
    plain = [v.value for v in plain_model.trainable_variables]   # the model's tf.Variables
    assert all(type(v) is not keras.Variable for v in plain)
    got = C.train(plain_model, C.make(case, plain_model), STEPS, variables=plain)
    assert_same(got[-1], want[-1], rtol=0, atol=0)
    if C.is_thor(case):
        return   # THOR preconditions a model's layers: its variables are the model's
    # Free-standing tf.Variables, as Keras' optimizers take them.
    rng = np.random.default_rng(0)
    start = [rng.normal(size=shape).astype("float32") for shape in ((3, 2), (2,))]
    grads = [[rng.normal(size=w.shape).astype("float32") for w in start] for _ in range(STEPS)]
    results = []
    for kind in (tf.Variable, keras.Variable):
        variables = [kind(w) for w in start]
        optimizer = C.make(case, None)
        for step in grads:
            scale = C.current_scale(optimizer)
            optimizer.apply_gradients([(tf.constant(g * scale), v)
                                       for g, v in zip(step, variables)])
        results.append([np.array(v) for v in variables])
    assert_same(results[0], results[1], rtol=0, atol=0)
    assert_moved([results[0]], start)


@case
@pytest.mark.parametrize("dtype, tolerance, eps", [
    pytest.param("float16", 3e-2, 2.0**-10, marks=pytest.mark.half_precision),
    pytest.param("bfloat16", 0.5, 2.0**-7, marks=pytest.mark.half_precision),
    ("float64", 1e-5, 2.0**-23)])
def test_variables_of_another_float_dtype(case, dtype, tolerance, eps):
    """Half- and double-precision variables train like float32 ones, up to the precision of
    the coarser dtype."""
    reference_start = C.weights(C.mlp())
    model = C.mlp(dtype=dtype)
    model.set_weights(reference_start)   # the float32 start, rounded
    start = [w.astype("float64") for w in C.weights(model)]
    got = C.train(model, C.make(case, model), STEPS)[-1]
    assert all(v.dtype == dtype for v in model.trainable_variables)
    want = plain_trace(case)[-1]
    for g, s, w, ws in zip(got, start, want, reference_start):
        update, reference_update = g.astype("float64") - s, w.astype("float64") - ws
        assert np.all(np.isfinite(update))
        # Whole-tensor error (Adam's step is sign-like: a tiny gradient's sign may differ).
        error = np.linalg.norm(update - reference_update)
        assert error <= tolerance * np.linalg.norm(reference_update) + eps * np.linalg.norm(s), (
            error, np.linalg.norm(reference_update))


# --------------------------------------------------------------------------- Keras features

def _clip_by_norm(g, c):
    return g * c / tf.maximum(tf.norm(g), c)


CLIPPING = {
    "clipnorm": (0.05, lambda grads, c: [_clip_by_norm(g, c) for g in grads]),
    "clipvalue": (0.01, lambda grads, c: [tf.clip_by_value(g, -c, c) for g in grads]),
    "global_clipnorm": (0.05, lambda grads, c: [
        g * c / tf.maximum(tf.linalg.global_norm(grads), c) for g in grads]),
}


@case
@pytest.mark.parametrize("clip", sorted(CLIPPING))
@pytest.mark.equivalence
def test_clipping_equals_clipping_by_hand(case, clip):
    threshold, clip_by_hand = CLIPPING[clip]
    model = C.mlp()
    got = C.train(model, C.make(case, model, **{clip: threshold}), STEPS)
    reference_model = C.mlp()
    seen = []

    def by_hand(grads):
        clipped = clip_by_hand(grads, threshold)
        seen.append(any(float(tf.reduce_max(tf.abs(a - b))) > 0 for a, b in zip(grads, clipped)))
        return clipped

    want = C.train(reference_model, C.make(case, reference_model), STEPS,
                   transform=C.on_unscaled(by_hand))
    assert all(seen), "the threshold should clip every step"
    assert_same(got[-1], want[-1], rtol=1e-5, atol=1e-7)


@case
@pytest.mark.parametrize("form", ["var_names", "var_list"])
def test_exclude_from_weight_decay(case, form):
    """With zero gradients only weight decay moves a weight: the excluded ones stay put and
    the others move exactly as without the exclusion."""
    def run(exclude):
        model = C.mlp()
        optimizer = C.make(case, model, weight_decay=0.1)
        head = model.get_layer("head")
        if exclude and form == "var_names":
            optimizer.exclude_from_weight_decay(var_names=["head"])
        elif exclude:
            optimizer.exclude_from_weight_decay(var_list=[head.kernel, head.bias])
        zeros = [tf.zeros_like(v) for v in model.trainable_variables]
        for _ in range(2):
            optimizer.apply(zeros, model.trainable_variables)
        return C.weights(model)

    start = C.weights(C.mlp())
    excluded, plain = run(True), run(False)
    fc1_kernel, fc1_bias, head_kernel, head_bias = range(4)
    assert np.abs(plain[head_kernel] - start[head_kernel]).max() > 1e-5, "decay must act"
    assert np.abs(plain[fc1_kernel] - start[fc1_kernel]).max() > 1e-5
    for index in (head_kernel, head_bias):
        np.testing.assert_array_equal(excluded[index], start[index])
    for index in (fc1_kernel, fc1_bias):
        np.testing.assert_array_equal(excluded[index], plain[index])


@case
@pytest.mark.parametrize("form", ["var_names", "var_list"])
@pytest.mark.equivalence
def test_exclude_from_weight_decay_inside_strategy_run(case, form, two_cpu_strategy):
    """Keras' distributed weight-decay test: each replica configures the exclusion inside
    ``strategy.run`` and then applies (the optimizer builds once every replica has
    configured it, as Keras' own do); the result is one device's."""
    def run(strategy):
        with strategy.scope() if strategy else tf.init_scope():
            model = C.mlp()
            optimizer = C.make(case, model, weight_decay=0.1)
        head = model.get_layer("head")
        zeros = [tf.zeros_like(v) for v in model.trainable_variables]

        def configure_and_apply():
            if form == "var_names":
                optimizer.exclude_from_weight_decay(var_names=["head"])
            else:
                optimizer.exclude_from_weight_decay(var_list=[head.kernel, head.bias])
            optimizer.apply(zeros, model.trainable_variables)

        def apply():
            optimizer.apply(zeros, model.trainable_variables)

        for step in (configure_and_apply, apply):
            strategy.run(step) if strategy else step()
        return C.weights(model)

    start = C.weights(C.mlp())
    mirrored, one_device = run(two_cpu_strategy), run(None)
    fc1_kernel, fc1_bias, head_kernel, head_bias = range(4)
    assert np.abs(one_device[fc1_kernel] - start[fc1_kernel]).max() > 1e-5, "decay must act"
    for index in (head_kernel, head_bias):
        np.testing.assert_array_equal(one_device[index], start[index])
    assert_same(mirrored, one_device, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CONFIG_PARAMS)
def test_set_weights_on_an_unbuilt_optimizer_fails_as_keras_does(case):
    with pytest.raises(ValueError) as keras_error:
        keras.optimizers.Adam().set_weights([])
    model = C.mlp()
    with pytest.raises(ValueError) as error:
        C.make(case, model).set_weights([np.zeros(())])
    assert str(error.value).startswith(str(keras_error.value))


@case
def test_use_ema(case):
    model = C.mlp()
    optimizer = C.make(case, model, use_ema=True, ema_momentum=0.5)
    trace = C.train(model, optimizer, STEPS + 1)
    assert_same(trace[STEPS - 1], plain_trace(case)[-1], rtol=0, atol=0)   # the average does not steer training
    average = trace[0]                                  # Keras: the first step copies
    for step in trace[1:]:
        average = [0.5 * a + 0.5 * w for a, w in zip(average, step)]
    optimizer.finalize_variable_values(model.trainable_variables)
    assert_same(C.weights(model), average, rtol=1e-6, atol=1e-7)


@case
def test_ema_overwrite_frequency(case):
    """With ``ema_overwrite_frequency=3`` the third update ends by writing the average into
    the variables, as Keras' optimizers do."""
    def run(**kwargs):
        model = C.mlp()
        return C.train(model, C.make(case, model, use_ema=True, ema_momentum=0.5, **kwargs), 3)

    got, want = run(ema_overwrite_frequency=3), run()
    average = want[0]
    for step in want[1:]:
        average = [0.5 * a + 0.5 * w for a, w in zip(average, step)]
    for got_step, want_step in zip(got[:2], want[:2]):
        assert_same(got_step, want_step, rtol=0, atol=0)
    assert_same(got[2], average, rtol=1e-6, atol=1e-7)
    assert_moved([got[2]], want[2])


def random_gradients(steps, seed=0):
    """``steps`` lists of gradients, one per variable of :func:`cases.mlp`."""
    rng = np.random.default_rng(seed)
    shapes = [v.shape for v in C.mlp().trainable_variables]
    return [[rng.normal(size=s).astype("float32") for s in shapes] for _ in range(steps)]


def apply_scaled(optimizer, grads, variables, unscaled=()):
    """``optimizer.apply`` of ``grads`` times the current loss scale, then ``unscaled``."""
    scale = C.current_scale(optimizer)
    optimizer.apply([tf.constant(g * scale) for g in grads] + [tf.constant(g) for g in unscaled],
                    variables)


@case
@pytest.mark.parametrize("decay", [{}, {"weight_decay": 0.05}], ids=["", "weight_decay"])
def test_gradient_accumulation_steps(case, decay):
    """As in Keras: a cycle of accumulated steps is one step on their mean gradient, weight
    decay included (applied once per update)."""
    grads = random_gradients(4)
    averaged = [[(a + b) / np.float32(2) for a, b in zip(grads[i], grads[i + 1])]
                for i in (0, 2)]

    def run(steps, **kwargs):
        model = C.mlp()
        optimizer = C.make(case, model, **decay, **kwargs)
        for step in steps:
            apply_scaled(optimizer, step, model.trainable_variables)
        return C.weights(model), int(optimizer.iterations.numpy())

    got, got_iterations = run(grads, gradient_accumulation_steps=2)
    want, want_iterations = run(averaged)
    assert got_iterations == want_iterations == 2
    assert_same(got, want, rtol=1e-6, atol=1e-7)


@case
@pytest.mark.equivalence
def test_indexed_slices_gradients_equal_dense_ones(case):
    model = C.embedding_model()
    kinds = []

    def record(grads, scale):
        kinds.append(type(grads[0]))
        return grads

    got = C.train(model, C.make(case, model), STEPS, transform=record, token=True)
    assert kinds == [tf.IndexedSlices] * STEPS
    dense_model = C.embedding_model()
    want = C.train(dense_model, C.make(case, dense_model), STEPS, token=True,
                   transform=lambda grads, scale: [tf.convert_to_tensor(g) for g in grads])
    assert_same(got[-1], want[-1], rtol=1e-6, atol=1e-7)


@case
def test_sparse_gradients_reach_variables_through_the_optimizers_assign(case):
    """Keras' sparse-gradient check: with an IndexedSlices gradient, the optimizers write
    their variables through their ``assign``/``assign_add``/``assign_sub`` (which keep an
    update sparse, and are patched out here) or their fused ops, never through a variable's
    own methods on anything but a scalar (which would densify it)."""
    model = C.embedding_model()
    optimizer = C.make(case, model)
    x, y = C.token_batches(1)[0]
    with tf.GradientTape() as tape:
        loss = keras.ops.mean(keras.ops.square(model(x, training=True) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)
    chain = [optimizer]
    while hasattr(chain[-1], "inner_optimizer"):
        chain.append(chain[-1].inner_optimizer)
    variable_class = type(model.trainable_variables[0].value)
    direct = []

    def through_variable(variable, value, *args, **kwargs):
        if len(variable.shape):
            direct.append(variable.name)

    with contextlib.ExitStack() as patches:
        for method in ("assign", "assign_add", "assign_sub"):
            for inner in chain:
                patches.enter_context(mock.patch.object(inner, method, autospec=True))
            patches.enter_context(mock.patch.object(
                variable_class, method, autospec=True, side_effect=through_variable))
        optimizer.apply(grads, model.trainable_variables)
    assert direct == [], f"assigned directly, densifying a sparse update: {direct}"


@case
def test_empty_gradient_list_is_a_no_op(case):
    model = C.mlp()
    optimizer = C.make(case, model)
    unbuilt = C.make(case, model)
    unbuilt.apply([], [])
    unbuilt.apply_gradients([])
    assert not unbuilt.built
    C.train(model, optimizer, 1)
    before = C.weights(model), [np.array(v) for v in optimizer.variables]
    optimizer.apply([], [])
    optimizer.apply_gradients([])
    assert_same(C.weights(model), before[0], rtol=0, atol=0)
    assert_same([np.array(v) for v in optimizer.variables], before[1], rtol=0, atol=0)
    assert int(optimizer.iterations.numpy()) == 1


# --------------------------------------------------------------------------- Keras' own checks
# What keras/src/optimizers/optimizer_test.py asks of every Keras optimizer.

@pytest.mark.parametrize("case", CONFIG_PARAMS)
def test_pickle_round_trips_the_config(case):
    model = C.mlp()
    optimizer = C.make(case, model, weight_decay=0.01)
    clone = pickle.loads(pickle.dumps(optimizer))
    assert type(clone) is type(optimizer)
    assert clone.get_config() == optimizer.get_config()


@case
def test_a_schedule_set_as_learning_rate_replaces_its_variable(case):
    """Setting ``learning_rate`` to a schedule drops the rate's variable (Keras' check), and
    the next step reads the schedule: as setting the variable to its value does."""
    def run(set_rate):
        model = C.mlp()
        optimizer = C.make(case, model)
        C.train(model, optimizer, 1)
        count = len(optimizer.variables)
        rate = float(np.asarray(optimizer.learning_rate))
        set_rate(optimizer, rate)
        x, y = C.batches(2)[1]
        C.loop_step(model, optimizer, x, y)
        return C.weights(model), count - len(optimizer.variables)

    def schedule(optimizer, rate):   # rate / 2 at the second step
        optimizer.learning_rate = keras.optimizers.schedules.ExponentialDecay(rate, 1, 0.5)
        np.testing.assert_allclose(float(np.asarray(optimizer.learning_rate)), rate / 2,
                                   rtol=1e-6)

    got, dropped = run(schedule)
    want, _ = run(lambda optimizer, rate: optimizer.learning_rate.assign(rate / 2))
    assert dropped == 1
    assert_same(got, want, rtol=1e-6, atol=1e-7)
    assert_moved([got], plain_trace(case)[1])


@case
@pytest.mark.equivalence
def test_callable_learning_rate_equals_its_value(case):
    model = C.mlp()
    optimizer = C.make(case, model)
    rate = float(np.asarray(optimizer.learning_rate))
    optimizer.learning_rate = lambda: rate
    got = C.train(model, optimizer, STEPS)
    assert_same(got[-1], plain_trace(case)[-1], rtol=0, atol=0)


@case
def test_constraints_apply_after_each_step(case):
    """A variable's ``constraint`` projects it after every update, as doing so by hand does."""
    def run(by_hand):
        model = C.mlp()
        kernel = model.get_layer("fc1").kernel
        if not by_hand:
            kernel.constraint = keras.constraints.NonNeg()
        optimizer = C.make(case, model)
        for x, y in C.batches(STEPS):
            C.loop_step(model, optimizer, x, y)
            if by_hand:
                kernel.assign(tf.maximum(kernel, 0.0))
        return C.weights(model)

    got = run(by_hand=False)
    assert (got[0] == 0).any()   # the constraint cut entries that the step left negative
    assert_same(got, run(by_hand=True), rtol=0, atol=0)


@case
@pytest.mark.parametrize("accumulation", [None, 2])
def test_overwrite_with_gradient_sets_the_variable_as_keras_does(case, accumulation):
    """A variable flagged ``overwrite_with_gradient`` (float8 training's scales) takes its
    "gradient", which no loss scale multiplies, as its value when and as Keras' SGD (inside
    Keras' LossScaleOptimizer for a loss-scaled case) does; the other variables step as
    without it."""
    kwargs = {} if accumulation is None else {"gradient_accumulation_steps": accumulation}
    steps = 2 * (accumulation or 1)
    grads = random_gradients(steps)
    values = np.random.default_rng(1).normal(size=(steps, 2, 2)).astype("float32")

    def run(optimizer, variables, flagged=None):
        trace = []
        for step in range(steps):
            if variables == [flagged]:   # Keras' reference
                optimizer.apply([tf.constant(values[step])], variables)
            else:
                apply_scaled(optimizer, grads[step], variables,
                             [] if flagged is None else [values[step]])
            trace.append(np.array(flagged) if flagged is not None else None)
        return trace

    def flagged_variable():
        variable = keras.Variable(np.zeros((2, 2), "float32"))
        variable.overwrite_with_gradient = True
        return variable

    model, flagged = C.mlp(), flagged_variable()
    got = run(C.make(case, model, **kwargs), model.trainable_variables + [flagged], flagged)
    plain_model = C.mlp()
    run(C.make(case, plain_model, **kwargs), plain_model.trainable_variables)
    reference = keras.optimizers.SGD(0.1, **kwargs)
    if C.is_loss_scaled(case):
        reference = keras.optimizers.LossScaleOptimizer(reference, C.INITIAL_SCALE, 2)
    keras_flagged = flagged_variable()
    want = run(reference, [keras_flagged], keras_flagged)
    assert_same(C.weights(model), C.weights(plain_model), rtol=0, atol=0)
    assert_same(got, want, rtol=0, atol=0)
    if accumulation is None:
        assert_same(got, values, rtol=0, atol=0)
    else:   # held through a cycle, set at its end
        assert not got[0].any() and got[1].any()


@case
def test_a_missing_gradient_warns_and_the_other_variables_step(case):
    """As Keras' optimizers: a variable whose gradient is None is named in a warning and
    left as it is; the others step as if it had not been passed."""
    def run(drop_head_bias):
        model = C.mlp()
        optimizer = C.make(case, model)
        optimizer.build(model.trainable_variables)
        variables = model.trainable_variables
        for step in random_gradients(STEPS):
            if drop_head_bias:
                apply_scaled(optimizer, step[:-1], variables[:-1])
            else:
                step = [tf.constant(g * C.current_scale(optimizer)) for g in step[:-1]]
                optimizer.apply(step + [None], variables)
        return C.weights(model), int(optimizer.iterations.numpy())

    with pytest.warns(UserWarning, match=r"Gradients do not exist for variables \['.*head/bias"):
        got, iterations = run(drop_head_bias=False)
    want, want_iterations = run(drop_head_bias=True)
    assert iterations == want_iterations == STEPS
    assert_same(got, want, rtol=0, atol=0)
    np.testing.assert_array_equal(got[-1], C.weights(C.mlp())[-1])


@case
def test_loss_scale_factor_is_undone(case):
    """Keras' fixed ``loss_scale_factor``: gradients of a loss scaled by ``scale_loss`` step
    as unscaled ones. Inside a LossScaleOptimizer the wrapper's own scale replaces it, as in
    Keras (which resets the inner optimizer's factor)."""
    factor = 1024.0
    model = C.mlp()
    optimizer = C.make(case, model, loss_scale_factor=factor)
    if C.is_loss_scaled(case):
        assert innermost(optimizer).loss_scale_factor is None
        assert float(optimizer.scale_loss(1.0)) == C.INITIAL_SCALE
    else:
        assert float(optimizer.scale_loss(1.0)) == factor
    got = C.train(model, optimizer, STEPS)
    assert_same(got[-1], plain_trace(case)[-1], rtol=1e-6, atol=1e-7)
