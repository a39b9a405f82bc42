"""THOR's construction: MindSpore's validation rules, the report, config and connection."""
import ast
import dataclasses
import inspect
import os
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO_ROOT, benchmark_module

import tf_msopt as mso


def small_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc"),
                             keras.layers.Dense(2, name="head")])


# -- validation (MindSpore's checks, plus the arguments MindSpore does not check) -------------

@pytest.mark.parametrize("kwargs, error, argument", [
    (dict(loss_scale="2"), TypeError, "loss_scale"),
    (dict(loss_scale=0.0), ValueError, "loss_scale"),
    (dict(weight_decay=-1.0), ValueError, "weight_decay"),
    (dict(weight_decay="0"), TypeError, "weight_decay"),
    (dict(momentum=1), TypeError, "momentum"),            # an int is rejected, as in MindSpore
    (dict(momentum=-0.1), ValueError, "momentum"),
    (dict(momentum=1.0, graft="adam"), ValueError, "with graft='adam' the 'momentum' must be"),
    (dict(frequency=2.0), TypeError, "frequency"),
    (dict(frequency=1), ValueError, "frequency"),
    (dict(learning_rate="0.1"), TypeError, "learning_rate"),
    (dict(learning_rate=np.zeros((2, 2))), ValueError, "learning_rate"),
    (dict(use_nesterov=1), TypeError, "use_nesterov"),
    (dict(damping="0.1"), TypeError, "damping"),
    (dict(damping=-0.1), ValueError, "damping"),
    (dict(damping=[0.1, -1.0]), ValueError, "damping"),
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(batch_size=32.0), TypeError, "batch_size"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(split_indices="0"), TypeError, "split_indices"),
    (dict(split_indices=[3, 1]), ValueError, "split_indices"),
    (dict(enable_clip_grad=1), TypeError, "enable_clip_grad"),
    (dict(decay_filter="bias"), TypeError, "decay_filter"),
    (dict(gradient_accumulation_steps=1), ValueError, "gradient_accumulation_steps"),
])
def test_bad_arguments_raise_mindspore_types(kwargs, error, argument):
    args = dict(learning_rate=0.1, damping=0.03, momentum=0.9)
    args.update(kwargs)
    with pytest.raises(error, match=argument):
        mso.thor(small_model(), **args)


def test_accepted_forms():
    optimizer = mso.thor(small_model(), tf.constant([0.1, 0.05]), [0.03, 0.02], 0.9,
                         loss_scale=128, weight_decay=0, block_size=None, split_indices=[0])
    assert optimizer.options.loss_scale == 128.0 and optimizer.options.block_size is None
    assert isinstance(optimizer.options.damping, mso.schedules.PerStepSchedule)
    assert isinstance(optimizer, mso.THOR) and isinstance(optimizer, keras.optimizers.Optimizer)


# -- the report --------------------------------------------------------------------------------

class OwnCallDense(keras.layers.Dense):
    def call(self, inputs):
        return super().call(inputs) * 2.0


def test_report_names_every_variable_and_why():
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.DepthwiseConv2D(3, name="depthwise"),
        keras.layers.Flatten(),
        OwnCallDense(5, name="own_call"),
        keras.layers.LayerNormalization(name="ln"),
        keras.layers.Dense(2, name="head"),
    ])
    report = mso.thor(model, 0.1, 0.03, 0.9).report()
    text = str(report)
    assert {row.variable for row in report.rows} == {v.path for v in model.trainable_variables}
    for variable in model.trainable_variables:
        assert variable.path in text
    assert sorted(report.preconditioned) == sorted(
        v.path for v in model.trainable_variables
        if v.path.endswith(("/conv/kernel", "depthwise/kernel", "head/kernel", "ln/gamma",
                            "ln/beta")))
    reasons = report.first_order
    assert "BatchNormalization" in reasons[model.get_layer("bn").gamma.path]
    assert "4 channel(s), A 9x9, G 1x1 each" in text
    assert "overrides call()" in reasons[model.get_layer("own_call").kernel.path]
    assert "kernel only" in reasons[model.get_layer("head").bias.path]
    assert "A 18x18 in 1 block(s), G 4x4 in 1 block(s)" in text
    assert report.connected


