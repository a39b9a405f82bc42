"""THOR in training: fit on digits, XLA, loss scaling, custom loops, singular statistics."""
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO_ROOT, curvature_variables
from test_thor_numerics import inverse_path  # noqa: F401 (fixture)

import tf_msopt as mso


def digits():
    from sklearn.datasets import load_digits
    data = load_digits()
    return (data.data / 16.0).astype("float32"), data.target.astype("int32")


def digits_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])


def digits_cnn():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8, 8, 1)),
                             keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                             keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(10)])


def final_loss(model, optimizer, x, y, epochs=3):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=0)   # seeded shuffle
    return history.history["loss"][-1]


@pytest.mark.parametrize("build, damping, image", [(digits_mlp, 0.03, False),
                                                   (digits_cnn, 0.3, True)],
                         ids=["mlp", "cnn"])
def test_fit_on_digits_beats_sgd_momentum(build, damping, image):
    x, y = digits()
    if image:
        x = x.reshape(-1, 8, 8, 1)
    model = build()
    thor = final_loss(model, mso.thor(model, 0.05, damping, 0.9, frequency=10), x, y)
    sgd = min(final_loss(build(), keras.optimizers.SGD(lr, momentum=0.9), x, y)
              for lr in (0.05, 0.1))
    assert thor < 0.8 * sgd, (thor, sgd)


def mixed_model(attention=True, token_projection=False):
    """Conv2D, Embedding, MultiHeadAttention (unless ``attention`` is False), a Dense on
    each token (with ``token_projection``), LayerNorm and Dense in one small functional
    model."""
    keras.utils.set_random_seed(0)
    image = keras.Input((6, 6, 1))
    ids = keras.Input((3,), dtype="int32")
    a = keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="tanh",
                            name="conv")(image)
    tokens = keras.layers.Embedding(7, 4 if attention else 2, name="emb")(ids)
    if attention:
        tokens = keras.layers.MultiHeadAttention(2, 2, use_bias=False,
                                                 name="attention")(tokens, tokens)
    if token_projection:
        tokens = keras.layers.Dense(2, activation="tanh", name="tokens")(tokens)
    b = keras.layers.Flatten()(tokens)
    h = keras.layers.Concatenate()([keras.layers.Flatten()(a), b])
    h = keras.layers.LayerNormalization(name="ln")(h)
    return keras.Model([image, ids], keras.layers.Dense(2, name="head")(h))


def mixed_data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return ([rng.normal(size=(n, 6, 6, 1)).astype("float32"),
             rng.integers(0, 7, size=(n, 3)).astype("int32")],
            rng.normal(size=(n, 2)).astype("float32"))


def train_mixed(batch=8, data=None, model=None, default=False, frequency=3, xla=False,
                wrap=None, steps_per_execution=1, **thor_kwargs):
    """The mixed model (or ``model``, compiled) trained by ``fit`` on ``data`` (by default
    48 examples: 6 steps of 8, 2 of them THOR's), ``batch`` at a time, in MindSpore's form
    or the default, refreshing every ``frequency`` updates."""
    x, y = data or mixed_data()
    if model is None:
        model = mixed_model()
        optimizer = (mso.thor(model, frequency=frequency, **thor_kwargs) if default else
                     mso.thor(model, 0.05, 0.05, 0.9, frequency=frequency, block_size=4,
                              **thor_kwargs))
        model.compile(optimizer=optimizer if wrap is None else wrap(optimizer), loss="mse",
                      jit_compile=xla, steps_per_execution=steps_per_execution)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return model


def assert_weights_close(got, want, rtol=1e-5):
    for a, b in zip(got, want):
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), np.max(np.abs(a - b))


@pytest.mark.parametrize("default, options", [
    (False, {}), (True, {}),
    (True, dict(statistics_rows=72)),   # every 2nd example's 9 convolution rows of 16
], ids=["mindspore", "default", "subsampled"])
@pytest.mark.equivalence
def test_gradient_accumulation_updates_as_the_larger_batch(default, options):
    """Two accumulated steps of 8 examples update as one step of 16: THOR sums their
    statistics as Keras averages their gradients (and subsamples them as the whole
    batch's)."""
    whole = train_mixed(16, default=default, **options)
    accumulated = train_mixed(8, default=default, gradient_accumulation_steps=2, **options)
    assert int(accumulated.optimizer.iterations.numpy()) == 3
    assert_weights_close(accumulated.get_weights(), whole.get_weights(), rtol=1e-5)
    assert not np.allclose(whole.get_weights()[0], mixed_model().get_weights()[0])


