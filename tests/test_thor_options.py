"""THOR's opt-in options: damping_mode="pi", statistics_decay/statistics_frequency,
fisher="sampled", kl_clip and trace_thresholds.

The formulas of ``pi``, the bias-corrected averages, the KL factor and the trace rule are
checked against the NumPy reference (``thor_reference.py``) here and, over more layer kinds,
in ``test_thor_numerics.py::test_options_match_numpy_reference``. The sampled Fisher's ``G`` is
checked against NumPy given the same sampled labels (drawn here by a NumPy reference of its
hash). Then: MirroredStrategy equals one device, save/load resumes exactly, and a
LossScaleOptimizer around THOR leaves ``G`` unscaled, with the options on.
"""
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import curvature_variables
from test_thor_training import assert_weights_close, mixed_model

import tf_msopt as mso
from tf_msopt.thor.curvature_blocks import blocks_for
from tf_msopt.thor.sampled_fisher import output_distribution


def small_model(output_activation=None, inputs=4, hidden=5, outputs=3):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((inputs,)),
                             keras.layers.Dense(hidden, activation="tanh", name="fc"),
                             keras.layers.Dense(outputs, activation=output_activation,
                                                name="head")])


# -- arguments and config ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, argument", [
    (dict(damping_mode="trace"), ValueError, "damping_mode"),
    (dict(damping_mode=None), ValueError, "damping_mode"),
    (dict(fisher="true"), ValueError, "fisher"),
    (dict(statistics_decay=1.0), ValueError, "statistics_decay"),
    (dict(statistics_decay=-0.1), ValueError, "statistics_decay"),
    (dict(statistics_decay="0.9"), TypeError, "statistics_decay"),
    (dict(statistics_decay=0.9, statistics_frequency=3, frequency=10), ValueError,
     "statistics_frequency"),                                    # does not divide frequency
    (dict(statistics_frequency=2, frequency=10), ValueError, "statistics_frequency"),  # no decay
    (dict(statistics_decay=0.9, statistics_frequency=0), ValueError, "statistics_frequency"),
    (dict(statistics_decay=0.9, statistics_frequency=2.0), TypeError, "statistics_frequency"),
    (dict(kl_clip=0.0), ValueError, "kl_clip"),
    (dict(kl_clip=-1.0), ValueError, "kl_clip"),
    (dict(kl_clip="1e-3"), TypeError, "kl_clip"),
    (dict(trace_thresholds=0.1), TypeError, "trace_thresholds"),
    (dict(trace_thresholds=(0.1,)), TypeError, "trace_thresholds"),
    (dict(trace_thresholds=(0.1, "0.01")), TypeError, "trace_thresholds"),
    (dict(trace_thresholds=(0.01, 0.1)), ValueError, "trace_thresholds"),   # omega2 > omega1
    (dict(trace_thresholds=(0.1, -0.01)), ValueError, "trace_thresholds"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),         # the labels' hash keys are uint64
    (dict(weight_sharing="sum"), ValueError, "weight_sharing"),
    (dict(precondition_inputs="no"), TypeError, "precondition_inputs"),
    (dict(preconditioner="soap"), ValueError, "preconditioner"),
    (dict(cautious=1), TypeError, "cautious"),
    (dict(cautious="attention"), ValueError, "cautious"),
    (dict(eigenbasis_tolerance=0.0), ValueError, "eigenbasis_tolerance"),
    (dict(eigenbasis_tolerance=1.0), ValueError, "eigenbasis_tolerance"),
    (dict(eigenbasis_tolerance="0.01"), TypeError, "eigenbasis_tolerance"),
    (dict(max_rotated_dim=0), ValueError, "max_rotated_dim"),
    (dict(max_rotated_dim=256.0), TypeError, "max_rotated_dim"),
    (dict(max_rotated_dim=256, trace_thresholds=(0.2, 0.1)), ValueError,
     "max_rotated_dim.*trace rule"),
    (dict(statistics_rows=0), ValueError, "statistics_rows"),
    (dict(statistics_rows="512"), TypeError, "statistics_rows"),
    (dict(eigenbasis_exponent=0.0), ValueError, "eigenbasis_exponent"),
    (dict(eigenbasis_exponent=1.5), ValueError, "eigenbasis_exponent"),
    (dict(eigenbasis_exponent="0.75"), TypeError, "eigenbasis_exponent"),
    (dict(eigenbasis_exponent={"conv": 2.0}), ValueError, r"eigenbasis_exponent\['conv'\]"),
    (dict(eigenbasis_exponent={3: 0.75}), TypeError, "eigenbasis_exponent"),
    (dict(eigenbasis_exponent={"conv2d": 0.75}), ValueError, r"eigenbasis_exponent.*'conv2d'"),
    (dict(eigenbasis_exponent={"layer_norm": 0.75}), ValueError, "eigenbasis_exponent"),
])
def test_bad_option_arguments_raise(kwargs, error, argument):
    with pytest.raises(error, match=argument):
        mso.thor(small_model(), 0.1, 0.03, 0.9, **kwargs)