def test_report_of_the_default_says_which_variables_take_adams_step():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc"),
                              keras.layers.LayerNormalization(name="ln")], name="model")
    report = mso.thor(model).report()
    # The graft gives LayerNorm Adam's step, in place of MindSpore's rule (which reads the
    # damping the default does not have).
    assert report.preconditioned == ["model/fc/kernel"]
    assert "first order (Adam's step)" in str(report).splitlines()[0]
    for name in ("gamma", "beta"):
        assert "Adam's step instead of the LayerNorm rule" in report.first_order[
            f"model/ln/{name}"]
    # An optimizer restored from its config, before it is connected, says the same.
    unconnected = mso.THOR.from_config(mso.thor(model).get_config()).report()
    rules = {row.variable: row.rule for row in report.rows if not row.variable.endswith("bias")}
    assert {f"model/{row.variable}": row.rule for row in unconnected.rows} == rules


KERNELS = ("emb/embeddings", "wide/kernel", "up/kernel", "head/kernel")


@pytest.mark.parametrize("kwargs, unused", [
    ({}, {"emb/embeddings": "A"}),                    # a diagonal A has no eigenbasis
    (dict(max_rotated_dim=8),                         # the wider factor, if wider than 8
     {"emb/embeddings": "A", "wide/kernel": "A", "up/kernel": "G", "head/kernel": "A"}),
    (dict(precondition_inputs=False), dict.fromkeys(KERNELS, "A")),
    (dict(preconditioner="inverse", damping=0.03), {}),  # diag(a_inv) scales the rows
    (dict(preconditioner="inverse", damping=0.03, precondition_inputs=False),
     dict.fromkeys(KERNELS, "A")),
])
def test_report_names_the_factors_a_kernel_leaves_unused(kwargs, unused):
    model = keras.Sequential([
        keras.Input((3,), dtype="int32"), keras.layers.Embedding(12, 4, name="emb"),
        keras.layers.Flatten(), keras.layers.Dense(5, name="wide"),      # A 12, G 5
        keras.layers.Dense(20, name="up"), keras.layers.Dense(2, name="head")], name="model")
    rules = {row.variable.removeprefix("model/"): row.rule
             for row in mso.thor(model, **kwargs).report().rows if row.rule != "first order"}
    assert set(rules) == set(KERNELS)
    notes = {"A": "; A unused: preconditioned on the output side",
             "G": "; G unused: preconditioned on the input side"}
    for variable, rule in rules.items():
        assert [side for side, note in notes.items() if rule.endswith(note)] == (
            [unused[variable]] if variable in unused else []), (variable, rule)


@pytest.mark.parametrize("kwargs, schedule, inverts", [
    ({}, "statistics every step into moving averages (decay 0.95), eigenvectors every 10 "
         "steps, each basis kept while it still holds", False),
    (dict(eigenbasis_tolerance=None, frequency=20, statistics_decay=0.9,
          experimental=dict(statistics_frequency=4)),
     "statistics every 4 steps into moving averages (decay 0.9), eigenvectors every 20 steps",
     False),
    (dict(preconditioner="inverse", damping=0.03, statistics_decay=None, graft=None,
          kl_clip=None, frequency=5), "statistics and inverses every 5 steps", True),
])
def test_report_says_when_each_part_is_renewed(kwargs, schedule, inverts):
    report = mso.thor(small_model(), **kwargs).report()
    header = str(report).splitlines()[0]
    assert report.schedule == schedule and f"); {schedule}; blocks of" in header
    # The eigenbasis inverts nothing, so no inverse op is named.
    assert (report.inverse_backend is not None) == inverts
    assert header.endswith(f"; inverse back-end: {report.inverse_backend}" if inverts
                           else "blocks of 1024")


def _costs(report):
    return {cost.layer: cost for cost in report.costs}