@pytest.mark.equivalence
def test_gradient_accumulation_resumes_exactly_within_a_cycle(tmp_path):
    """Saved after the first step of an accumulation cycle, the statistics it captured are
    saved with the gradients Keras accumulated: the resumed run ends as the uninterrupted."""
    x, y = mixed_data()
    whole = train_mixed(8, frequency=2, gradient_accumulation_steps=2)
    # 5 steps: the first of the third update, whose statistics refresh the inverses
    first = train_mixed(8, data=([part[:40] for part in x], y[:40]), frequency=2,
                        gradient_accumulation_steps=2)
    path = str(tmp_path / "accumulating.keras")
    first.save(path)
    loaded = keras.models.load_model(path)
    mso.thor.connect(loaded)
    train_mixed(8, data=([part[40:] for part in x], y[40:]), model=loaded)
    for got, want in zip(loaded.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_gradient_accumulation_under_two_replicas_is_refused(two_cpu_strategy):
    with two_cpu_strategy.scope():
        model = mixed_model()
        model.compile(optimizer=mso.thor(model, gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 cannot run under a "
                                         "strategy with several replicas"):
        model.fit(*mixed_data(16), batch_size=8, epochs=1, verbose=0)


@pytest.mark.equivalence
def test_xla_train_step_equals_plain():
    """Compiled with XLA, the step gives the plain step's weights; only a refresh compiled
    with it (the whole step, not THOR's per-update ``jit_compile``), on a host without a
    GPU, warns of XLA's slow factorisations."""
    plain = plain_weights()
    whole, whole_warned = _warned_of_xla(lambda: train_mixed(xla=True).get_weights())
    updates, updates_warned = _warned_of_xla(
        lambda: train_mixed(jit_compile=True).get_weights())
    assert_weights_close(whole, plain)
    assert_weights_close(updates, plain)
    assert whole_warned == (not tf.config.list_logical_devices("GPU"))
    assert not updates_warned


def _warned_of_xla(train):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = train()
    return weights, any("refresh is being compiled with XLA" in str(w.message) for w in caught)


_PLAIN = {}


def plain_weights():
    """The weights of ``train_mixed()`` (computed once per process)."""
    if "weights" not in _PLAIN:
        _PLAIN["weights"] = train_mixed().get_weights()
        keras.backend.clear_session()
    return _PLAIN["weights"]


@pytest.mark.parametrize("scaling", [
    dict(wrap=lambda optimizer: mso.LossScaleOptimizer(
        optimizer, mso.DynamicLossScaleManager(2.0 ** 12, 2, 2))),
    dict(wrap=lambda optimizer: mso.LossScaleOptimizer(
        optimizer, mso.FixedLossScaleManager(128.0, drop_overflow_update=False))),
    dict(wrap=lambda optimizer: keras.optimizers.LossScaleOptimizer(
        optimizer, initial_scale=2.0 ** 10, dynamic_growth_steps=2)),   # found via the model
    dict(loss_scale_factor=64.0),                      # Keras' own argument
], ids=["dynamic", "fixed_no_drop", "keras_wrapper", "loss_scale_factor"])
@pytest.mark.equivalence
def test_loss_scale_is_undone_in_g(scaling):
    assert_weights_close(train_mixed(**scaling).get_weights(), plain_weights())


def test_steps_per_execution_equals_a_step_a_call():
    """Several steps looped in one call of the train function (``steps_per_execution``),
    the THOR steps among them, give the weights of one step a call, to the bit."""
    for got, want in zip(train_mixed(steps_per_execution=4).get_weights(), plain_weights()):
        np.testing.assert_array_equal(got, want)


def test_loss_scale_in_a_custom_loop():
    """MindSpore's ``loss_scale`` (the loss scaled by hand: THOR divides g and G by it), and a
    LossScaleOptimizer around THOR in a custom loop (its scale is undone in G)."""
    x, y = mixed_data()

    def run(loss_scale=1.0, wrapper_scale=None, keras_wrapper=False):
        model = mixed_model()
        optimizer = mso.thor(model, 0.05, 0.05, 0.9, frequency=3, block_size=4,
                             loss_scale=loss_scale)
        if keras_wrapper:       # Keras' class, outside any compiled model: linked by hand
            thor, optimizer = optimizer, keras.optimizers.LossScaleOptimizer(
                optimizer, initial_scale=wrapper_scale)
            thor.link_loss_scale_optimizer(optimizer)
        elif wrapper_scale is not None:
            optimizer = mso.LossScaleOptimizer(optimizer, wrapper_scale)
        optimizer.build(model.trainable_variables)

        @tf.function
        def step(inputs, targets):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(inputs, training=True) - targets))
                scaled = optimizer.scale_loss(loss) if wrapper_scale else loss * loss_scale
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

        for i in range(6):
            step([x[0][8 * i:8 * i + 8], x[1][8 * i:8 * i + 8]], y[8 * i:8 * i + 8])
        return model.get_weights()

    assert_weights_close(run(loss_scale=16.0), plain_weights())   # a custom loop equals fit
    assert_weights_close(run(wrapper_scale=32.0), plain_weights())
    assert_weights_close(run(wrapper_scale=32.0, keras_wrapper=True), plain_weights())


