"""Loss scaling: update cells, managers, argument checks, the optimizer's update rule and bounds.

Golden numbers are MindSpore 2.10's (its update cells and managers, run on CPU).
"""
import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from tf_msopt.loss_scale import LossScaleMonitor

FLOAT32_MAX = float(np.finfo(np.float32).max)

# case: (init, factor, window, overflow flags, scale after each call, last_overflow_iter after each)
GOLDEN = {
    "A": (4096, 2, 3, [0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
          [4096, 4096, 8192, 8192, 8192, 16384, 8192, 8192, 8192, 16384],
          [0, 0, 3, 3, 3, 6, 7, 7, 7, 10]),
    "B": (4, 2, 2, [1, 1, 1, 1, 0, 0], [2, 1, 1, 1, 1, 2], [1, 2, 3, 4, 4, 6]),
    "C": (3, 3, 1, [0, 0, 1, 0, 1, 1], [9, 27, 9, 27, 9, 3], [1, 2, 3, 4, 5, 6]),
    "D": (1.5, 4, 2, [1, 0, 0], [1, 1, 4], [1, 1, 3]),
}


# ------------------------------------------------------------------ update cells
@pytest.mark.parametrize("case", sorted(GOLDEN))
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_dynamic_cell_called_as_mindspore_reproduces_golden_sequence(case, graph):
    init, factor, window, flags, scales, last_iters = GOLDEN[case]
    cell = mso.DynamicLossScaleUpdateCell(init, factor, window)
    loss_scale = tf.Variable(float(init))
    call = tf.function(cell.__call__) if graph else cell
    got_scales, got_last = [], []
    for flag in flags:
        returned = call(loss_scale, tf.constant(bool(flag)))
        assert bool(returned) == bool(flag)          # returns the input flag unchanged
        got_scales.append(float(loss_scale.numpy()))
        got_last.append(int(cell.last_overflow_iter.numpy()))
    assert got_scales == [float(s) for s in scales]
    assert got_last == last_iters
    assert int(cell.cur_iter.numpy()) == len(flags) + 1
    assert cell.get_loss_scale() == init


def test_dynamic_cell_growth_stays_finite():
    # MindSpore's cell turns 2**127 into inf here; ours keeps the largest power of two.
    cell = mso.DynamicLossScaleUpdateCell(2.0**127, 2, 1)
    loss_scale = tf.Variable(2.0**127)
    for _ in range(3):
        cell(loss_scale, False)
    assert float(loss_scale.numpy()) == 2.0**127


def test_dynamic_cell_with_factor_below_one_stays_at_least_one():
    cell = mso.DynamicLossScaleUpdateCell(2.0, 0.5, 1)
    loss_scale = tf.Variable(2.0)
    cell(loss_scale, False)
    cell(loss_scale, False)
    assert float(loss_scale.numpy()) == 1.0


def test_fixed_cell_returns_flag_and_keeps_scale():
    cell = mso.FixedLossScaleUpdateCell(128)
    loss_scale = tf.Variable(128.0)
    assert bool(cell(loss_scale, tf.constant(True))) is True
    assert bool(cell(loss_scale, tf.constant(False))) is False
    assert float(loss_scale.numpy()) == 128.0 and cell.get_loss_scale() == 128.0


# ---------------------------------------------------------------------- managers
@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_dynamic_manager_host_update_matches_the_cell(case):
    init, factor, window, flags, scales, _ = GOLDEN[case]
    manager = mso.DynamicLossScaleManager(init, factor, window)
    got = []
    for flag in flags:
        manager.update_loss_scale(bool(flag))
        got.append(manager.get_loss_scale())
    assert got == [float(s) for s in scales]


def test_dynamic_manager_raises_on_the_1001st_consecutive_overflow():
    manager = mso.DynamicLossScaleManager(2.0**24, 2, 2000)
    for _ in range(1000):
        manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 1.0
    with pytest.raises(RuntimeError, match="1001 consecutive overflows"):
        manager.update_loss_scale(True)


def test_dynamic_manager_clean_step_resets_the_overflow_run():
    manager = mso.DynamicLossScaleManager(2.0**24, 2, 2000)
    for _ in range(1000):
        manager.update_loss_scale(True)
    manager.update_loss_scale(False)
    for _ in range(1000):
        manager.update_loss_scale(True)   # a new run of 1000: no error


def test_dynamic_manager_host_growth_stays_finite_in_float32():
    manager = mso.DynamicLossScaleManager(2.0**127, 2, 1)
    manager.update_loss_scale(False)
    assert manager.get_loss_scale() == 2.0**127


def test_dynamic_manager_update_cell_starts_from_current_scale():
    manager = mso.DynamicLossScaleManager(1024, 4, 7)
    manager.update_loss_scale(True)
    cell = manager.get_update_cell()
    assert isinstance(cell, mso.DynamicLossScaleUpdateCell)
    assert (cell.get_loss_scale(), cell.scale_factor, cell.scale_window) == (256.0, 4.0, 7)
    assert manager.get_drop_overflow_update() is True


def test_dynamic_manager_defaults():
    manager = mso.DynamicLossScaleManager()
    assert (manager.get_loss_scale(), manager.scale_factor, manager.scale_window) == \
        (2.0**24, 2.0, 2000)


def test_fixed_manager_update_cell_and_flag():
    manager = mso.FixedLossScaleManager()
    assert manager.get_loss_scale() == 128.0 and manager.get_drop_overflow_update() is True
    cell = manager.get_update_cell()
    assert isinstance(cell, mso.FixedLossScaleUpdateCell) and cell.get_loss_scale() == 128.0
    manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 128.0
    no_drop = mso.FixedLossScaleManager(64, drop_overflow_update=False)
    assert no_drop.get_update_cell() is None and no_drop.get_drop_overflow_update() is False


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("make, error, words", [
    (lambda: mso.FixedLossScaleManager(loss_scale=0.5), ValueError, ["'loss_scale'", "0.5"]),
    (lambda: mso.FixedLossScaleManager(loss_scale="8"), TypeError, ["'loss_scale'", "str"]),
    (lambda: mso.FixedLossScaleManager(loss_scale=math.inf), ValueError, ["'loss_scale'", "inf"]),
    (lambda: mso.FixedLossScaleManager(drop_overflow_update=1), TypeError,
     ["'drop_overflow_update'", "bool", "int"]),
    (lambda: mso.DynamicLossScaleManager(init_loss_scale=0.5), ValueError,
     ["'init_loss_scale'", "0.5"]),
    (lambda: mso.DynamicLossScaleManager(init_loss_scale=math.nan), ValueError,
     ["'init_loss_scale'", "nan"]),
    (lambda: mso.DynamicLossScaleManager(scale_window=2.0), TypeError,
     ["'scale_window'", "int", "float"]),
    (lambda: mso.DynamicLossScaleManager(scale_window=0), ValueError, ["'scale_window'", "0"]),
    (lambda: mso.DynamicLossScaleManager(scale_factor=0), ValueError, ["'scale_factor'", "0"]),
    (lambda: mso.DynamicLossScaleManager(scale_factor=-2.0), ValueError, ["'scale_factor'"]),
    (lambda: mso.DynamicLossScaleManager(scale_factor=None), TypeError, ["'scale_factor'"]),
    (lambda: mso.DynamicLossScaleUpdateCell(0.0, 2, 10), ValueError, ["'loss_scale_value'"]),
    (lambda: mso.DynamicLossScaleUpdateCell(8, 2, 1.5), TypeError, ["'scale_window'"]),
    (lambda: mso.DynamicLossScaleUpdateCell(8, math.inf, 1), ValueError, ["'scale_factor'"]),
    (lambda: mso.FixedLossScaleUpdateCell(True), TypeError, ["'loss_scale_value'", "bool"]),
])
def test_bad_arguments_raise_mindspore_exception_types(make, error, words):
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


def test_accepted_edge_values():
    assert mso.DynamicLossScaleManager(init_loss_scale=1.0).get_loss_scale() == 1.0
    assert mso.DynamicLossScaleManager(scale_factor=1.5).scale_factor == 1.5
    assert mso.FixedLossScaleManager(loss_scale=np.float32(4)).get_loss_scale() == 4.0


@pytest.mark.parametrize("scale_sense, error, words", [
    ("8", TypeError, ["'scale_sense'", "str"]),
    (True, TypeError, ["'scale_sense'", "bool"]),
    (np.array([8.0, 8.0]), ValueError, ["shape of 'scale_sense'", "(2,)"]),
    (0.5, ValueError, ["'scale_sense'", "0.5"]),
    (math.inf, ValueError, ["'scale_sense'"]),
])
def test_optimizer_rejects_bad_scale_sense(scale_sense, error, words):
    with pytest.raises(error) as info:
        mso.LossScaleOptimizer(keras.optimizers.SGD(), scale_sense)
    for word in words:
        assert word in str(info.value)


def test_optimizer_rejects_bad_inner_optimizer_and_base_kwargs():
    with pytest.raises(TypeError, match="'inner_optimizer'"):
        mso.LossScaleOptimizer("sgd", 8.0)
    with pytest.raises(ValueError, match="scaled twice"):
        mso.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), 8.0)
    with pytest.raises(ValueError, match="clipnorm"):
        mso.LossScaleOptimizer(keras.optimizers.SGD(), 8.0, clipnorm=1.0)