def test_option_defaults_and_config_round_trip():
    model = small_model()
    plain = mso.thor(model, 0.1, 0.03, 0.9, frequency=10)
    options = plain.options
    assert (options.damping_mode, options.statistics_decay, options.statistics_frequency,
            options.fisher, options.kl_clip, options.experimental, options.seed) == (
        "sqrt", None, 10, "empirical", None, mso.thor.Experimental(), None)
    assert plain.get_config()["experimental"] is None
    assert mso.thor(model, 0.1, 0.03, 0.9, frequency=10,
                    statistics_decay=0.9).options.statistics_frequency == 1
    drawn = mso.thor(model, 0.1, 0.03, 0.9, fisher="sampled")
    assert isinstance(drawn.options.seed, int)           # drawn once, then kept in the config
    assert mso.THOR.from_config(drawn.get_config()).options.seed == drawn.options.seed

    optimizer = mso.thor(model, 0.1, 0.03, 0.9, frequency=10, damping_mode="pi",
                         statistics_decay=0.95, statistics_frequency=5, fisher="sampled",
                         kl_clip=1e-3, trace_thresholds=[0.2, 0.01], seed=7,
                         preconditioner="eigenbasis", eigenbasis_exponent={"conv": 0.75},
                         cautious=True)
    config = optimizer.get_config()
    assert config["eigenbasis_exponent"] == {"conv": 0.75} and config["cautious"] is True
    assert plain.get_config()["cautious"] is False
    sequence = mso.thor(model, cautious="sequence")
    assert mso.THOR.from_config(sequence.get_config()).options.cautious == "sequence"
    assert {key: config[key] for key in ("damping_mode", "statistics_decay", "fisher",
                                         "kl_clip", "seed", "experimental")} == dict(
        damping_mode="sqrt", statistics_decay=0.95, fisher="sampled", kl_clip=1e-3, seed=7,
        experimental=dict(trace_thresholds=[0.2, 0.01], statistics_frequency=5,
                          pi_damping=True))
    # The experimental options given by name or as one object are one option.
    assert config == mso.thor(model, 0.1, 0.03, 0.9, frequency=10, statistics_decay=0.95,
                              fisher="sampled", kl_clip=1e-3, seed=7,
                              preconditioner="eigenbasis", eigenbasis_exponent={"conv": 0.75},
                              cautious=True, name=config["name"],
                              experimental=mso.thor.Experimental(
                                  trace_thresholds=(0.2, 0.01), statistics_frequency=5,
                                  pi_damping=True)).get_config()
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(restored) is mso.THOR and restored.get_config() == config
    assert restored.options.experimental.trace_thresholds == (0.2, 0.01)
    # A config written before the namespace, with the options at the top, loads the same.
    flat = {key: value for key, value in config.items() if key != "experimental"}
    flat.update(damping_mode="pi", trace_thresholds=[0.2, 0.01], statistics_frequency=5,
                weight_sharing="mean", precondition_inputs=True)
    assert mso.THOR.from_config(flat).get_config() == config


def test_eigenbasis_exponent_per_layer_kind():
    model = small_model()
    exponent_of = mso.thor(model, eigenbasis_exponent={"conv": 0.75}).preconditioner.exponent_of
    assert [exponent_of(kind) for kind in ("conv", "dense")] == [0.75, 0.5]


def test_damping_changes_no_step_in_a_grafted_eigenbasis():
    """``uses_damping`` is False where no step reads the damping: the same run with damping
    1e-3 and 10 gives the same weights. The trace rule, the LayerNorm rule (without the
    graft) and the inverse read it."""
    def weights(damping, **options):
        model = small_model()
        optimizer = mso.thor(model, **{**mso.thor.DEFAULTS, "damping": damping,
                                       "frequency": 2, **options})
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        model.fit(rng.normal(size=(48, 4)).astype("float32"), rng.integers(0, 3, size=48),
                  batch_size=8, shuffle=False, verbose=0)
        return optimizer, model.get_weights()

    inert, low = weights(1e-3)
    assert not inert.uses_damping
    for got, want in zip(weights(10.0)[1], low):
        np.testing.assert_array_equal(got, want)
    for options in (dict(trace_thresholds=(0.25, 0.12)), dict(graft=None)):
        assert weights(1e-3, **options)[0].uses_damping, options
    acting, low = weights(1e-3, preconditioner="inverse")
    assert acting.uses_damping
    assert any(not np.allclose(got, want)
               for got, want in zip(weights(10.0, preconditioner="inverse")[1], low))


# -- pi damping and the trace rule -------------------------------------------------------------