def test_wrapper_thor_cannot_find_raises():
    """Keras' LossScaleOptimizer around THOR in a custom loop, neither compiled with the model
    nor linked: THOR cannot undo the scale in G, so it refuses to train."""
    model = mixed_model()
    optimizer = keras.optimizers.LossScaleOptimizer(mso.thor(model, 0.05, 0.05, 0.9))
    x, y = mixed_data(8)
    with tf.GradientTape() as tape:
        loss = optimizer.scale_loss(tf.reduce_mean(tf.square(model(x) - y)))
    grads = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(RuntimeError, match="link_loss_scale_optimizer"):
        optimizer.apply(grads, model.trainable_variables)
    with pytest.raises(ValueError, match="inner_optimizer is this THOR"):
        mso.thor(model, 0.05, 0.05, 0.9).link_loss_scale_optimizer(optimizer)


def test_statistics_only_on_thor_steps():
    """Stale steps and predict/evaluate leave the statistics alone; THOR steps rewrite them."""
    model = mixed_model()
    optimizer = mso.thor(model, 0.05, 0.05, 0.9, frequency=2, block_size=4)
    model.compile(optimizer=optimizer, loss="mse")
    buffers = optimizer._model_link.connection.statistics
    snapshot = lambda: [b.a.numpy().copy() for b in buffers]  # noqa: E731
    batches = [mixed_data(8, seed) for seed in range(3)]
    model.train_on_batch(*batches[0])                  # step 0: THOR
    after_thor = snapshot()
    inverses = [v.numpy().copy() for v in curvature_variables(optimizer, "g_inverse")]
    model.train_on_batch(*batches[1])                  # step 1: stale
    model.predict(batches[2][0], verbose=0)
    model.evaluate(*batches[2], verbose=0)
    for before, after in zip(after_thor, snapshot()):
        np.testing.assert_array_equal(before, after)
    for before, variable in zip(inverses, curvature_variables(optimizer, "g_inverse")):
        np.testing.assert_array_equal(before, variable.numpy())
    model.train_on_batch(*batches[2])                  # step 2: THOR
    assert all(not np.array_equal(b, a) for b, a in zip(after_thor, snapshot()))