def test_report_counts_the_operations_the_curvature_adds_a_step():
    """Embedding 12 x 4 over 3 tokens (A diagonal), Dense 12 -> 5 and 5 -> 2; batch 8."""
    model = keras.Sequential([
        keras.Input((3,), dtype="int32"), keras.layers.Embedding(12, 4, name="emb"),
        keras.layers.Flatten(), keras.layers.Dense(5, name="wide"),
        keras.layers.Dense(2, name="head")])
    optimizer = mso.thor(model, max_rotated_dim=4)   # wide's A (12), head's (5): not rotated
    before = _costs(optimizer.report())
    assert [cost.rows for cost in before.values()] == [None] * 3
    assert before["wide"].statistics is None and "not measured yet" in str(optimizer.report())
    model.compile(optimizer, "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    model.fit(rng.integers(0, 12, (8, 3)), rng.integers(0, 2, 8), batch_size=8, verbose=0)
    costs = _costs(optimizer.report())
    # Eigenbasis: statistics every step from r rows (2 r n^2 per factor), rotation into each
    # basis and back (4 n^2 m per rotated side), refresh 11 n^3 (with the check) per 10 steps.
    expected = {  # (rows, statistics, preconditioning, refresh)
        "emb": (24, 2 * 24 * 4**2, 4 * 4**2 * 12, 11 * 4**3 / 10),
        "wide": (8, 2 * 8 * 5**2, 4 * 5**2 * 12, 11 * 5**3 / 10),
        "head": (8, 2 * 8 * 2**2, 4 * 2**2 * 5, 11 * 2**3 / 10),     # A (5) not rotated
    }
    assert list(costs) == list(expected)
    for name, cost in costs.items():
        assert (cost.rows, cost.statistics, cost.preconditioning, cost.refresh) == \
            pytest.approx(expected[name]), name
    # Its forward and backward pass, 6 r * 60, costs 4 * 25 * 12 at r = 10/3.
    assert costs["wide"].break_even_rows == pytest.approx(4 * 5**2 * 12 / (6 * 60))
    assert costs["emb"].break_even_rows is None     # a table it gathers from
    text = str(optimizer.report())
    assert re.search(r"\n  wide +400 \(8\) +1.2k +137.5 +3\n", text), text
    assert "spread over the 10 updates between refreshes" in text
    assert "break-even rows: the rows a step" in text


def test_cost_of_mindspores_form_counts_its_inverses_per_thor_step():
    optimizer = mso.thor(small_model(), 0.1, 0.03, 0.9, frequency=5)
    model = optimizer.connected_model()
    model.compile(optimizer, "mse")
    model.fit(np.ones((6, 4), np.float32), np.ones((6, 2), np.float32), verbose=0)
    # Statistics on THOR steps only, A_inv g G_inv (one product a side), an inverse 2 n^3.
    fc, head = optimizer.report().costs
    assert (fc.statistics, fc.preconditioning, fc.refresh) == pytest.approx(
        (2 * 6 * (4**2 + 3**2) / 5, 2 * (4**2 * 3 + 3**2 * 4), 2 * (4**3 + 3**3) / 5))
    assert head.preconditioning == pytest.approx(2 * (3**2 * 2 + 2**2 * 3))


def test_cost_with_gradient_accumulation_spreads_an_update_over_its_steps():
    def costs(**kwargs):
        keras.utils.set_random_seed(0)
        model = small_model()
        optimizer = mso.thor(model, **kwargs)
        model.compile(optimizer, "mse")
        model.fit(np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), batch_size=4,
                  verbose=0)
        return optimizer.report().costs[0]

    alone, accumulated = costs(), costs(gradient_accumulation_steps=2)
    # Every step measures its 4 rows; the update preconditions and refreshes once a cycle.
    assert (accumulated.rows, accumulated.statistics) == (alone.rows, alone.statistics) == (
        4, 2 * 4 * (4**2 + 3**2))
    assert accumulated.preconditioning == alone.preconditioning / 2 == 2 * (4**2 * 3 + 3**2 * 4)
    assert accumulated.refresh == pytest.approx(alone.refresh / 2)


def test_the_cost_table_of_the_docs_is_what_the_report_prints():
    model = keras.Sequential([keras.Input((784,))] + [
        keras.layers.Dense(units, activation=activation, name=name) for units, activation, name
        in ((256, "relu", "dense"), (128, "relu", "dense_1"), (10, None, "dense_2"))])
    optimizer = mso.thor(model)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    model.train_on_batch(rng.random((64, 784), dtype=np.float32), rng.integers(0, 10, 64))
    printed = str(optimizer.report()).splitlines()
    table = printed[next(i for i, line in enumerate(printed) if line.startswith("cost a step")):]
    with open(os.path.join(REPO_ROOT, "docs", "thor.md")) as page:
        text = page.read()
    assert "```\n" + "\n".join(table) + "\n```" in text


