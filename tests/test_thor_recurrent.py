"""THOR on recurrent layers: SimpleRNN, GRU and LSTM kernels as curvature blocks.

NumPy runs each layer's recurrence forward and back (float64) for the statistics and the
preconditioned step; the default configuration is checked under MirroredStrategy, a
LossScaleOptimizer, XLA and save/resume.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf
from test_thor_training import assert_weights_close

import tf_msopt as mso

BATCH, STEPS, FEATURES, UNITS = 4, 3, 2, 3
KINDS = ("SimpleRNN", "GRU", "LSTM")


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def recurrence(kind, x, kernel, recurrent_kernel, bias, go_backwards, mask=None):
    """Forward pass of a Keras recurrent layer (tanh, sigmoid gates; a GRU with
    ``reset_after``); a masked step keeps the states. Returns the last state and each step's
    cache, in the order the steps run."""
    mask = np.ones(x.shape[:2], bool) if mask is None else mask
    if go_backwards:
        x, mask = x[:, ::-1], mask[:, ::-1]
    h, c, caches = np.zeros((len(x), UNITS)), np.zeros((len(x), UNITS)), []
    input_bias, recurrent_bias = (bias[0], bias[1]) if kind == "GRU" else (bias, 0.0)
    for t in range(x.shape[1]):
        p = x[:, t] @ kernel + input_bias
        inner = h @ recurrent_kernel + recurrent_bias
        cache = dict(x=x[:, t], h=h, c=c, inner=inner, keep=mask[:, t, None])
        if kind == "SimpleRNN":
            new = cache["out"] = np.tanh(p + inner)
        elif kind == "GRU":
            z, r = (sigmoid(p[:, i * UNITS:(i + 1) * UNITS] + inner[:, i * UNITS:(i + 1) * UNITS])
                    for i in range(2))
            candidate = np.tanh(p[:, 2 * UNITS:] + r * inner[:, 2 * UNITS:])
            cache.update(z=z, r=r, candidate=candidate)
            new = z * h + (1 - z) * candidate
        else:
            i, f, o = (sigmoid(p[:, k * UNITS:(k + 1) * UNITS] + inner[:, k * UNITS:(k + 1) * UNITS])
                       for k in (0, 1, 3))
            g = np.tanh(p[:, 2 * UNITS:3 * UNITS] + inner[:, 2 * UNITS:3 * UNITS])
            cache.update(i=i, f=f, g=g, o=o, c_new=f * c + i * g)
            new = o * np.tanh(cache["c_new"])
            c = np.where(cache["keep"], cache["c_new"], c)
        h = np.where(cache["keep"], new, h)
        caches.append(cache)
    return h, caches


def backward(kind, caches, dh, recurrent_kernel):
    """Back through time from the last state's gradient ``dh``: for each step that counts
    the rows ``(x_t, h_{t-1})``, the gradients of the gate pre-activations on the input side
    (``delta``) and on the recurrent kernel's side (a GRU's candidate: ``r * delta``) and the
    example of each row; and the kernels' gradients. A masked step passes ``dh`` (and an
    LSTM's carry gradient) back unchanged."""
    dc = np.zeros_like(dh)
    rows = []
    for cache in reversed(caches):
        keep = cache["keep"]
        held, held_carry, dh = dh * ~keep, dc * ~keep, dh * keep
        if kind == "SimpleRNN":
            delta = dh * (1 - cache["out"] ** 2)
            recurrent_delta = delta
        elif kind == "GRU":
            z, r, candidate, h = cache["z"], cache["r"], cache["candidate"], cache["h"]
            d_candidate = dh * (1 - z) * (1 - candidate ** 2)
            d_z = dh * (h - candidate) * z * (1 - z)
            d_r = d_candidate * cache["inner"][:, 2 * UNITS:] * r * (1 - r)
            delta = np.concatenate([d_z, d_r, d_candidate], 1)
            recurrent_delta = np.concatenate([d_z, d_r, r * d_candidate], 1)
        else:
            i, f, g, o, c_new = (cache[k] for k in ("i", "f", "g", "o", "c_new"))
            dc = dc * keep + dh * o * (1 - np.tanh(c_new) ** 2)
            delta = np.concatenate([dc * g * i * (1 - i), dc * cache["c"] * f * (1 - f),
                                    dc * i * (1 - g ** 2), dh * np.tanh(c_new) * o * (1 - o)], 1)
            dc = dc * f + held_carry
            recurrent_delta = delta
        dh = (recurrent_delta @ recurrent_kernel.T + (dh * cache["z"] if kind == "GRU" else 0.0)
              + held)
        counted = keep[:, 0]
        rows.append((cache["x"][counted], cache["h"][counted], delta[counted],
                     recurrent_delta[counted], np.flatnonzero(counted)))
    x, h, delta, recurrent_delta, examples = (np.concatenate(parts) for parts in zip(*rows))
    return x, h, delta, recurrent_delta, examples, x.T @ delta, h.T @ recurrent_delta