def test_pi_is_one_when_a_trace_is_zero():
    """Zero inputs (and zero biases): A = 0 in both layers, so pi = 1 and A's inverse is
    I / sqrt(lambda), where pi's formula would divide 0 by 0 (head) or give 0 (fc)."""
    model = small_model()
    optimizer = mso.thor(model, 0.1, 0.04, 0.9, frequency=2, block_size=None,
                         damping_mode="pi")
    model.compile(optimizer=optimizer, loss="mse")
    model.train_on_batch(np.zeros((8, 4), "float32"), np.ones((8, 3), "float32"))
    for inverse in curvature_variables(optimizer, "a_inverse"):
        np.testing.assert_allclose(inverse.numpy()[0], np.eye(inverse.shape[-1]) / 0.2,
                                   rtol=1e-6)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def _damped_trace(x, delta, damping):
    """(tr A + d dim A)(tr G + d dim G) of one Dense layer, mean statistics."""
    a, g = x.T @ x / len(x), delta.T @ delta / len(delta)
    return (np.trace(a) + damping * len(a)) * (np.trace(g) + damping * len(g))


def test_trace_rule_refreshes_reuses_and_freezes():
    """One linear Dense layer, learning rate 0 (the weights stay), mse; inverse steps 0, 2, 4,
    6, 8 see the inputs and targets scaled by 1, 3, 3.1, 3.1, 10: first time (refresh),
    Delta ~ 80 (refresh), Delta ~ 0.14 (reuse), Delta = 0 (freeze), then frozen whatever the
    change. Decisions (2, 1, 2); the traces follow the formula."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc")])
    damping = 0.01
    optimizer = mso.thor(model, 0.0, damping, 0.9, frequency=2, block_size=None,
                         trace_thresholds=(0.5, 0.05))
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
    kernel, bias = (w.astype(np.float64) for w in model.get_weights())
    root = math.sqrt(damping)
    decisions, traces, inverses, expected = [], [], [], []
    for scale in (1.0, 3.0, 3.1, 3.1, 10.0):
        xs, ys = x * np.float32(scale), y * np.float32(scale)
        model.train_on_batch(xs, ys)                          # inverse step
        state = optimizer.curvature["fc"]
        decisions.append(tuple(state.trace_decisions.numpy()))
        traces.append(float(state.trace.numpy()))
        inverses.append(state.g_inverse.numpy().copy())
        delta = 2.0 * (xs @ kernel + bias - ys) / 3           # d(mse)/dz times the batch
        expected.append(_damped_trace(xs.astype(np.float64), delta, root))
        model.train_on_batch(xs, ys)                          # stale step
    np.testing.assert_allclose(traces[:4], expected[:4], rtol=1e-5)
    assert decisions == [(1, 0, 0), (2, 0, 0), (2, 1, 0), (2, 1, 1), (2, 1, 2)]
    assert traces[4] == traces[3]                             # frozen: no new trace either
    assert not np.array_equal(inverses[0], inverses[1])       # refreshed
    for kept in inverses[2:]:                                 # reused, frozen, frozen
        np.testing.assert_array_equal(kept, inverses[1])
    np.testing.assert_array_equal(model.get_weights()[0], kernel.astype("float32"))
    report = optimizer.report()
    assert report.trace_decisions == {"fc": (2, 1, 2)}
    assert "fc: 2 / 1 / 2" in str(report)


# -- weight sharing ----------------------------------------------------------------------------

def sharing_model():
    """A kernel reused at 10 positions (Conv1D), at 5 (Dense on a sequence), at 4 (Embedding)
    and at 1 (Dense)."""
    keras.utils.set_random_seed(0)
    signal, ids = keras.Input((12, 2)), keras.Input((4,), dtype="int32")
    h = keras.layers.Conv1D(3, 3, activation="tanh", name="conv")(signal)          # 10 x 3
    h = keras.layers.Dense(2, activation="tanh", name="per_step")(h[:, :5])       # 5 x 2
    e = keras.layers.Embedding(6, 2, name="emb")(ids)                              # 4 x 2
    h = keras.layers.Concatenate()([keras.layers.Flatten()(h), keras.layers.Flatten()(e)])
    return keras.Model([signal, ids], keras.layers.Dense(3, name="head")(h))


@pytest.mark.parametrize("fisher", ["empirical", "sampled"])
def test_weight_sharing_expand_sums_g_over_each_examples_positions(fisher):
    """``G = sum_rows delta delta^T / examples``: the mean over rows times the positions per
    example, in the statistics and in the inverses; ``A`` and the rows are unchanged."""
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(8, 12, 2)).astype("float32"), rng.integers(0, 6, size=(8, 4))]
    y = rng.integers(0, 3, size=8)
    damping, captured = 0.05, {}
    for sharing in ("mean", "expand"):
        model = sharing_model()
        optimizer = mso.thor(model, 0.1, damping, 0.9, frequency=2, block_size=None,
                             fisher=fisher, seed=0, weight_sharing=sharing)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.train_on_batch(x, y)
        captured[sharing] = ([(s.a.numpy(), s.g.numpy(), s.rows.numpy())
                              for s in optimizer._model_link.connection.statistics],
                             [v.numpy()[0] for v in curvature_variables(optimizer, "g_inverse")])
    positions = [10, 5, 4, 1]       # conv, per_step, emb, head
    for (a, g, rows), (a_mean, g_mean, rows_mean), (inverse, _), count in zip(
            captured["expand"][0], captured["mean"][0],
            zip(captured["expand"][1], captured["mean"][1]), positions):
        np.testing.assert_array_equal(a, a_mean)
        assert rows == rows_mean == 8 * count
        np.testing.assert_allclose(g, g_mean * count, rtol=1e-6)
        want_g = g_mean[0] / 8.0    # sum over rows / examples
        np.testing.assert_allclose(g[0] / rows, want_g, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(inverse, np.linalg.inv(
            want_g + math.sqrt(damping) * np.eye(len(want_g))), rtol=1e-4, atol=1e-5)


# -- sampled Fisher ----------------------------------------------------------------------------

def _np_mix(z):
    """splitmix64's finaliser in NumPy (uint64 products wrap)."""
    z = np.asarray(z, np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def reference_uniform(shape, seed, step, offset=0):
    """NumPy reference of the sampled Fisher's uniforms: key = mix(mix(mix(seed) ^ step) ^ 0),
    element i = (top 24 bits of mix(key + (offset + i + 1) * golden) + 1/2) / 2**24."""
    key = np.uint64(0)
    for word in (seed, step, 0):
        key = _np_mix(key ^ np.uint64(word))
    with np.errstate(over="ignore"):
        counters = np.arange(offset + 1, offset + math.prod(shape) + 1, dtype=np.uint64)
        bits = _np_mix(key + counters * np.uint64(0x9E3779B97F4A7C15))
    return ((bits >> np.uint64(40)).astype(np.float64) + 0.5).reshape(shape) / 2.0**24


def sampled_labels(kind, from_logits, outputs, seed, step):
    """NumPy: the labels THOR's sampled Fisher draws from ``outputs`` (the global batch) at
    ``step``: the Gumbel-max of the logits, or ``u < p``, with :func:`reference_uniform`."""
    outputs = np.asarray(outputs, np.float64)
    u = reference_uniform(outputs.shape, seed, step)
    if kind == "categorical":
        logits = outputs if from_logits else np.log(np.clip(outputs, keras.config.epsilon(), 1))
        return np.argmax(logits - np.log(-np.log(u)), axis=-1)
    probabilities = 1.0 / (1.0 + np.exp(-outputs)) if from_logits else outputs
    return u < probabilities


@pytest.mark.parametrize("xla", [False, True], ids=["plain", "XLA"])
def test_sampled_uniforms_match_numpy_bit_for_bit(xla):
    """The hash gives NumPy's bits exactly, compiled by XLA or not, from any offset, and its
    uniforms are uniform (a 0.25 quantile and mean within 3 standard errors)."""
    from tf_msopt.thor.sampled_fisher import stream_key, uniform
    step = tf.Variable(12345, dtype=tf.int64)
    draw = tf.function(lambda offset: uniform(tf.constant([1000, 7]),
                                              stream_key(2**64 - 1, step, 0), offset),
                       jit_compile=xla)
    got = draw(tf.constant(0, tf.int64)).numpy()
    want = reference_uniform((2000, 7), 2**64 - 1, 12345).astype(np.float32)
    np.testing.assert_array_equal(got, want[:1000])
    np.testing.assert_array_equal(draw(tf.constant(7000, tf.int64)).numpy(), want[1000:])
    assert 0.0 < got.min() and got.max() < 1.0
    n = got.size
    assert abs(got.mean() - 0.5) < 3 * math.sqrt(1 / 12 / n)
    assert abs((got < 0.25).mean() - 0.25) < 3 * math.sqrt(0.25 * 0.75 / n)


def sampled_statistics(model, x, kind, labels):
    """NumPy (float64): ``[(A, G)]`` of the two Dense layers of :func:`small_model` with
    ``delta = d(sum -log p(labels|x))/dz`` (the pre-activation outputs)."""
    (w1, b1), (w2, b2) = [[w.astype(np.float64) for w in layer.get_weights()]
                          for layer in model.layers]
    x = x.astype(np.float64)
    h = np.tanh(x @ w1 + b1)
    z = h @ w2 + b2
    if kind == "categorical":
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        delta2 = p - np.eye(z.shape[-1])[labels]
    else:
        delta2 = 1.0 / (1.0 + np.exp(-z)) - labels
    delta1 = delta2 @ w2.T * (1.0 - h * h)
    return [(v.T @ v / len(v), d.T @ d / len(d)) for v, d in ((x, delta1), (h, delta2))]


def connected_statistics(optimizer):
    """The mean statistics THOR captured this step: ``[(A, G)]`` (one block each)."""
    return [(s.a.numpy()[0] / s.rows.numpy(), s.g.numpy()[0] / s.rows.numpy())
            for s in optimizer._model_link.connection.statistics]


SAMPLED_CASES = {
    "sparse_logits": (None, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      "categorical", True),
    "categorical_probabilities": ("softmax", "categorical_crossentropy", "categorical", False),
    "binary_logits": (None, keras.losses.BinaryCrossentropy(from_logits=True), "bernoulli",
                      True),
    "binary_probabilities": ("sigmoid", keras.losses.binary_crossentropy, "bernoulli", False),
}


@pytest.mark.parametrize("case", SAMPLED_CASES.keys())
def test_sampled_g_matches_numpy(case):
    """One step: G from the labels sampled off the model's own outputs, A as always; the
    inverses of this step are those of the sampled statistics."""
    activation, loss, kind, from_logits = SAMPLED_CASES[case]
    model = small_model(activation)
    damping, seed = 0.04, 11
    optimizer = mso.thor(model, 0.1, damping, 0.9, frequency=2, block_size=None,
                         fisher="sampled", seed=seed)
    model.compile(optimizer=optimizer, loss=loss)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype("float32")
    classes = rng.integers(0, 3, size=16)
    y = {"sparse_logits": classes, "categorical_probabilities": np.eye(3)[classes]}.get(
        case, rng.integers(0, 2, size=(16, 3))).astype("float32")
    labels = sampled_labels(kind, from_logits, model(x), seed, step=0)
    want = sampled_statistics(model, x, kind, labels)
    empirical = sampled_statistics(model, x, kind, y if kind == "bernoulli" else classes)
    model.train_on_batch(x, y)
    for (a, g), (want_a, want_g), (_, empirical_g) in zip(
            connected_statistics(optimizer), want, empirical):
        np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-6)
        assert not np.allclose(g, empirical_g, rtol=1e-2)      # not the training loss's G
    for inverse, (_, want_g) in zip(curvature_variables(optimizer, "g_inverse"), want):
        np.testing.assert_allclose(inverse.numpy()[0],
                                   np.linalg.inv(want_g + math.sqrt(damping)
                                                 * np.eye(len(want_g))),
                                   rtol=1e-4, atol=1e-5)