@pytest.mark.half_precision
@pytest.mark.parametrize("fisher", ["empirical", "sampled"])
def test_mixed_float16_records_float32_statistics(fisher):
    """Under the mixed_float16 policy (layers compute in float16, inside Keras'
    LossScaleOptimizer) a THOR step records the statistics in float32: the first layer's A
    is the covariance of its float16-rounded inputs, the LayerNorm rule sees the batch, and
    the weights stay finite."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.LayerNormalization(),
                                  keras.layers.Dense(3, dtype="float32")])
        optimizer = mso.thor(model, 0.05, 0.1, 0.9, frequency=2, block_size=None,
                             fisher=fisher, seed=0)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(optimizer),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
        model.train_on_batch(x, np.arange(8) % 3)
    finally:
        keras.config.set_dtype_policy("float32")
    rounded = x.astype(np.float16).astype(np.float64)
    first = optimizer._model_link.connection.statistics[0]
    assert first.a.dtype == "float32"
    np.testing.assert_allclose(first.a.numpy()[0], rounded.T @ rounded, rtol=1e-5, atol=1e-5)
    assert float(first.rows.numpy()) == 8 and float(optimizer._model_link.connection.batch.numpy()) == 8
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def float64_conv_model(dtype):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 3), dtype=dtype),
        keras.layers.Conv1D(5, 3, activation="tanh", dtype=dtype),
        keras.layers.LayerNormalization(dtype=dtype), keras.layers.Flatten(dtype=dtype),
        keras.layers.Dense(3, dtype=dtype)])


@pytest.mark.parametrize("options", [{}, dict(learning_rate=0.05, damping=0.03, momentum=0.9,
                                               frequency=2)], ids=["default", "mindspore"])
@pytest.mark.parametrize("floatx", ["float32", "float64"])
def test_float64_model_trains_as_its_float32_twin(options, floatx):
    """A float64 model (its layers' dtype, or Keras' floatx) keeps float64 weights and
    momenta, THOR's curvature stays float32, and the weights follow the float32 model's to
    float32 precision."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 6, 3)), np.arange(48) % 3
    initial = float64_conv_model("float32").get_weights()
    weights = {}
    for dtype in ("float32", "float64"):
        keras.config.set_floatx(floatx if dtype == "float64" else "float32")
        try:
            model = float64_conv_model(dtype)
            model.set_weights([w.astype(dtype) for w in initial])
            optimizer = mso.thor(model, **options)
            model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
            for start in range(0, 48, 8):
                model.train_on_batch(x[start:start + 8].astype(dtype), y[start:start + 8])
        finally:
            keras.config.set_floatx("float32")
        assert {w.dtype for w in model.get_weights()} == {np.dtype(dtype)}
        assert {v.dtype for v in curvature_variables(
            optimizer, "a_inverse", "g_inverse", "a_eigenvectors", "g_eigenvectors",
            "rotated_second_moment", "a_average", "g_average", "count")} == {"float32"}
        weights[dtype] = model.get_weights()
    for single, double in zip(weights["float32"], weights["float64"]):
        scale = max(np.max(np.abs(double)), 0.1)
        assert np.max(np.abs(single - double)) / scale < 1e-5


def counting_update_traces(optimizer):
    traces = []
    update_variables = optimizer.update_variables
    optimizer.update_variables = lambda *args: (traces.append(1), update_variables(*args))[1]
    return traces


@pytest.mark.parametrize("entry", ["fit", "train_on_batch"])
def test_thor_models_build_before_tracing_their_train_step(entry):
    """A tf.function whose first trace creates variables is traced again; fit and
    train_on_batch build the optimizer and the compiled metrics first (as Keras does under
    a strategy), so the train step is traced once, and the metrics still count."""
    x, y = digits()
    model = digits_mlp()
    optimizer = mso.thor(model, 0.05, 0.03, 0.9, frequency=2)
    traces = counting_update_traces(optimizer)
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert not optimizer.built
    if entry == "fit":
        logs = model.fit(x[:150], y[:150], batch_size=64, epochs=1, verbose=0).history
        logs = {name: values[-1] for name, values in logs.items()}
        steps = 3   # 64, 64 and 22
    else:
        logs, steps = model.train_on_batch(x[:64], y[:64], return_dict=True), 1
    assert len(traces) == 1 and optimizer.iterations.numpy() == steps
    assert 0.0 < logs["accuracy"] <= 1.0 and np.isfinite(logs["loss"])