# -- config, connection ------------------------------------------------------------------------

def test_config_round_trip():
    optimizer = mso.thor(small_model(), np.array([0.1, 0.05]), mso.schedules.PerStepSchedule(
        [0.03, 0.02]), 0.8, weight_decay=1e-4, loss_scale=4.0, batch_size=16,
        use_nesterov=True, decay_filter=["bias"], split_indices=[0], enable_clip_grad=True,
        frequency=5, block_size=64)
    config = optimizer.get_config()
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(restored) is mso.THOR
    assert restored.get_config() == config
    assert config["layers"] == [
        {"layer": "fc", "kind": "dense", "variables": ["kernel"], "a_dim": 4, "g_dim": 3},
        {"layer": "head", "kind": "dense", "variables": ["kernel"], "a_dim": 3, "g_dim": 2}]


@pytest.mark.parametrize("kwargs, argument", [
    (dict(decay_filter=lambda v: True), "decay_filter"),
    (dict(damping=lambda: 0.1), "damping"),
])
def test_unsaveable_callables_say_so(kwargs, argument):
    args = dict(learning_rate=0.1, damping=0.03, momentum=0.9)
    args.update(kwargs)
    optimizer = mso.thor(small_model(), **args)
    with pytest.raises(ValueError, match=argument):
        optimizer.get_config()


def test_unconnected_thor_raises_at_first_step():
    model = small_model()
    optimizer = mso.THOR.from_config(mso.thor(small_model(), 0.1, 0.03, 0.9).get_config())
    model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(RuntimeError, match="not connected"):
        model.train_on_batch(np.ones((2, 4), "float32"), np.ones((2, 2), "float32"))
    assert "NOT CONNECTED" in str(optimizer.report())
    mso.thor.connect(model)
    model.train_on_batch(np.ones((2, 4), "float32"), np.ones((2, 2), "float32"))
    assert int(optimizer.iterations.numpy()) == 1


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.fc = keras.layers.Dense(3, activation="tanh")
        self.head = keras.layers.Dense(2)

    def call(self, inputs):
        return self.head(self.fc(inputs))


def _unbuilt(kind):
    """A model of the given kind whose layers get their shapes only from the data."""
    keras.utils.set_random_seed(0)
    if kind == "subclassed":
        return Subclassed()
    layers = [keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)]
    return keras.Sequential(([keras.Input((4,))] if kind == "built" else []) + layers)


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
@pytest.mark.parametrize("strategy", [None, "two_cpu_strategy"])
def test_a_model_built_by_fit_is_connected_then(kind, strategy, request):
    """THOR created for a model that is not built yet (no ``Input``; a subclassed model)
    connects when ``fit`` builds it, and trains as for the model built beforehand."""
    x = np.random.default_rng(0).normal(size=(24, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(24, 2)).astype("float32")
    strategy = request.getfixturevalue(strategy) if strategy else tf.distribute.get_strategy()
    weights, optimizers = [], []
    for model_kind in ("built", kind):
        with strategy.scope():
            model = _unbuilt(model_kind)
            optimizer = mso.thor(model, frequency=2)
            assert model.built == (model_kind == "built")
            assert ("the model is not built" in str(optimizer.report())) == (not model.built)
            model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
        optimizers.append(optimizer)
    for got, want in zip(*weights):
        np.testing.assert_array_equal(got, want)
    assert [len(o.curvature) for o in optimizers] == [2, 2]
    assert optimizers[1].curvature[model.layers[0].name].count.numpy() == 6
    assert "NOT CONNECTED" not in str(optimizers[1].report())


def test_a_model_built_in_a_custom_loop_must_be_connected():
    """A custom loop builds the model in its first forward pass, which THOR did not watch:
    it says to connect the built model, and trains once connected."""
    model = _unbuilt("subclassed")
    optimizer = mso.thor(model)
    x = np.ones((2, 4), "float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    gradients = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(ValueError, match="optimizer.connect"):
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    optimizer.connect(model)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    assert int(optimizer.iterations.numpy()) == 1


@pytest.mark.parametrize("make", [
    lambda model: mso.thor(1e-3, model),                 # the arguments in the wrong order
    lambda model: mso.thor(model.layers[0]),             # a layer
    lambda model: mso.thor(model.inputs[0]),             # a symbolic tensor
    lambda model: mso.thor(model).connect(model.layers[0]),
])
def test_anything_but_a_keras_model_is_refused(make):
    with pytest.raises(TypeError, match="For 'THOR', the 'model' must be a keras.Model"):
        make(small_model())


def test_warns_where_nothing_is_preconditioned():
    """A model with nothing THOR has a rule for trains first order: THOR says so when it
    connects, and stays silent where it preconditions something."""
    normalized = keras.Sequential([keras.Input((4,)), keras.layers.LayerNormalization()])
    with pytest.warns(UserWarning, match="THOR has no rule for any trainable variable"):
        optimizer = mso.thor(normalized)
    assert optimizer.report().preconditioned == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mso.thor(small_model())
        # MindSpore's form gives LayerNorm its own rule.
        assert len(mso.thor(normalized, 0.1, 0.03, 0.9).report().preconditioned) == 2


def test_training_another_model_is_refused():
    """THOR compiled with a copy of the model it is connected to would update the copy's
    variables with no curvature: its first step says so instead."""
    model = small_model()
    optimizer = mso.thor(model)
    copy = keras.models.clone_model(model)
    copy.compile(optimizer, "mse")
    with pytest.raises(RuntimeError, match="none of the variables it updates belongs to"):
        copy.fit(np.ones((8, 4)), np.ones((8, 2)), epochs=1, verbose=0)


def test_connect_refuses_another_model():
    optimizer = mso.thor(small_model(), 0.1, 0.03, 0.9)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="fc"),
                              keras.layers.Dense(2, name="head")])
    with pytest.raises(ValueError, match="do not match"):
        optimizer.connect(other)
    with pytest.raises(ValueError, match="no THOR optimizer"):
        mso.thor.connect(other)