def _sampled_run(seed, steps=3, options=None, xla=False):
    model = small_model()
    optimizer = mso.thor(model, 0.1, 0.04, 0.9, frequency=2, block_size=None,
                         fisher="sampled", seed=seed, **(options or {}))
    model.compile(optimizer=optimizer, jit_compile=xla,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(2)
    for _ in range(steps):
        model.train_on_batch(rng.normal(size=(16, 4)).astype("float32"),
                             rng.integers(0, 3, size=16))
    return model.get_weights(), [g for _, g in connected_statistics(optimizer)]


def test_sampled_fisher_is_reproducible_with_a_seed():
    """Same seed: identical runs (statistics and weights), and an XLA-compiled train step
    draws the same labels as a plain one (it agrees to rounding); another seed: other
    labels."""
    first, second, other = (_sampled_run(seed) for seed in (3, 3, 4))
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        np.testing.assert_array_equal(a, b)
    assert not any(np.allclose(a, b) for a, b in zip(first[1], other[1]))
    assert not np.allclose(first[0][0], other[0][0])
    compiled = _sampled_run(3, xla=True)
    for a, b in zip(first[0] + first[1], compiled[0] + compiled[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sampled_fisher_needs_a_distribution():
    """A loss without an output distribution raises, naming the supported ones; a custom loop
    without set_fisher_loss raises, naming it."""
    model = small_model()
    optimizer = mso.thor(model, 0.1, 0.04, 0.9, frequency=2, fisher="sampled", seed=0)
    model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError, match="sparse_categorical_crossentropy.*binary_crossentropy"):
        model.train_on_batch(np.ones((4, 4), "float32"), np.ones((4, 3), "float32"))
    for loss in ("mse", keras.losses.Huber(), lambda y, p: p, 3):
        with pytest.raises(ValueError, match="fisher='empirical'"):
            output_distribution(loss)
    assert output_distribution(keras.losses.CategoricalCrossentropy(from_logits=True)) == (
        output_distribution(keras.losses.SparseCategoricalCrossentropy(from_logits=True)))

    model = small_model()
    optimizer = mso.thor(model, 0.1, 0.04, 0.9, frequency=2, fisher="sampled", seed=0)
    optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match="set_fisher_loss"), tf.GradientTape():
        model(np.ones((4, 4), "float32"), training=True)     # a custom loop's forward pass


def test_sampled_fisher_in_a_custom_loop():
    """set_fisher_loss gives the distribution; G as in NumPy from the same labels."""
    model = small_model()
    seed = 5
    optimizer = mso.thor(model, 0.1, 0.04, 0.9, frequency=2, block_size=None,
                         fisher="sampled", seed=seed)
    assert optimizer.set_fisher_loss(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)) is optimizer
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, size=8)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                                from_logits=True)
            loss = tf.reduce_mean(loss)
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)

    labels = sampled_labels("categorical", True, model(x), seed, step=0)
    want = sampled_statistics(model, x, "categorical", labels)
    step(x, y)
    for (a, g), (want_a, want_g) in zip(connected_statistics(optimizer), want):
        np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-6)
    step(x, y)
    assert int(optimizer.iterations.numpy()) == 2