def recurrent_model(kind, go_backwards=False, seed=0, masked=False):
    """Dense(2) on a recurrent layer's last output; ``masked``: steps of zeros masked."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((STEPS, FEATURES))
    hidden = keras.layers.Masking()(inputs) if masked else inputs
    layer = getattr(keras.layers, kind)(UNITS, go_backwards=go_backwards, name="rnn")
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(layer(hidden)))


#: Which steps of a batch count in the masked runs: a sequence padded at its end, one at
#: its start, one with a gap and a whole one.
MASK = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]], bool)


def data(seed=0, batches=1, masked=False):
    """Inputs and targets; ``masked``: the steps ``MASK`` leaves out are zeros."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH * batches, STEPS, FEATURES)).astype("float32")
    if masked:
        x *= np.tile(MASK, (batches, 1))[:, :, None]
    return x, rng.normal(size=(BATCH * batches, 2)).astype("float32")


#: Six batches of 8 for the default configuration's runs.
X, Y = data(seed=1, batches=12)
X_MASKED, _ = data(seed=1, batches=12, masked=True)


@pytest.mark.parametrize("masked,statistics_rows", [(False, None), (True, None), (True, 6)],
                         ids=["whole", "masked", "masked-subsampled"])
@pytest.mark.parametrize("go_backwards", [False, True], ids=["forward", "backwards"])
@pytest.mark.parametrize("kind", KINDS)
def test_statistics_and_step_match_numpy(kind, go_backwards, masked, statistics_rows):
    """MindSpore's THOR step on a recurrent layer's two kernels: ``A^-1 g G^-1`` with
    ``A = E[x x^T]`` (input kernel) or ``E[h_{t-1} h_{t-1}^T]`` (recurrent kernel) and ``G``
    of the gate pre-activations' gradients, rows over examples and the time steps that
    count (masked ones do not). ``statistics_rows=6`` of 12 steps: examples 0 and 2."""
    learning_rate, damping = 0.1, 0.04
    model = recurrent_model(kind, go_backwards, masked=masked)
    layer, head = model.get_layer("rnn"), model.get_layer("head")
    kernel, recurrent_kernel, bias = (w.numpy().astype(np.float64) for w in layer.weights)
    head_kernel, head_bias = (w.numpy().astype(np.float64) for w in head.weights)
    optimizer = mso.thor(model, learning_rate, damping, 0.9, block_size=None,
                         statistics_rows=statistics_rows)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = data(masked=masked)

    state, caches = recurrence(kind, x.astype(np.float64), kernel, recurrent_kernel, bias,
                               go_backwards, MASK if masked else None)
    d_out = 2.0 * (state @ head_kernel + head_bias - y) / y.size
    rows_x, rows_h, delta, recurrent_delta, examples, g_kernel, g_recurrent = backward(
        kind, caches, d_out @ head_kernel.T, recurrent_kernel)
    sampled = examples % 2 == 0 if statistics_rows else slice(None)
    root = np.sqrt(damping)

    def inverse(rows, scale=1.0):
        rows = rows * scale
        return np.linalg.inv(rows.T @ rows / len(rows) + root * np.eye(rows.shape[1]))

    model.train_on_batch(x, y)
    for name, rows, deltas, gradient, weight in (
            ("kernel", rows_x, delta, g_kernel, kernel),
            ("recurrent_kernel", rows_h, recurrent_delta, g_recurrent, recurrent_kernel)):
        state = optimizer.curvature[f"rnn_{name}"]
        a_inverse, g_inverse = inverse(rows[sampled]), inverse(deltas[sampled], BATCH)
        np.testing.assert_allclose(state.a_inverse.numpy()[0], a_inverse, rtol=1e-4,
                                   atol=1e-5, err_msg=name)
        np.testing.assert_allclose(state.g_inverse.numpy()[0], g_inverse, rtol=1e-4,
                                   atol=1e-5, err_msg=name)
        want = weight - learning_rate * a_inverse @ gradient @ g_inverse
        got = layer.cell.kernel if name == "kernel" else layer.cell.recurrent_kernel
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("options", [
    {}, {"masked": True}, {"masked": True, "go_backwards": True},
    {"masked": True, "zero_output_for_mask": True}], ids=["whole", "masked", "masked-backwards",
                                                        "masked-zero-output"])