def test_compiling_with_another_optimizer_stops_the_capture():
    """Compiled with another optimizer after THOR, a model trains as one never connected to
    THOR (the same weights, nothing captured). Compiled with the same THOR again (here inside
    a LossScaleOptimizer) it captures again, also when another THOR was connected since;
    compiled with no optimizer (a custom loop's loss alone) it goes on capturing."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")

    def fit(model, optimizer):
        model.compile(optimizer, "mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    def a_statistics(optimizer):
        return [statistics.a for statistics in optimizer._model_link.connection.statistics]

    def cleared_statistics(optimizer):
        buffers = a_statistics(optimizer)
        for buffer in buffers:
            buffer.assign(tf.zeros_like(buffer))
        return buffers

    def written(buffers):
        return [bool(np.any(buffer.numpy())) for buffer in buffers]

    model, plain = small_model(), small_model()
    thor = mso.thor(model, frequency=2)
    fit(model, thor)
    plain.set_weights(model.get_weights())
    statistics = cleared_statistics(thor)
    fit(model, keras.optimizers.SGD(0.1))
    fit(plain, keras.optimizers.SGD(0.1))
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert written(statistics) == [False, False]

    fit(model, mso.LossScaleOptimizer(thor))
    assert written(statistics) == [True, True]

    other = mso.thor(model, frequency=2)     # takes the layers over
    other_statistics = cleared_statistics(other)
    fit(model, thor)                         # connects thor again (new buffers)
    assert written(a_statistics(thor)) == [True, True]
    assert written(other_statistics) == [False, False]
    assert int(thor.iterations.numpy()) == 6

    statistics = cleared_statistics(thor)
    model.compile(loss="mse")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    thor.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                             model.trainable_variables))
    assert written(statistics) == [True, True]


# -- the default configuration ---------------------------------------------------------------

def _classifier():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.LayerNormalization(),
                             keras.layers.Dense(3, activation="softmax")])


def test_no_hyper_parameters_give_the_default():
    optimizer = mso.thor(_classifier())
    config = optimizer.get_config()
    for name, value in mso.thor.DEFAULTS.items():
        assert config[name] == pytest.approx(value), name
    # Nothing the default updates reads a damping, so it has none.
    assert config["graft"] == "adam" and config["damping"] is None
    assert config["experimental"] is None and not optimizer.uses_damping
    # An argument given replaces the default's entry, the rest stays.
    changed = mso.thor(_classifier(), frequency=20, weight_decay=1e-4).get_config()
    assert (changed["frequency"], changed["weight_decay"], changed["graft"]) == (20, 1e-4, "adam")
    scaled = mso.thor(_classifier(), **{**mso.thor.DEFAULTS, "learning_rate": 0.05})
    ignored = ("name", "layers", "learning_rate")
    assert scaled.get_config()["learning_rate"] == pytest.approx(0.05)
    assert ({k: v for k, v in scaled.get_config().items() if k not in ignored}
            == {k: v for k, v in config.items() if k not in ignored})


#: Another valid value for each argument of the default.
OVERRIDES = {"learning_rate": 1e-2, "damping": 0.2, "momentum": 0.8, "frequency": 5,
             "graft": None, "preconditioner": "inverse", "statistics_decay": 0.9,
             "block_size": 256, "kl_clip": 1e-3, "eigenbasis_exponent": {"dense": 0.6},
             "eigenbasis_tolerance": None, "statistics_rows": 64, "cautious": False,
             "replica_division": "refresh"}
#: The overrides that make a step read the damping, which the default has none of.
DAMPED = {"graft", "preconditioner"}


def _config(optimizer):
    """The configuration without what names the model's layers."""
    return {k: v for k, v in optimizer.get_config().items() if k not in ("name", "layers")}