def test_thor_build_before_tracing_starts_no_extra_data_iterator(monkeypatch):
    """The build reads the batch's shapes from the dataset: fit with validation data starts
    as many tf.data iterators under THOR as under SGD (each one started and dropped costs
    its prefetch's shutdown)."""
    x, y = digits()
    started = []
    dataset_iter = tf.data.Dataset.__iter__
    monkeypatch.setattr(tf.data.Dataset, "__iter__",
                        lambda self: (started.append(1), dataset_iter(self))[1])

    def iterators(make_optimizer):
        model = digits_mlp()
        model.compile(optimizer=make_optimizer(model), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        started.clear()
        model.fit(x[:150], y[:150], batch_size=64, epochs=2, verbose=0,
                  validation_data=(x[150:250], y[150:250]))
        return len(started)

    sgd = iterators(lambda model: keras.optimizers.SGD(0.05, momentum=0.9))
    assert sgd > 0
    assert iterators(lambda model: mso.thor(model, 0.05, 0.03, 0.9, frequency=2)) == sgd


def test_inversion_graph_traced_once_when_a_custom_step_is_traced_twice():
    """A custom step whose first trace builds THOR is traced twice; the inversion part,
    which does not depend on the batch, is built once."""
    x, y = digits()
    model = digits_mlp()
    optimizer = mso.thor(model, 0.05, 0.03, 0.9, frequency=2)
    traces = counting_update_traces(optimizer)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        optimizer.apply(tape.gradient(value, model.trainable_variables),
                        model.trainable_variables)

    step(x[:64], y[:64])
    assert len(traces) == 2 and optimizer.iterations.numpy() == 1
    assert optimizer._estimator.traced_refresh._traced.experimental_get_tracing_count() == 1


def train_singular(xla=False):
    """An all-zero input feature and unused tokens with damping 0 (without attention:
    undamped attention steps diverge, which is not what this is for)."""
    model = mixed_model(attention=False)
    optimizer = mso.thor(model, 0.05, 0.0, 0.9, frequency=2, block_size=4)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=xla)
    (image, ids), y = mixed_data()
    image[..., :3, :] = 0.0                              # zero patches rows for the conv
    ids[:] = np.minimum(ids, 2)                          # tokens 3..6 never seen
    model.fit([image, ids], y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model, optimizer


def test_singular_statistics_keep_weights_finite(inverse_path):
    """Singular statistics are retried with more damping, never NaN."""
    model, optimizer = train_singular()
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert all(np.all(np.isfinite(v.numpy())) for v in optimizer.variables)
    assert int(optimizer.damping_retries.numpy()) > 0


def test_non_finite_statistics_keep_previous_inverse():
    """A NaN gradient through a layer (no loss scaling to catch it): its inverses are kept."""
    model = mixed_model()
    optimizer = mso.thor(model, 0.05, 0.05, 0.9, frequency=2, block_size=4)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = mixed_data(8)
    model.train_on_batch(x, y)
    kept = [v.numpy().copy() for v in curvature_variables(optimizer, "g_inverse")]
    model.train_on_batch(x, y)                           # stale
    y = y.copy()
    y[0, 0] = np.nan
    model.train_on_batch(x, y)                           # THOR step on NaN statistics
    for before, variable in zip(kept, curvature_variables(optimizer, "g_inverse")):
        np.testing.assert_array_equal(before, variable.numpy())
    assert int(optimizer.failed_inverses.numpy()) > 0


def test_non_finite_statistics_keep_previous_eigenvectors():
    """The default's form, statistics unaveraged and every basis recomputed, on a NaN
    gradient: each block of the output side's factors (NaN) keeps its eigenvectors and is
    counted once; the input side's (finite) are replaced."""
    model = mixed_model()
    optimizer = mso.thor(model, frequency=2, statistics_decay=None, eigenbasis_tolerance=None,
                         block_size=4)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = mixed_data(8)
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)                           # stale
    before = {field: [v.numpy().copy() for v in curvature_variables(optimizer, field)]
              for field in ("g_eigenvectors", "a_eigenvectors")}
    y = y.copy()
    y[0, 0] = np.nan
    model.train_on_batch(x, y)                           # a refresh from NaN statistics
    g_vectors = curvature_variables(optimizer, "g_eigenvectors")
    for old, variable in zip(before["g_eigenvectors"], g_vectors):
        np.testing.assert_array_equal(old, variable.numpy())
    assert any(not np.array_equal(old, variable.numpy()) for old, variable in zip(
        before["a_eigenvectors"], curvature_variables(optimizer, "a_eigenvectors")))
    assert int(optimizer.failed_inverses.numpy()) == sum(
        variable.shape[0] for variable in g_vectors if len(variable.shape) == 3)


@pytest.mark.slow
def test_example_runs():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    result = subprocess.run([sys.executable, "examples/thor_cnn.py", "--epochs", "1"],
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final loss: THOR" in result.stdout and "reloaded" in result.stdout