@pytest.mark.parametrize("kind", KINDS)
def test_capture_keeps_the_layers_outputs_and_gradients(kind, options):
    """The capture's recurrence is Keras' own: the same outputs and gradients as the layer
    without THOR, states returned as Keras returns them, masked steps treated as Keras'
    loop treats them."""
    options = dict(options)
    masked = options.pop("masked", False)
    x, y = data(masked=masked)
    inputs = keras.Input((STEPS, FEATURES))
    outputs = getattr(keras.layers, kind)(UNITS, return_sequences=True, return_state=True,
                                          name="rnn", **options)(
        keras.layers.Masking()(inputs) if masked else inputs)
    model = keras.Model(inputs, outputs)

    def run():
        with tf.GradientTape() as tape:
            results = model(x, training=True)
            loss = sum(tf.reduce_sum(tf.square(r)) for r in results)
        return [r.numpy() for r in results], [
            g.numpy() for g in tape.gradient(loss, model.trainable_variables)]

    want = run()
    mso.thor(model)
    got = run()
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_report_lists_both_kernels_and_refusals():
    inputs = keras.Input((STEPS, FEATURES))
    hidden = keras.layers.Bidirectional(keras.layers.LSTM(UNITS, return_sequences=True))(inputs)
    hidden = keras.layers.GRU(UNITS, dropout=0.1, return_sequences=True, name="dropped")(hidden)
    hidden = keras.layers.GRU(UNITS, reset_after=False, name="reset_before")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    rows = {row.variable: row for row in mso.thor(model).report().rows}
    for direction in ("forward", "backward"):
        assert rows[f"bidirectional/{direction}_lstm/lstm_cell/kernel"].rule.startswith(
            "input kernel: Kronecker")
        assert rows[f"bidirectional/{direction}_lstm/lstm_cell/recurrent_kernel"].rule.startswith(
            "recurrent kernel: Kronecker")
        assert rows[f"bidirectional/{direction}_lstm/lstm_cell/bias"].rule == "first order"
    assert "dropout inside the recurrence" in rows["dropped/gru_cell/kernel"].reason
    assert "reset_after=False" in rows["reset_before/gru_cell/recurrent_kernel"].reason
    assert len(rows) == len(model.trainable_variables)




def default_run(kind, steps=6, strategy=None, wrap=None, masked=False, **compile_options):
    """The default THOR (refresh every 2 steps) on a recurrent model; weights and THOR's
    state after ``steps`` batches of 8 (``masked``: with ``MASK``'s steps masked)."""
    with (strategy or tf.distribute.get_strategy()).scope():
        model = recurrent_model(kind, masked=masked)
        optimizer = mso.thor(model, frequency=2)
        model.compile(optimizer=optimizer if wrap is None else wrap(optimizer), loss="mse",
                      **compile_options)
    x = X_MASKED if masked else X
    model.fit(x[:8 * steps], Y[:8 * steps], batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model, optimizer


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.equivalence
def test_default_two_replicas_under_loss_scaling_equal_one_device(two_cpu_strategy, kind):
    """The default configuration inside a LossScaleOptimizer: two replicas on the global
    batch equal one device, and both equal the unscaled run."""
    plain, _ = default_run(kind)
    scaled, _ = default_run(kind, wrap=lambda o: mso.LossScaleOptimizer(o, 2.0 ** 8))
    mirrored, optimizer = default_run(kind, strategy=two_cpu_strategy,
                                      wrap=lambda o: mso.LossScaleOptimizer(o, 2.0 ** 8))
    assert optimizer.curvature["rnn_recurrent_kernel"].count.numpy() == 6
    assert_weights_close(scaled.get_weights(), plain.get_weights(), rtol=1e-5)
    assert_weights_close(mirrored.get_weights(), plain.get_weights(), rtol=1e-5)


@pytest.mark.equivalence
def test_default_masked_sequences_two_replicas_and_xla_equal_one_device(two_cpu_strategy):
    """Masked sequences in the default configuration: two replicas on the global batch, and
    an XLA-compiled step, equal one device."""
    plain, _ = default_run("GRU", masked=True)
    mirrored, _ = default_run("GRU", strategy=two_cpu_strategy, masked=True)
    compiled, _ = default_run("GRU", masked=True, jit_compile=True)
    assert_weights_close(mirrored.get_weights(), plain.get_weights(), rtol=1e-5)
    assert_weights_close(compiled.get_weights(), plain.get_weights(), rtol=1e-5)


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.equivalence
def test_default_xla_train_step_equals_plain(kind):
    plain, _ = default_run(kind)
    compiled, _ = default_run(kind, jit_compile=True)
    assert_weights_close(compiled.get_weights(), plain.get_weights(), rtol=1e-5)


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.equivalence
def test_default_resumes_exactly(tmp_path, kind):
    """Saved after 3 steps, loaded, connected and trained 3 more: the weights and THOR's
    state of 6 uninterrupted steps, bit for bit."""
    whole, _ = default_run(kind)
    model, _ = default_run(kind, steps=3)
    path = str(tmp_path / "rnn.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    mso.thor.connect(loaded)
    loaded.fit(X[24:], Y[24:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(loaded.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(loaded.optimizer.variables, whole.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)
