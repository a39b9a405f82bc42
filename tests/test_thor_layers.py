"""Which layers of real architectures THOR covers: attention, wrappers, nested models,
keras.applications.ResNet50; nothing is skipped silently."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import curvature_variables, kernel_gradients
from test_thor_training import assert_weights_close

import tf_msopt as mso


def assert_every_variable_reported(model, report):
    assert {row.variable for row in report.rows} == {v.path for v in model.trainable_variables}


def kernels(model, kinds):
    return sorted(v.path for layer in model._flatten_layers() if isinstance(layer, kinds)
                  for v in [getattr(layer, "kernel", None)] if v is not None)


def train_briefly(model, optimizer, x, y, steps=3, run_eagerly=False):
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  run_eagerly=run_eagerly)
    history = model.fit(x, y, batch_size=len(x) // steps, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()
    return history.history["loss"][-1]


def transformer_block(width=16, heads=2):
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(11, width)(tokens)
    attended = keras.layers.MultiHeadAttention(heads, width // heads)(h, h)
    h = keras.layers.LayerNormalization()(h + attended)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(
        keras.layers.Dense(2 * width, activation="relu")(h)))
    return keras.Model(tokens, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))


def test_multi_head_attention_kernels_are_kronecker_factored():
    model = transformer_block()
    optimizer = mso.thor(model, 0.05, 0.1, 0.9, frequency=2)
    report = optimizer.report()
    assert_every_variable_reported(model, report)
    attention = model.layers[2]
    projections = [attention._query_dense, attention._key_dense, attention._value_dense,
                   attention._output_dense]
    for projection in projections:
        rule = next(row.rule for row in report.rows if row.variable == projection.kernel.path)
        assert rule.startswith("Kronecker factors"), rule
    assert (sorted(kernels(model, (keras.layers.EinsumDense, keras.layers.Dense)))
            == sorted(p for p in report.preconditioned if p.endswith("kernel")))
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, size=(24, 6)), rng.integers(0, 3, size=24)
    train_briefly(model, optimizer, x, y)
    assert int(optimizer.failed_inverses.numpy()) == 0
    for inverse in curvature_variables(optimizer, "g_inverse"):           # all refreshed
        assert not np.allclose(inverse.numpy(), np.eye(inverse.shape[-1]))


def test_wrappers_and_nested_models_are_walked_into():
    inner = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="nested_dense")],
                             name="nested")
    sequence = keras.Input((3, 5))
    h = keras.layers.TimeDistributed(keras.layers.Dense(5, name="per_step"))(sequence)
    h = keras.layers.TimeDistributed(inner)(h)
    h = keras.layers.Bidirectional(keras.layers.LSTM(3, name="lstm"))(h)
    model = keras.Model(sequence, keras.layers.Dense(2, name="head")(h))
    optimizer = mso.thor(model, 0.05, 0.1, 0.9, frequency=2)
    report = optimizer.report()
    assert_every_variable_reported(model, report)
    preconditioned = set(report.preconditioned)
    for name in ("per_step", "nested_dense", "head"):
        layer = next(l for l in model._flatten_layers() if l.name == name)
        assert layer.kernel.path in preconditioned
    for direction in ("forward", "backward"):    # Bidirectional's copies of the LSTM
        layer = model.layers[3].forward_layer if direction == "forward" else (
            model.layers[3].backward_layer)
        assert {layer.cell.kernel.path, layer.cell.recurrent_kernel.path} <= preconditioned
        assert "LSTM kernel only" in report.first_order[layer.cell.bias.path]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 3, 5)).astype("float32"), rng.integers(0, 2, size=24)
    before = [b.a.numpy().copy() for b in optimizer._model_link.connection.statistics]
    train_briefly(model, optimizer, x, y)
    # every treated layer's capture ran (TimeDistributed calls the inner layer's call)
    for old, buffer in zip(before, optimizer._model_link.connection.statistics):
        assert not np.array_equal(old, buffer.a.numpy())


@pytest.mark.slow
def test_resnet50_every_conv_and_dense_kernel_preconditioned():
    """Eager fit: the same update code without 40 s of tracing a 54-layer graph (the traced
    Conv2D/Dense capture is checked on small models; benchmarks/thor_step.py traces ResNet50)."""
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=4)
    optimizer = mso.thor(model, 0.01, 0.3, 0.9, frequency=2)
    report = optimizer.report()
    assert_every_variable_reported(model, report)
    expected = kernels(model, (keras.layers.Conv2D, keras.layers.Dense))
    assert len(expected) == 54
    assert expected == sorted(p for p in report.preconditioned if p.endswith("kernel"))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 32, 32, 3)).astype("float32"), rng.integers(0, 4, size=6)
    train_briefly(model, optimizer, x, y, run_eagerly=True)
    assert int(optimizer.iterations.numpy()) == 3
    assert int(optimizer.failed_inverses.numpy()) == 0


@pytest.mark.parametrize("application, size, has", [
    ("ConvNeXtTiny", 32, lambda layer: isinstance(layer, keras.layers.Conv2D) and layer.groups > 1),
    ("Xception", 71, lambda layer: isinstance(layer, keras.layers.SeparableConv2D))])
def test_applications_with_grouped_or_separable_convolutions_fully_preconditioned(
        application, size, has):
    """ConvNeXt's depthwise convolutions (grouped Conv2D) and Xception's separable ones are
    preconditioned with every other convolution and Dense kernel."""
    model = getattr(keras.applications, application)(weights=None, input_shape=(size, size, 3),
                                                     classes=4)
    report = mso.thor(model).report()
    assert_every_variable_reported(model, report)
    layers = [layer for layer in model._flatten_layers()
              if isinstance(layer, (keras.layers.Conv2D, keras.layers.SeparableConv2D,
                                    keras.layers.Dense))]
    assert any(has(layer) for layer in layers)
    kernel_paths = sorted(v.path for layer in layers for v in layer.trainable_variables
                          if v.name.endswith("kernel"))
    assert kernel_paths == sorted(p for p in report.preconditioned if p.endswith("kernel"))


# -- transposed, separable and grouped convolutions ------------------------------------------

IMAGES = np.random.default_rng(6).uniform(size=(48, 8, 8, 1)).astype("float32")


def conv_autoencoder():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="tanh", name="down"),
        keras.layers.SeparableConv2D(4, 3, padding="same", activation="tanh", name="middle"),
        keras.layers.Conv2D(4, 3, padding="same", groups=2, activation="tanh", name="grouped"),
        keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same", activation="tanh",
                                     name="up"),
        keras.layers.Conv2DTranspose(1, 3, padding="same", activation="sigmoid", name="out")])


def autoencoder_run(steps=6, strategy=None, wrap=None, build=conv_autoencoder, images=IMAGES,
                    **compile_options):
    """The default THOR (refresh every 2 steps) on the autoencoder ``build()``, ``steps``
    batches of 8 ``images``."""
    with (strategy or tf.distribute.get_strategy()).scope():
        model = build()
        optimizer = mso.thor(model, frequency=2)
        model.compile(optimizer=optimizer if wrap is None else wrap(optimizer),
                      loss="binary_crossentropy", **compile_options)
    x = images[:8 * steps]
    model.fit(x, x, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model, optimizer


def test_transposed_separable_and_grouped_convolutions_are_kronecker_factored():
    model = conv_autoencoder()
    report = mso.thor(model).report()
    assert_every_variable_reported(model, report)
    middle = model.get_layer("middle")
    assert sorted(report.preconditioned) == sorted(kernels(
        model, (keras.layers.Conv2D, keras.layers.Conv2DTranspose)) + [
        middle.depthwise_kernel.path, middle.pointwise_kernel.path])
    text = str(report)
    assert "4 channel(s), A 9x9, G 1x1 each" in text               # middle: depthwise
    assert "A 4x4 in 1 block(s), G 4x4 in 1 block(s)" in text       # middle: pointwise
    assert "2 group(s), A 18x18, G 2x2 each" in text                 # grouped: 3x3x2 in
    assert "A 4x4 in 1 block(s), G 27x27 in 1 block(s)" in text     # up: 4 in, 3x3x3 out
    assert "A 3x3 in 1 block(s), G 9x9 in 1 block(s)" in text       # out: 3 in, 3x3x1 out


@pytest.mark.equivalence
def test_convolution_kinds_two_replicas_loss_scaling_and_xla_equal_one_device(
        two_cpu_strategy):
    """The default on transposed, separable and grouped convolutions: two replicas on the
    global batch inside a LossScaleOptimizer, and an XLA-compiled step, equal one device."""
    plain, optimizer = autoencoder_run()
    assert optimizer.curvature["up"].count.numpy() == 6
    mirrored, _ = autoencoder_run(strategy=two_cpu_strategy,
                                  wrap=lambda o: mso.LossScaleOptimizer(o, 2.0 ** 8))
    compiled, _ = autoencoder_run(jit_compile=True)
    for other in (mirrored, compiled):
        assert_weights_close(other.get_weights(), plain.get_weights(), rtol=1e-5)


@pytest.mark.equivalence
def test_convolution_kinds_resume_exactly(tmp_path):
    whole, _ = autoencoder_run()
    model, _ = autoencoder_run(steps=3)
    path = str(tmp_path / "autoencoder.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    mso.thor.connect(loaded)
    loaded.fit(IMAGES[24:48], IMAGES[24:48], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(loaded.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(loaded.optimizer.variables, whole.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)


# -- each convolution kind against an equivalent one, and its rows against its gradient -----

def separable_pair(seed=0):
    """A SeparableConv2D model and the same computation as a DepthwiseConv2D and a 1x1
    Conv2D, with the same weights."""
    keras.utils.set_random_seed(seed)
    separable = keras.Sequential([
        keras.Input((7, 7, 3)),
        keras.layers.SeparableConv2D(4, 3, strides=2, padding="same", depth_multiplier=2,
                                     activation="tanh", name="separable"),
        keras.layers.Flatten(), keras.layers.Dense(2, name="head")])
    split = keras.Sequential([
        keras.Input((7, 7, 3)),
        keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2,
                                     use_bias=False, name="depthwise"),
        keras.layers.Conv2D(4, 1, activation="tanh", name="pointwise"),
        keras.layers.Flatten(), keras.layers.Dense(2, name="head")])
    layer = separable.get_layer("separable")
    split.get_layer("depthwise").set_weights([layer.depthwise_kernel.numpy()])
    split.get_layer("pointwise").set_weights([layer.pointwise_kernel.numpy(),
                                              layer.bias.numpy()])
    split.get_layer("head").set_weights(separable.get_layer("head").get_weights())
    return separable, split


#: Each kind with the exponent of its counterpart in the split model.
EXPONENTS = {"separable_depthwise": 0.25, "depthwise_conv": 0.25, "separable_pointwise": 0.75,
             "conv": 0.75}
SEPARABLE_OPTIONS = {
    "default": dict(eigenbasis_exponent=EXPONENTS),
    "subsampled": dict(eigenbasis_exponent=EXPONENTS, statistics_rows=40),
    "mindspore": dict(preset="mindspore", learning_rate=0.1, damping=0.03, momentum=0.9),
}


@pytest.mark.parametrize("options", SEPARABLE_OPTIONS.values(), ids=SEPARABLE_OPTIONS.keys())
@pytest.mark.equivalence
def test_separable_convolution_trains_as_depthwise_then_pointwise(two_cpu_strategy, options):
    """A SeparableConv2D's two blocks are the DepthwiseConv2D's and the 1x1 Conv2D's of the
    same computation: the same weights on one device and on two replicas (to the bit where
    TensorFlow's separable kernel sums as the two layers' do; oneDNN's does here)."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(32, 7, 7, 3)), rng.normal(size=(32, 2))

    def train(built, strategy):
        with strategy.scope():
            model = keras.models.clone_model(built)
            model.set_weights(built.get_weights())
            optimizer = mso.thor(model, frequency=2, **options)
            model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return model, optimizer

    for strategy in (tf.distribute.get_strategy(), two_cpu_strategy):
        separable, split = separable_pair()
        initial = separable.get_layer("separable").depthwise_kernel.numpy()
        separable, optimizer = train(separable, strategy)
        split, _ = train(split, strategy)
        assert sorted(optimizer.curvature) == ["head", "separable_depthwise_kernel",
                                               "separable_pointwise_kernel"]
        layer = separable.get_layer("separable")
        assert not np.array_equal(layer.depthwise_kernel.numpy(), initial)
        for got, want in ((layer.depthwise_kernel, split.get_layer("depthwise").kernel),
                          (layer.pointwise_kernel, split.get_layer("pointwise").kernel),
                          (separable.get_layer("head").kernel, split.get_layer("head").kernel)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=got.path)


def siamese(shared):
    """Two inputs through one Dense encoder and a head: the encoder called on each input
    (``shared``) or once on both stacked along the batch, the same computation."""
    keras.utils.set_random_seed(0)
    pair = [keras.Input((5,)), keras.Input((5,))]
    encoder = keras.layers.Dense(6, activation="tanh", name="encoder")
    if shared:
        sides = [encoder(side) for side in pair]
    else:
        stacked = encoder(keras.layers.Concatenate(axis=0)(pair))
        sides = keras.layers.Lambda(lambda t: tf.split(t, 2))(stacked)
    return keras.Model(pair, keras.layers.Dense(3, name="head")(
        keras.layers.Concatenate()(list(sides))))


SHARED_OPTIONS = {
    "default": {},
    # MindSpore's form scales G, which the sampled Fisher takes per example of the model
    # (the stacked encoder's gradient rows would count twice the batch in the empirical one)
    "mindspore sampled": dict(preset="mindspore", learning_rate=0.1, damping=0.03, momentum=0.9,
                              fisher="sampled", seed=0),
}


@pytest.mark.parametrize("options", SHARED_OPTIONS.values(), ids=SHARED_OPTIONS.keys())
@pytest.mark.equivalence
def test_shared_layer_trains_as_one_call_on_every_input(two_cpu_strategy, options):
    """A layer called on two inputs (shared weights) counts the rows of both calls: the
    weights of one call on both inputs stacked, on one device and on two replicas."""
    rng = np.random.default_rng(3)
    x = [rng.normal(size=(32, 5)).astype("float32") for _ in range(2)]
    y = rng.integers(0, 3, size=32)

    def train(shared, strategy):
        with strategy.scope():
            model = siamese(shared)
            optimizer = mso.thor(model, frequency=2, **options)
            model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return model

    initial = siamese(True).get_weights()
    for strategy in (tf.distribute.get_strategy(), two_cpu_strategy):
        shared, stacked = train(True, strategy), train(False, strategy)
        assert not np.allclose(shared.get_weights()[0], initial[0])
        assert_weights_close(shared.get_weights(), stacked.get_weights(), rtol=1e-5)


def test_a_layer_two_models_share_feeds_the_thor_of_the_model_trained():
    """Two models share a layer, each connected to its own THOR before either trains: each
    trains as it would without the other model's THOR."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 5)).astype("float32")
    labels = rng.integers(0, 3, size=32)

    def models():
        keras.utils.set_random_seed(0)
        shared = keras.layers.Dense(6, activation="tanh", name="shared")
        return (keras.Sequential([keras.Input((5,)), shared, keras.layers.Dense(3)]),
                keras.Sequential([keras.Input((5,)), shared, keras.layers.Dense(5)]))

    def fit(model, optimizer, classify):
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True) if classify else "mse")
        model.fit(x, labels if classify else x, batch_size=8, epochs=1, shuffle=False,
                  verbose=0)
        return model.get_weights()

    classifier, reconstruction = models()
    optimizers = [mso.thor(model, frequency=2) for model in (classifier, reconstruction)]
    got = [fit(classifier, optimizers[0], True)]
    start = reconstruction.get_weights()
    got.append(fit(reconstruction, optimizers[1], False))

    # Each from a pair of its own: no other model of its layer has a THOR.
    classifier_alone, reconstruction_alone = models()[0], models()[1]
    reconstruction_alone.set_weights(start)
    want = [fit(model, mso.thor(model, frequency=2), classify) for model, classify in (
        (classifier_alone, True), (reconstruction_alone, False))]
    for got_weights, want_weights in zip(got, want):
        assert_weights_close(got_weights, want_weights, rtol=0)


@pytest.mark.parametrize("layer, shape", [
    (keras.layers.SeparableConv2D(4, 3, padding="same", depth_multiplier=2,
                                  data_format="channels_first"), (2, 3, 6, 5)),
    (keras.layers.SeparableConv2D(4, 3, strides=2, dilation_rate=1), (2, 7, 6, 3)),
    (keras.layers.SeparableConv1D(4, 3, strides=2, padding="same", depth_multiplier=2),
     (2, 9, 3)),
])
def test_separable_kernel_gradients_are_their_rows_products(layer, shape):
    """The rows each block of a separable convolution averages multiply to its kernel's
    gradient: the depthwise kernel's per channel, the pointwise kernel's as a matrix."""
    from tf_msopt.thor.curvature_blocks import SeparableDepthwiseBlock, conv_patches

    layer.build(shape)
    depthwise_block, pointwise_block = SeparableDepthwiseBlock.blocks_of(layer)
    seen = {}

    def observe(outputs, pieces):
        seen["pieces"] = pieces
        return outputs

    _, delta, gradients = kernel_gradients(
        layer, shape, ["depthwise_kernel", "pointwise_kernel"], seed=5,
        call=lambda x: depthwise_block.capture(layer, layer.call, observe, x))
    (inputs, depthwise_delta), (depthwise_output, _) = seen["pieces"](delta)
    channels, multiplier = depthwise_block.channels, depthwise_block.g_dim
    patches = tf.reshape(conv_patches(layer, inputs), [-1, depthwise_block.a_dim, channels])
    if layer.data_format == "channels_first":
        depthwise_delta = tf.transpose(depthwise_delta, [0, 2, 3, 1])
    rows = tf.reshape(depthwise_delta, [-1, channels, multiplier])
    products = [tf.einsum("rac,rcm->acm", patches, rows),
                tf.matmul(pointwise_block.input_rows(layer, depthwise_output),
                          pointwise_block.output_rows(layer, delta), transpose_a=True)]
    for product, gradient in zip(products, gradients):
        np.testing.assert_allclose(tf.reshape(product, gradient.shape).numpy(),
                                   gradient.numpy(), rtol=1e-5, atol=1e-5)


def test_grouped_convolution_with_a_channel_per_group_trains_as_depthwise():
    """A Conv2D with one input channel per group is a DepthwiseConv2D: the same weights
    under the default."""
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(32, 6, 6, 3)), rng.normal(size=(32, 2))

    def model_with(convolution):
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6, 6, 3)), convolution, keras.layers.Flatten(),
                                 keras.layers.Dense(2, name="head")])

    depthwise = model_with(keras.layers.DepthwiseConv2D(3, strides=2, depth_multiplier=2,
                                                        activation="tanh", name="conv"))
    grouped = model_with(keras.layers.Conv2D(6, 3, strides=2, groups=3, activation="tanh",
                                             name="conv"))
    kernel, bias = depthwise.get_layer("conv").get_weights()
    grouped.get_layer("conv").set_weights([kernel.reshape(3, 3, 1, 6), bias])
    grouped.get_layer("head").set_weights(depthwise.get_layer("head").get_weights())
    for model in (depthwise, grouped):
        model.compile(optimizer=mso.thor(model, frequency=2), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(grouped.get_layer("conv").kernel.numpy(),
                               depthwise.get_layer("conv").kernel.numpy().reshape(3, 3, 1, 6),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grouped.get_layer("head").kernel.numpy(),
                               depthwise.get_layer("head").kernel.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer, shape", [
    (keras.layers.Conv2D(6, (3, 2), strides=2, padding="same", groups=2), (2, 7, 6, 4)),
    (keras.layers.Conv1D(4, 3, padding="causal", groups=2, dilation_rate=2), (2, 9, 6)),
    (keras.layers.DepthwiseConv1D(3, strides=2, padding="same", depth_multiplier=2), (2, 9, 3)),
])
def test_grouped_kernel_gradient_is_each_groups_rows_product(layer, shape):
    """Each group's patches times its output gradient is its slice of the kernel's gradient,
    and the group's factors average those rows (a depthwise layer: a group per channel)."""
    from tf_msopt.thor.curvature_blocks import blocks_for, conv_patches

    x, delta, (gradient,) = kernel_gradients(layer, shape, ["kernel"], seed=9)
    (block,), reason, _ = blocks_for(layer)
    assert reason is None
    groups, group_channels = block.channels, block.group_channels
    patches = tf.reshape(conv_patches(layer, x), [-1, block.a_dim // group_channels, groups,
                                                  group_channels])
    patches = tf.reshape(tf.transpose(patches, [0, 2, 1, 3]), [-1, groups, block.a_dim])
    rows = tf.reshape(delta, [-1, groups, block.g_dim])
    product = tf.einsum("rca,rcg->acg", patches, rows)
    np.testing.assert_allclose(tf.reshape(product, gradient.shape).numpy(), gradient.numpy(),
                               rtol=1e-5, atol=1e-5)
    a, g, count = block.statistics(layer, x, delta, None)
    np.testing.assert_allclose(a.numpy(), tf.einsum("rca,rcb->cab", patches, patches).numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g.numpy(), tf.einsum("rca,rcb->cab", rows, rows).numpy(),
                               rtol=1e-5, atol=1e-5)
    assert count == patches.shape[0]


def volume_model(dilation=1, size=6):
    """A 3D autoencoder: stride 2, or (Keras allows one or the other) dilation 2."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((size, size, size, 1)),
        keras.layers.Conv3D(3, 3, strides=3 - dilation, padding="same", dilation_rate=dilation,
                            activation="tanh", name="down"),
        keras.layers.Conv3DTranspose(1, 3, strides=3 - dilation, padding="same",
                                     activation="sigmoid", name="up")])


@pytest.mark.equivalence
def test_3d_convolutions_two_replicas_equal_one_device(two_cpu_strategy):
    """Conv3D and Conv3DTranspose kernels are Kronecker-factored; the default trains them
    alike on one device and on two replicas."""
    volumes = np.random.default_rng(10).uniform(size=(32, 6, 6, 6, 1)).astype("float32")
    plain, optimizer = autoencoder_run(4, build=volume_model, images=volumes)
    assert sorted(optimizer.report().preconditioned) == kernels(
        plain, (keras.layers.Conv3D, keras.layers.Conv3DTranspose))
    assert optimizer.curvature["up"].count.numpy() == 4
    mirrored, _ = autoencoder_run(4, two_cpu_strategy, build=volume_model, images=volumes)
    assert_weights_close(mirrored.get_weights(), plain.get_weights(), rtol=1e-5)


def test_dilated_3d_convolution_over_unknown_sizes_is_first_order():
    """With spatial sizes unknown until the step, a dilated Conv3D's patches would need
    TensorFlow's volume patches, which have no dilation: it says so and stays first order."""
    model = volume_model(dilation=2, size=None)
    report = mso.thor(model).report()
    assert "dilated 3D convolution over inputs of unknown size" in report.first_order[
        model.get_layer("down").kernel.path]
    assert model.get_layer("up").kernel.path in report.preconditioned