@pytest.mark.parametrize("scale_sense", [8, 8.0, np.float32(8), np.array([8.0]), tf.constant(8.0)])
def test_scalar_scale_sense_forms(scale_sense):
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(), scale_sense)
    assert optimizer.scale_sense == 8.0 and float(optimizer.loss_scale) == 8.0


# ------------------------------------------------------ the optimizer's update rule
def _apply_sequence(optimizer, flags):
    """Applies scaled gradients ``scale * 1`` (or inf where flagged) to w = [1, 1]."""
    w = keras.Variable([1.0, 1.0])
    optimizer.build([w])
    scales, weights = [], []
    for flag in flags:
        scale = float(optimizer.loss_scale)
        grad = tf.constant([math.inf if flag else scale, scale])
        optimizer.apply([grad], [w])
        scales.append(float(optimizer.dynamic_scale.numpy()))
        weights.append(w.numpy().copy())
    return scales, weights


@pytest.mark.parametrize("case", sorted(GOLDEN))
@pytest.mark.parametrize("kind", ["cell", "manager"])
def test_optimizer_follows_golden_sequence_and_skips_overflow(case, kind):
    init, factor, window, flags, scales, _ = GOLDEN[case]
    scale_sense = (mso.DynamicLossScaleUpdateCell(init, factor, window) if kind == "cell"
                   else mso.DynamicLossScaleManager(init, factor, window))
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.125), scale_sense)
    got_scales, weights = _apply_sequence(optimizer, flags)
    assert got_scales == [float(s) for s in scales]
    # each clean step applies the unscaled gradient 1; an overflow step changes nothing
    expected_w = 1.0 - 0.125 * np.cumsum([0 if f else 1 for f in flags])
    np.testing.assert_array_equal([w[1] for w in weights], expected_w)
    np.testing.assert_array_equal([w[0] for w in weights], expected_w)
    assert int(optimizer.skipped_steps.numpy()) == sum(flags)
    assert int(optimizer.last_step_skipped.numpy()) == flags[-1]
    assert int(optimizer.iterations.numpy()) == len(flags) - sum(flags)