def test_non_finite_statistics_or_outputs_are_not_recorded():
    """Overflowing statistics with finite gradients (one huge input feature saturates tanh):
    that layer's statistics count as unobserved (its averages and count stay), the next
    layer's are recorded. Non-finite outputs (a NaN input) inside a LossScaleOptimizer, which
    skips that update: nothing recorded, nothing NaN."""
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, size=8)
    overflow, poisoned = x.copy(), x.copy()
    overflow[0] = [1e30, 0.0, 0.0, 0.0]          # fc's A = x x^T overflows; tanh saturates
    poisoned[0, 0] = np.nan                      # every output of that row is NaN
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    scaled = lambda o: mso.LossScaleOptimizer(o, mso.DynamicLossScaleManager(  # noqa: E731
        2.0 ** 8, 2, 100))
    for wrap, bad, counts, steps in ((None, overflow, [2.0, 4.0], 4),
                                     (scaled, poisoned, [2.0, 2.0], 2)):
        model = small_model()
        optimizer = mso.thor(model, 0.1, 0.04, 0.9, frequency=2, block_size=None,
                             fisher="sampled", seed=0, statistics_decay=0.5)
        model.compile(optimizer=optimizer if wrap is None else wrap(optimizer), loss=loss)
        model.train_on_batch(x, y)                   # statistics step 0
        fc = optimizer.curvature["fc"]
        fc_averages = [fc.a_average.numpy(), fc.g_average.numpy()]
        model.train_on_batch(bad, y)
        np.testing.assert_array_equal(fc_averages[0], fc.a_average.numpy())
        np.testing.assert_array_equal(fc_averages[1], fc.g_average.numpy())
        model.train_on_batch(x, y)
        model.train_on_batch(bad, y)
        assert [float(c.numpy()) for c in curvature_variables(optimizer, "count")] == counts
        assert int(optimizer.iterations.numpy()) == steps
        for variable in optimizer.variables + model.weights:
            assert np.all(np.isfinite(variable.numpy())), variable.path
        for statistics in optimizer._model_link.connection.statistics:
            for buffer in (statistics.a, statistics.g, statistics.rows):
                assert np.all(np.isfinite(buffer.numpy()))
        keras.backend.clear_session(free_memory=False)