def test_overrides_cover_every_argument_of_the_default():
    assert set(OVERRIDES) == set(mso.thor.DEFAULTS)
    assert all(OVERRIDES[k] != v for k, v in mso.thor.DEFAULTS.items())


@pytest.mark.parametrize("name", OVERRIDES)
def test_one_argument_given_alone_replaces_it_in_the_default(name):
    given = {name: OVERRIDES[name]}
    if name in DAMPED:
        with pytest.raises(ValueError, match="'damping' is needed"):
            mso.thor(_classifier(), **given)
        given["damping"] = 0.1
    default = _config(mso.thor(_classifier()))
    changed = _config(mso.thor(_classifier(), **given))
    assert changed == _config(mso.THOR(**{**mso.thor.DEFAULTS, **given}).connect(_classifier()))
    assert {k for k in default if default[k] != changed[k]} == set(given)


def test_mindspore_arguments_give_mindspore_thor():
    config = _config(mso.thor(_classifier(), 0.1, 0.03, 0.9))
    assert (config["frequency"], config["graft"], config["damping_mode"]) == (100, None, "sqrt")
    assert config == _config(mso.thor(_classifier(), learning_rate=0.1, damping=0.03,
                                      momentum=0.9, preset="mindspore"))
    for given in (dict(learning_rate=0.1), dict(learning_rate=0.1, damping=0.03),
                  dict(momentum=0.9)):
        with pytest.raises(TypeError, match="preset='mindspore'") as error:
            mso.thor(_classifier(), preset="mindspore", **given)
        for name in {"learning_rate", "damping", "momentum"} - set(given):
            assert repr(name) in str(error.value)


def test_preset_default_replaces_all_three_in_the_default():
    given = dict(learning_rate=0.1, damping=0.03, momentum=0.8)
    assert (_config(mso.thor(_classifier(), preset="default", **given))
            == _config(mso.THOR(**{**mso.thor.DEFAULTS, **given}).connect(_classifier())))
    with pytest.raises(ValueError, match="'preset'"):
        mso.thor(_classifier(), preset="adam")


def test_bad_graft_names_the_argument():
    with pytest.raises(ValueError, match="'graft'"):
        mso.thor(_classifier(), graft="sgd")


def test_the_default_trains():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")
    model = _classifier()
    model.compile(optimizer=mso.thor(model), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=5, verbose=0).history
    assert history["loss"][-1] < 0.7 * history["loss"][0]
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


# -- the Arguments table of docs/thor.md, and each option written once ------------------------

def _thor_page():
    with open(os.path.join(REPO_ROOT, "docs", "thor.md")) as f:
        return f.read()


def _documented_value(cell):
    """The literal a cell starts with (its first code span), or None for "(required)"."""
    if cell == "(required)":
        return None
    return ast.literal_eval(re.match(r"`([^`]*)`", cell).group(1))