@pytest.mark.parametrize("scale_sense", [
    mso.FixedLossScaleUpdateCell(8), mso.FixedLossScaleManager(8), 8.0, tf.constant([8.0])],
    ids=["fixed_cell", "fixed_manager", "number", "tensor"])
def test_fixed_scales_skip_overflowing_steps(scale_sense):
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.5), scale_sense)
    scales, weights = _apply_sequence(optimizer, [0, 1, 0, 1, 1])
    assert scales == [8.0] * 5
    np.testing.assert_array_equal([w[1] for w in weights], [0.5, 0.5, 0.0, 0.0, 0.0])
    assert int(optimizer.skipped_steps.numpy()) == 3
    assert int(optimizer.last_step_skipped.numpy()) == 1


def test_fixed_manager_without_drop_never_checks_or_skips():
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.5),
                                       mso.FixedLossScaleManager(8, drop_overflow_update=False))
    scales, weights = _apply_sequence(optimizer, [0, 1])
    assert scales == [8.0, 8.0]
    np.testing.assert_array_equal(weights[0], [0.5, 0.5])
    assert weights[1][0] == -np.inf and weights[1][1] == 0.0   # the inf step was applied
    assert int(optimizer.skipped_steps.numpy()) == 0
    assert int(optimizer.iterations.numpy()) == 2