@pytest.mark.parametrize("make_layer, input_shape, projects", [
    (lambda: keras.layers.Dense(3), (None, 4), False),
    (lambda: keras.layers.Dense(3), (None, 5, 4), True),
    (lambda: keras.layers.EinsumDense("ab,bc->ac", (3,)), (None, 4), False),
    (lambda: keras.layers.EinsumDense("abc,bcd->ad", (3,)), (None, 5, 4), False),  # sums them
    (lambda: keras.layers.EinsumDense("abc,cd->abd", (5, 3)), (None, 5, 4), True),
    (lambda: keras.layers.EinsumDense("abcd,cde->abe", (5, 3)), (None, 5, 2, 4), True),
    (lambda: keras.layers.EinsumDense("...b,bc->...c", (3,)), (None, 5, 4), True),
    (lambda: keras.layers.Conv1D(3, 2), (None, 5, 4), False),     # slides, is not masked
], ids=["dense", "dense_sequence", "einsum", "einsum_over_positions", "einsum_sequence",
        "attention_output", "einsum_ellipsis", "conv1d"])
def test_projections_over_positions(make_layer, input_shape, projects):
    """The kernels ``cautious="sequence"`` masks: a Dense or EinsumDense applied at each
    position of an example, read off the input the layer was built for."""
    layer = make_layer()
    layer.build(input_shape)
    (block,), _, _ = blocks_for(layer)
    assert block.projects_positions(layer) is projects


# -- MirroredStrategy, save/resume, loss scaling with the options on ---------------------------

#: Every option on; the empirical variant sparser statistics (steps 0, 2, 4; inverses at 0, 4).
SAMPLED_ALL = dict(damping_mode="pi", statistics_decay=0.8, kl_clip=1e-3,
                   trace_thresholds=(0.3, 0.05), fisher="sampled", seed=3,
                   weight_sharing="expand", precondition_inputs=False)
EMPIRICAL_ALL = dict(damping_mode="pi", statistics_decay=0.8, statistics_frequency=2,
                     frequency=4, kl_clip=1e-3, trace_thresholds=(0.3, 0.05),
                     weight_sharing="expand")