def test_docs_arguments_table_is_the_code():
    """docs/thor.md's table holds what the code does: one row per option with the default
    configuration's value (``tf_msopt.thor.DEFAULTS`` over MindSpore's) and MindSpore's
    (THOR's own signature), then the rows of ``mso.thor``'s and Keras' own arguments."""
    from tf_msopt.thor.options import arguments_table

    page = _thor_page()
    assert arguments_table() in page
    signature = inspect.signature(mso.THOR.__init__).parameters
    table = page.split("<!-- render:thor_arguments -->\n", 1)[1].split("<!--", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        argument, default, mindspore, _ = (cell.strip() for cell in line.strip("|").split(" | "))
        rows[argument.strip("`")] = tuple(map(_documented_value, (default, mindspore)))
    options = [name for name in signature if name not in ("self", "layers", "name",
                                                          "jit_compile", "kwargs")]
    assert list(rows) == options
    for name in options:
        want = (None if signature[name].default is inspect.Parameter.empty
                else signature[name].default)
        assert rows[name] == (mso.thor.DEFAULTS.get(name, want), want), name
    besides = page.split("`mso.thor` and Keras take these besides:\n\n", 1)[1]
    assert [line.split(" | ")[0] for line in besides.split("\n\n")[0].splitlines()[2:]] == [
        "| `model`", "| `preset`", "| `jit_compile`", "| `name`, Keras keywords"]


def test_docs_arguments_table_fails_when_the_code_differs(monkeypatch):
    """The table is rendered from the entries: where an entry's description, default or preset
    differs from the page, rendering changes the page (which ``render.py --check`` reports)
    and the test above fails."""
    from tf_msopt.thor import options

    render, page = benchmark_module("render"), _thor_page()
    assert render.render_page(page) == page
    for change in (dict(description="another meaning"), dict(default=0.5), dict(preset=0.1)):
        changed = dataclasses.replace(options.OPTIONS[3], **change)
        monkeypatch.setattr(options, "OPTIONS", (*options.OPTIONS[:3], changed,
                                                *options.OPTIONS[4:]))
        assert options.arguments_table() not in page
        assert render.render_page(page) != page, change


#: A toy option, added as one entry: a positive int that THOR keeps and writes to its config.
def _toy_option():
    from tf_msopt._validation import check_int
    from tf_msopt.thor.options import Option

    return Option("toy_steps", 3, lambda value, options: check_int(
        value, "toy_steps", "THOR", min_value=1), "int >= 1: a toy option", preset=5)


def test_a_toy_option_is_one_entry_end_to_end(monkeypatch):
    """Adding an option is one entry of ``OPTIONS``: the constructor takes and checks it, the
    config round-trips it, the default configuration and the docs table show it."""
    from tf_msopt.thor import options

    monkeypatch.setattr(options, "OPTIONS", (*options.OPTIONS, _toy_option()))
    model = _classifier()
    assert mso.thor(model, 0.1, 0.1, 0.9).options.toy_steps == 3      # MindSpore's default
    assert options.default_configuration()["toy_steps"] == 5
    optimizer = mso.thor(model, 0.1, 0.1, 0.9, toy_steps=7)
    assert optimizer.options.toy_steps == 7 and optimizer.get_config()["toy_steps"] == 7
    restored = mso.THOR.from_config(optimizer.get_config())
    assert restored.options.toy_steps == 7 and restored.get_config() == optimizer.get_config()
    for bad, error in ((0, ValueError), ("2", TypeError)):
        with pytest.raises(error, match="'toy_steps'"):
            mso.thor(model, 0.1, 0.1, 0.9, toy_steps=bad)
    assert ("| `toy_steps` | `5` | `3` | int >= 1: a toy option |"
            in options.arguments_table().splitlines())


def test_docs_experimental_table_is_the_code():
    """docs/thor.md's table of experimental options has one row per field of
    ``mso.thor.Experimental``, with its default."""
    with open(os.path.join(REPO_ROOT, "docs", "thor.md")) as f:
        section = f.read().split("### Experimental options\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = {}
    for line in rows:
        field, default, _ = (cell.strip() for cell in line.strip("|").split(" | ", 2))
        documented[field.strip("`")] = _documented_value(default)
    assert documented == {field.name: field.default
                          for field in dataclasses.fields(mso.thor.Experimental)}