# ---------------------------------------------------------------------- bounds
def _run_steps(optimizer, grad, steps):
    """``steps`` applications of ``grad`` in one tf.while_loop; returns (min, max, all finite)."""
    w = keras.Variable([1.0, 1.0])
    optimizer.build([w])

    @tf.function
    def run():
        low, high, finite = tf.constant(math.inf), tf.constant(0.0), tf.constant(True)
        for _ in tf.range(steps):
            optimizer.apply([grad], [w])
            scale = tf.convert_to_tensor(optimizer.dynamic_scale)
            low, high = tf.minimum(low, scale), tf.maximum(high, scale)
            finite = finite & tf.math.is_finite(scale) & tf.reduce_all(tf.math.is_finite(w))
        return low, high, finite

    low, high, finite = run()
    return float(low), float(high), bool(finite), w


def test_1000_consecutive_overflows_keep_scale_at_least_one_and_weights_unchanged():
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.1), mso.DynamicLossScaleManager())
    low, _, finite, w = _run_steps(optimizer, tf.constant([math.inf, math.nan]), 1000)
    assert low == 1.0 and float(optimizer.dynamic_scale.numpy()) == 1.0 and finite
    np.testing.assert_array_equal(w.numpy(), [1.0, 1.0])
    assert int(optimizer.skipped_steps.numpy()) == 1000
    assert int(optimizer.iterations.numpy()) == 0
    # training goes on normally at scale 1
    optimizer.apply([tf.constant([1.0, 2.0])], [w])
    np.testing.assert_allclose(w.numpy(), [0.9, 0.8], rtol=1e-7)


@pytest.mark.parametrize("factor", [2, 1000.0])
def test_10000_clean_steps_never_make_the_scale_inf(factor):
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                       mso.DynamicLossScaleUpdateCell(2.0**24, factor, 1))
    low, high, finite, w = _run_steps(optimizer, tf.constant([0.0, 0.0]), 10000)
    final = float(optimizer.dynamic_scale.numpy())
    assert finite and high <= FLOAT32_MAX and low >= 2.0**24
    assert final == high and final * factor > FLOAT32_MAX   # grew as far as float32 allows
    if factor == 2:
        assert final == 2.0**127
    np.testing.assert_array_equal(w.numpy(), [1.0, 1.0])
    assert int(optimizer.iterations.numpy()) == 10000


# --------------------------------------------------------------- serialization
@pytest.mark.parametrize("scale_sense", [
    mso.DynamicLossScaleUpdateCell(1024, 3, 5), mso.FixedLossScaleUpdateCell(16),
    mso.DynamicLossScaleManager(2.0**10, 4, 7), mso.FixedLossScaleManager(32, False), 64.0],
    ids=["dynamic_cell", "fixed_cell", "dynamic_manager", "fixed_manager", "number"])
def test_config_round_trip(scale_sense):
    optimizer = mso.LossScaleOptimizer(keras.optimizers.Adam(0.003), scale_sense, name="lso")
    serialized = keras.optimizers.serialize(optimizer)
    json.dumps(serialized)
    restored = keras.optimizers.deserialize(json.loads(json.dumps(serialized)))
    assert type(restored) is mso.LossScaleOptimizer and restored.name == "lso"
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)
    assert float(restored.inner_optimizer.learning_rate) == pytest.approx(0.003)
    assert type(restored.scale_sense) is type(scale_sense)
    if isinstance(scale_sense, float):
        assert restored.scale_sense == scale_sense
    else:
        assert restored.scale_sense.get_config() == scale_sense.get_config()
    assert restored.get_config() == optimizer.get_config()