#: The default's levers (Adam grafting, relative damping) with the other options on; with
#: the inverses, the cautious mask too.
GRAFTED = dict(EMPIRICAL_ALL, graft="adam", damping_mode="relative")
GRAFTED_ALL = dict(GRAFTED, cautious=True)
#: The same in the factors' eigenbases (the trace rule still decides the refreshes), the
#: convolution and the embedding with exponents other than Adam's, and the default's cautious
#: mask on the projections over positions (the token Dense of :func:`options_model`).
EIGENBASIS_ALL = dict(GRAFTED, preconditioner="eigenbasis",
                      eigenbasis_exponent={"conv": 0.75, "embedding": 1.0}, cautious="sequence")
ALL = {"empirical": EMPIRICAL_ALL, "sampled": SAMPLED_ALL, "grafted": GRAFTED_ALL,
       "eigenbasis": EIGENBASIS_ALL}


def classification_data(n, seed=0):
    rng = np.random.default_rng(seed)
    return ([rng.normal(size=(n, 6, 6, 1)).astype("float32"),
             rng.integers(0, 7, size=(n, 3)).astype("int32")],
            rng.integers(0, 2, size=n).astype("int32"))


def options_model(options):
    """mixed_model without attention (Conv2D, Embedding, LayerNorm, Dense) with two logits;
    with a Dense on each token where ``options`` mask the projections over positions."""
    return mixed_model(attention=False, token_projection=options.get("cautious") == "sequence")