def test_custom_loop_api_before_build_uses_initial_scale():
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(), mso.DynamicLossScaleManager(256))
    assert float(optimizer.scale_loss(2.0)) == 512.0
    assert float(optimizer.get_scaled_loss(2.0)) == 512.0
    assert float(optimizer.get_scaled_loss(lambda: tf.constant(2.0))()) == 512.0
    unscaled = optimizer.get_unscaled_gradients([tf.constant([512.0]), None])
    assert float(unscaled[0][0]) == 2.0 and unscaled[1] is None


def test_unscaling_keeps_float16_gradients_from_underflowing():
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(), 2.0**25)
    grad = tf.constant([2.0**10], tf.float16)      # 1/2**25 is 0 in float16
    unscaled = optimizer.get_unscaled_gradients([grad])[0]
    assert unscaled.dtype == tf.float16 and float(unscaled[0]) == 2.0**-15


def test_indexed_slices_gradients_are_unscaled():
    optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(1.0), 4.0)
    table = keras.Variable(np.ones((3, 2), np.float32))
    optimizer.build([table])
    grad = tf.IndexedSlices(tf.constant([[4.0, 8.0]]), tf.constant([1]), tf.constant([3, 2]))
    optimizer.apply([grad], [table])
    np.testing.assert_array_equal(table.numpy(), [[1, 1], [0, -1], [1, 1]])


def test_monitor_requires_our_optimizer():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(), "mse")
    with pytest.raises(ValueError, match="tf_msopt.LossScaleOptimizer"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[LossScaleMonitor()])


# --------------------------------------------------------------- Keras' form (drop-in)

def test_keras_form_and_its_defaults():
    default = mso.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    cell = default.scale_sense
    assert type(cell) is mso.DynamicLossScaleUpdateCell
    assert (cell.loss_scale_value, cell.scale_factor, cell.scale_window) == (2.0**15, 2.0, 2000)
    assert (default.initial_scale, default.dynamic_growth_steps) == (2.0**15, 2000)
    given = mso.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64,
                                   dynamic_growth_steps=3)
    assert given.scale_sense.get_config() == {"loss_scale_value": 64.0, "scale_factor": 2.0,
                                              "scale_window": 3}
    assert float(given.scale_loss(1.0)) == 64.0


@pytest.mark.parametrize("kwargs, error, words", [
    ({"scale_sense": 8.0, "initial_scale": 8.0}, ValueError, "not both"),
    ({"scale_sense": mso.DynamicLossScaleManager(), "dynamic_growth_steps": 10}, ValueError,
     "not both"),
    ({"initial_scale": 0.5}, ValueError, "initial_scale"),
    ({"initial_scale": "big"}, TypeError, "initial_scale"),
    ({"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps"),
    ({"dynamic_growth_steps": 2.5}, TypeError, "dynamic_growth_steps"),
])
def test_keras_form_argument_errors(kwargs, error, words):
    with pytest.raises(error, match=words):
        mso.LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)


def _scale_trace(optimizer, steps):
    variable = keras.Variable([1.0, 2.0])
    trace = []
    for grad in steps:
        optimizer.apply([tf.constant(grad, tf.float32)], [variable])
        trace.append((float(optimizer.dynamic_scale.numpy()),
                      int(optimizer.step_counter.numpy()), variable.numpy().tolist()))
    return trace


def test_keras_form_follows_keras_rule():
    """Without hitting the bounds, the Keras form is Keras' class, step for step."""
    steps = [[8.0, 8.0]] * 4 + [[np.inf, 1.0], [np.nan, 1.0]] + [[8.0, 8.0]] * 3
    ours = mso.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), initial_scale=8.0,
                                  dynamic_growth_steps=3)
    theirs = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                                 initial_scale=8.0, dynamic_growth_steps=3)
    want = _scale_trace(theirs, steps)
    assert [s for s, _, _ in want] == [8, 8, 16, 16, 8, 4, 4, 4, 8]
    assert _scale_trace(ours, steps) == want