def make_mixed(options, wrap=None):
    """:func:`options_model` compiled with THOR(``options``), optionally wrapped."""
    model = options_model(options)
    options = dict(dict(frequency=2), **options)
    optimizer = mso.thor(model, 0.05, 0.05, 0.9, block_size=4, weight_decay=1e-3, **options)
    model.compile(optimizer=optimizer if wrap is None else wrap(optimizer),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, optimizer


def train_steps(model, first, count, batch=8):
    x, y = classification_data(8 * batch)
    for i in range(first, first + count):
        rows = slice(batch * i, batch * (i + 1))
        model.train_on_batch([x[0][rows], x[1][rows]], y[rows])


def option_state(optimizer):
    """The options' optimizer variables, by name (paths change inside a wrapper);
    eigenvectors up to their signs, which the steps do not depend on."""
    variables = curvature_variables(optimizer, "a_average", "g_average", "count", "trace",
                                    "trace_decisions", "rotated_second_moment")
    variables.append(optimizer.kl_factor)
    if optimizer.options.graft:
        variables += optimizer._step.graft.second_moments
    state = {v.name: v.numpy() for v in variables}
    state.update({v.name: np.abs(v.numpy())
                  for v in curvature_variables(optimizer, "a_eigenvectors", "g_eigenvectors")})
    return state


def assert_states_close(got, want, rtol):
    """Option states equal; eigenvectors (unit vectors from float32 ``eigh``, whose rounding
    depends on the summation order of the statistics) to 1e-5."""
    for name, value in want.items():
        atol = 1e-5 if "eigenvectors" in name else 1e-7
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("options", ALL.values(), ids=ALL.keys())
@pytest.mark.equivalence
def test_two_replicas_equal_one_device(two_cpu_strategy, options):
    """Every option under a LossScaleOptimizer: two replicas on 16 examples per step equal
    one device (the sampled Fisher's replicas draw what one device draws)."""
    def train(strategy):
        with strategy.scope():
            model, optimizer = make_mixed(options, wrap=lambda o: mso.LossScaleOptimizer(
                o, 2.0 ** 8))
        x, y = classification_data(16 * 6)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model.get_weights(), option_state(optimizer), optimizer

    single, single_state, _ = train(tf.distribute.get_strategy())
    keras.backend.clear_session(free_memory=False)
    mirrored, mirrored_state, optimizer = train(two_cpu_strategy)
    assert_weights_close(mirrored, single, rtol=1e-5)
    assert_states_close(mirrored_state, single_state, rtol=1e-5)
    for variable in (curvature_variables(optimizer, "a_average", "g_inverse", "g_eigenvectors")
                     + [optimizer.kl_factor]):
        first, second = (v.numpy() for v in variable.value.values)
        np.testing.assert_array_equal(first, second)
    assert any(counts[1] + counts[2] for counts in mirrored_state.values()
               if counts.dtype == np.int64)          # the trace rule kept some inverses


@pytest.mark.equivalence
def test_sampled_fisher_with_two_replicas(two_cpu_strategy):
    """The replicas draw the labels one device draws on the global batch (each counts its
    elements from its share's offset); G is the sum over both replicas' rows, as NumPy
    computes it from the same labels."""
    seed, damping = 9, 0.04
    with two_cpu_strategy.scope():
        model = small_model()
        optimizer = mso.thor(model, 0.1, damping, 0.9, frequency=2, block_size=None,
                             fisher="sampled", seed=seed)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.integers(0, 3, size=16)
    logits = model(x).numpy()
    labels = sampled_labels("categorical", True, logits, seed, step=0)
    want = sampled_statistics(model, x, "categorical", labels)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for variable, (_, want_g) in zip(curvature_variables(optimizer, "g_inverse"), want):
        for inverse in variable.value.values:
            np.testing.assert_allclose(inverse.numpy()[0], np.linalg.inv(
                want_g + math.sqrt(damping) * np.eye(len(want_g))), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", ALL.values(), ids=ALL.keys())
@pytest.mark.equivalence
def test_save_load_resumes_exactly(tmp_path, options):
    """Saved at a step between statistics/inverse steps, loaded and connected: the option
    state is restored and training goes on exactly as without the interruption."""
    model, optimizer = make_mixed(options)
    train_steps(model, 0, 3)
    path = str(tmp_path / "thor.keras")
    model.save(path)
    state = option_state(optimizer)
    loaded = keras.models.load_model(path, safe_mode=True)
    restored = mso.thor.connect(loaded)
    assert restored.get_config() == optimizer.get_config()
    for name, value in option_state(restored).items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    train_steps(model, 3, 5)
    train_steps(loaded, 3, 5)
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    for name, value in option_state(restored).items():
        np.testing.assert_array_equal(value, option_state(optimizer)[name], err_msg=name)


@pytest.mark.parametrize("options", ALL.values(), ids=ALL.keys())
@pytest.mark.equivalence
def test_xla_update_equals_plain(options):
    """Every option on: ``jit_compile=True`` (the KL-clipped update of all variables as one
    XLA function) and an XLA-compiled train step give what the plain graph gives; with the
    sampled Fisher too, since its labels are the same under XLA."""
    def run(jit_compile=False, xla_step=False):
        keras.utils.set_random_seed(0)
        model = options_model(options)
        optimizer = mso.thor(model, 0.05, 0.05, 0.9, block_size=4, weight_decay=1e-3,
                             jit_compile=jit_compile, **options)
        model.compile(optimizer=optimizer, jit_compile=xla_step,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        train_steps(model, 0, 5)
        return model.get_weights(), option_state(optimizer)

    plain_weights, plain_state = run()
    assert plain_state["kl_factor"] < 1.0            # the clip is active
    # Adam's step g / (sqrt(v) + eps) turns the last-bit differences of XLA's fused gradient
    # in near-zero entries into larger relative ones (Keras' Adam does the same).
    rtol = 1e-4 if options.get("graft") else 1e-5
    for weights, state in (run(jit_compile=True), run(xla_step=True)):
        assert_weights_close(weights, plain_weights, rtol=rtol)
        assert_states_close(state, plain_state, rtol=rtol)


def _mso_dynamic(optimizer):
    return mso.LossScaleOptimizer(optimizer, mso.DynamicLossScaleManager(2.0 ** 12, 2, 3))


def _keras_dynamic(optimizer):
    return keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 10,
                                               dynamic_growth_steps=2)


@pytest.mark.parametrize("options, wrappers", [
    (EMPIRICAL_ALL, (_mso_dynamic, _keras_dynamic)),
    (SAMPLED_ALL, (_mso_dynamic,)),         # the sampled G never carries the scale
    (GRAFTED_ALL, (_mso_dynamic, _keras_dynamic)),
    (EIGENBASIS_ALL, (_mso_dynamic, _keras_dynamic)),
], ids=["empirical", "sampled", "grafted", "eigenbasis"])
@pytest.mark.equivalence
def test_loss_scale_optimizers_leave_g_unscaled(options, wrappers):
    """Inside tf_msopt's and Keras' LossScaleOptimizer (dynamic scales): the same averaged G,
    KL factor, trace decisions and weights as without loss scaling."""
    def run(wrap=None):
        model, optimizer = make_mixed(options, wrap)
        train_steps(model, 0, 6)
        keras.backend.clear_session(free_memory=False)
        return model.get_weights(), option_state(optimizer)

    plain, plain_state = run()
    for wrap in wrappers:
        weights, state = run(wrap)
        assert_weights_close(weights, plain, rtol=1e-5)
        assert_states_close(state, plain_state, rtol=1e-5)


def test_statistics_rows_counts_every_channel_of_a_depthwise_layer():
    """A depthwise layer's output holds each channel's outputs side by side: 8 examples of
    2 x 2 positions and 3 channels, ``statistics_rows=8`` keeps every 4th example (8 rows),
    not every 12th."""
    model = keras.Sequential([keras.Input((6, 6, 3)),
                              keras.layers.DepthwiseConv2D(3, strides=2, name="depthwise"),
                              keras.layers.Flatten(), keras.layers.Dense(2, name="head")])
    optimizer = mso.thor(model, statistics_rows=8)
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    model.train_on_batch(rng.normal(size=(8, 6, 6, 3)).astype("float32"),
                         rng.normal(size=(8, 2)).astype("float32"))
    rows = {buffer.block.layer: float(buffer.rows.numpy())
            for buffer in optimizer._model_link.connection.statistics}
    assert rows == {"depthwise": 8.0, "head": 8.0}