def test_configs_load_into_either_class_where_the_meaning_allows():
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=32,
                                                    dynamic_growth_steps=7, name="k")
    ours = mso.LossScaleOptimizer.from_config(json.loads(json.dumps(keras_lso.get_config())))
    assert ours.name == "k" and isinstance(ours.inner_optimizer, keras.optimizers.Adam)
    assert ours.scale_sense.get_config() == {"loss_scale_value": 32.0, "scale_factor": 2.0,
                                             "scale_window": 7}
    # Keras' meaning (a dynamic cell with factor 2), either form: Keras' keys only.
    for optimizer in (mso.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=16,
                                             dynamic_growth_steps=5),
                      mso.LossScaleOptimizer(keras.optimizers.SGD(),
                                             mso.DynamicLossScaleUpdateCell(16, 2, 5))):
        config = optimizer.get_config()
        assert "scale_sense" not in config
        back = keras.optimizers.LossScaleOptimizer.from_config(dict(config))
        assert (back.initial_scale, back.dynamic_growth_steps) == (16, 5)
    # No Keras equivalent: our class loads it, Keras' refuses it naming the argument.
    for scale_sense in (64.0, mso.DynamicLossScaleUpdateCell(16, 3, 5),
                        mso.FixedLossScaleManager(8, False)):
        config = mso.LossScaleOptimizer(keras.optimizers.SGD(), scale_sense).get_config()
        assert "scale_sense" in config and "initial_scale" in config
        again = mso.LossScaleOptimizer.from_config(dict(config))
        assert type(again.scale_sense) is type(scale_sense)
        with pytest.raises(ValueError, match="scale_sense"):
            keras.optimizers.LossScaleOptimizer.from_config(dict(config))


def test_keras_file_with_a_loss_scale_optimizer_continues_in_ours(tmp_path):
    x, y = np.random.default_rng(0).normal(size=(2, 40, 3)).astype("float32")

    def model_with_keras_lso():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
        inner = keras.optimizers.SGD(0.05, momentum=0.9)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            inner, initial_scale=64.0, dynamic_growth_steps=2), loss="mse")
        return model

    uninterrupted = model_with_keras_lso()
    for i in range(5):
        uninterrupted.train_on_batch(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
    model = model_with_keras_lso()
    for i in range(3):
        model.train_on_batch(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
    model.save(tmp_path / "keras_lso.keras")

    loaded = keras.models.load_model(tmp_path / "keras_lso.keras", safe_mode=True)
    assert type(loaded.optimizer) is keras.optimizers.LossScaleOptimizer   # the file's class
    ours = mso.LossScaleOptimizer.from_keras(loaded.optimizer)
    loaded.compile(optimizer=ours, loss="mse")
    for i in range(3, 5):
        loaded.train_on_batch(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
    assert loaded.optimizer is ours
    want = uninterrupted.optimizer
    assert float(ours.dynamic_scale.numpy()) == float(want.dynamic_scale.numpy()) == 256.0
    assert int(ours.step_counter.numpy()) == int(want.step_counter.numpy())
    assert int(ours.iterations.numpy()) == 5
    for got, expected in zip(loaded.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_array_equal(got, expected)


def test_exclude_from_weight_decay_reaches_the_inner_optimizer():
    inner = keras.optimizers.SGD(0.1, weight_decay=0.5)
    kept, decayed = keras.Variable([1.0], name="keep"), keras.Variable([1.0], name="decay")
    optimizer = mso.LossScaleOptimizer(inner, initial_scale=4.0)
    optimizer.exclude_from_weight_decay(var_list=[kept])
    optimizer.apply([tf.zeros([1]), tf.zeros([1])], [kept, decayed])
    assert kept.numpy().tolist() == [1.0]
    np.testing.assert_allclose(decayed.numpy(), [1.0 - 0.1 * 0.5])
