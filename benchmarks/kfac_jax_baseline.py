"""K-FAC baseline for benchmarks/convergence.py: its models trained with kfac-jax.

Only used when ``import kfac_jax`` succeeds; nothing in ``tf_msopt`` needs JAX.
Install beside tensorflow 2.21 / keras 3.15::

    pip install "jax[cpu]==0.9.1" kfac-jax==0.0.8 "tf-keras==2.21.*" mnist1d

(``pip install -e ".[benchmark]"`` installs the same; ``mnist1d`` only generates
convergence.py's MNIST-1D data.)

kfac-jax 0.0.8 is the release checked (its internals move between releases);
it fails on jax >= 0.9.2, hence jax/jaxlib 0.9.1. kfac-jax imports distrax,
hence TensorFlow Probability, which needs ``tf-keras`` matching tensorflow's
minor version once tensorflow is already imported; without it ``import
kfac_jax`` after ``import tensorflow`` raises ModuleNotFoundError.

What it trains (``MODELS``): the ``mlp`` and ``cnn`` of
``tf_msopt.compare.make_model`` and the ``mnist1d`` and ``transformer`` models of
``convergence.make_mnist1d_model`` and ``convergence.make_mnist1d_transformer``,
written as plain JAX functions:

* mlp: 64 standardised features -> Dense(64, relu) -> Dense(64, relu) -> Dense(10).
* mnist_mlp: the same network on 784 features, Dense(256, relu) -> Dense(128, relu)
  -> Dense(10) (``convergence.make_mnist_mlp``).
* cnn: (8, 8, 1) images -> Conv2D(16, 3, same, relu) -> Conv2D(32, 3, stride 2,
  same, relu) -> Flatten -> Dense(64, relu) -> Dense(10). The convolutions are
  ``jax.lax.conv_general_dilated`` in NHWC / HWIO layout with ``padding="SAME"``
  (for stride 2 on 8x8 both Keras and JAX pad 0 rows/columns before and 1
  after), Flatten is a row-major reshape of NHWC, as in Keras.
* mnist1d: (40, 1) sequences -> Conv1D(32, 5, same, relu) -> Conv1D(32, 3,
  stride 2, same, relu) -> Conv1D(32, 3, stride 2, same, relu) -> Flatten ->
  Dense(64, relu) -> Dense(10). Each Conv1D is a Conv2D over a height-1 image:
  input (n, 1, w, c), kernel (1, w, in, out), strides (1, s), ``padding="SAME"``
  (for stride 2 on even lengths both pad 0 before and 1 after). The kernels are
  reshaped to 4-D when the parameters are created, not inside the network:
  kfac-jax's graph matcher only recognises a convolution applied to a parameter
  as it is (reshaped inside, the convolutions were left out of its blocks).
* autoencoder: 784 pixels -> Dense(1000, tanh) -> Dense(500, tanh) -> Dense(250, tanh) ->
  Dense(30) (the linear code) -> Dense(250, tanh) -> Dense(500, tanh) -> Dense(1000, tanh)
  -> Dense(784) (``convergence.make_mnist_autoencoder``); the output sigmoid is folded into
  the loss, registered with ``kfac_jax.register_sigmoid_cross_entropy_loss``. As in
  kfac-jax's own MNIST autoencoder example, the training loss sums the pixels' binary
  cross-entropies (the form that registration assumes) and averages over the batch; the
  validation loss is Keras' ``binary_crossentropy``, the mean over the pixels, so it reads
  as convergence.py's.
* transformer: (40, 1) sequences -> Conv1D(32, 4, stride 2) tokens + learned
  positions (20, 32) -> LayerNormalization -> MultiHeadAttention (2 heads of 16),
  residual -> LayerNormalization -> Dense(64, gelu) -> Dense(32), residual ->
  LayerNormalization -> mean over positions -> Dense(10). The attention is
  Keras' (queries scaled by 1/sqrt(16), softmax over keys); its four EinsumDense
  kernels enter as (32, 32) matrices with the heads merged (see
  ``_transformer_params``), the same numbers in another shape.

``initial_weights`` is the Keras model's ``get_weights()`` list, (kernel, bias)
per layer; Keras kernels are (in, out) for Dense and (h, w, in, out) = HWIO for
Conv2D, so they apply unchanged and both frameworks start from the same weights.
The final softmax is folded into the loss: the network returns logits, the loss
is the mean softmax cross-entropy over the batch (Keras'
``sparse_categorical_crossentropy`` on the softmax output), and the logits are
registered with ``kfac_jax.register_softmax_cross_entropy_loss``.

``tests/test_kfac_jax_baseline.py`` (run where kfac-jax is installed) checks that,
from the Keras models' weights (every array perturbed so that biases and
normalisations matter), softmax of the JAX logits equals ``model.predict`` to
1e-5; a stride-2 convolution padded (1, 1) or (1, 0) instead differs by 1.5, and
tanh-approximated GELU by 7e-5. kfac-jax's graph matcher registers every layer itself (its INFO
log, "Graph parameter registrations" / "BlockDiagonalCurvature blocks", with absl
logging at INFO): cnn -> conv2d_with_bias x2 (Conv2DTwoKroneckerFactored, kernels
(3, 3, 1, 16) and (3, 3, 16, 32)) and dense_with_bias x2
(DenseTwoKroneckerFactored, (512, 64) and (64, 10)); mlp -> dense_with_bias x3;
mnist1d -> conv2d_with_bias x3 ((1, 5, 1, 32), (1, 3, 32, 32) x2) and
dense_with_bias x2 ((320, 64), (64, 10)); transformer -> conv2d_with_bias
((1, 4, 1, 32)), repeated[1]_dense_with_bias x6 (RepeatedDenseKroneckerFactored:
query, key, value, output (32, 32), feed-forward (32, 64) and (64, 32)),
dense_with_bias (32, 10), and ScaleAndShiftDiagonal blocks for the three
LayerNormalizations (scale_and_shift) and the positions (shift_only).
No kernel is left to a generic (diagonal) block, so every kernel gets Kronecker
factors, as under THOR. (THOR leaves the positions to first order and gives the
LayerNormalizations its own rule, so the two differ there.)

The character-level language model of convergence.py (``charlm``) has no JAX version here.

The optimizer is ``kfac_jax.Optimizer`` with a fixed learning rate and damping (or, with
``adaptive=True``, kfac-jax's adaptive mode: see :func:`train_kfac_jax`),
momentum 0.9, no L2, no norm constraint (unless asked for), no burn-in steps
(every step sees one new batch, like Keras). How it differs from THOR
(``tf_msopt.thor``), so the damping values of the two grids are not comparable:

* curvature: kfac-jax updates its Kronecker factors every step
  (``curvature_update_period=1``) as an exponential moving average (decay 0.95)
  and refreshes the inverses every ``max(2, steps_per_epoch // 2)`` steps
  (THOR's ``frequency`` in convergence.py); THOR computes fresh factors from
  one batch every ``frequency`` steps, keeps no average, and captures nothing
  in between.
* estimator: kfac-jax's default ``ggn_curvature_prop`` builds the output factor
  from random vectors propagated through the loss Hessian's square root (a
  GGN / true-Fisher estimate, independent of the labels); THOR's G uses the
  gradients of the actual training loss (empirical Fisher).
* damping: kfac-jax adds it as factored Tikhonov damping with the pi
  adjustment (``sqrt(damping)`` split between the factors by their traces);
  THOR adds ``sqrt(damping)`` to each factor.

Each epoch visits the training set once in a fresh permutation from
``numpy.random.default_rng(seed)`` (the last batch may be smaller, as in Keras'
``fit``; its shape costs one more compilation); validation accuracy is measured
after every epoch, and ``target`` stops training at the first epoch reaching it.
Each epoch is timed from its start to after its validation (the first includes
``optimizer.init`` and the JIT compilations), as convergence.py times Keras'
epochs.

    from kfac_jax_baseline import train_kfac_jax   # benchmarks/ on sys.path
    history = train_kfac_jax("cnn", data, initial_weights, epochs=25, batch_size=64,
                             seed=0, learning_rate=0.03, damping=0.1, target=0.98)

The grids of settings tried per model are convergence.py's ``KFAC_JAX_GRIDS``.
"""
import functools
import time

import jax
import jax.numpy as jnp
import kfac_jax
import numpy as np
import optax
from targets import reaches

__all__ = ["ADAPTIVE_OPTIONS", "MODELS", "logits", "params_from_keras", "predictions",
           "train_kfac_jax"]

MODELS = ("mlp", "cnn", "mnist1d", "transformer", "mnist_mlp", "autoencoder")
MOMENTUM = 0.9
# kfac-jax's adaptive mode needs a first damping and documents none; Martens & Grosse
# (2015) start far higher (150) on autoencoders, where the curvature is larger.
INITIAL_DAMPING = 1.0
# The adaptive mode's settings of kfac-jax's own MNIST autoencoder example (its pipeline's
# kfac options), where they differ from this module's: its curvature_ema 0.95 is already
# kfac-jax's default. Its full batch, burn-in steps and L2 term of 1e-5 are left out: every
# optimizer here sees the same batches of 64 and the same loss.
ADAPTIVE_OPTIONS = {"autoencoder": {"initial_damping": 150.0, "inverse_update_period": 5,
                                    "damping_adaptation_decay": 0.95, "min_damping": 1e-5,
                                    "max_damping": 1000.0}}
# Strides of the leading convolutions of each model (Conv2D for cnn, Conv1D for mnist1d)
# and the number of Dense layers after them.
_CONV_STRIDES = {"mlp": (), "mnist_mlp": (), "cnn": (1, 2), "mnist1d": (1, 2, 2),
                 "autoencoder": ()}
_DENSE_LAYERS = {"mlp": 3, "mnist_mlp": 3, "cnn": 2, "mnist1d": 2, "autoencoder": 8}
# Activations of the hidden Dense layers where they are not all ReLU.
_HIDDEN_ACTIVATIONS = {"autoencoder": (jnp.tanh,) * 3 + (lambda x: x,) + (jnp.tanh,) * 3}
_FLAT_INPUTS = ("mlp", "mnist_mlp", "autoencoder")
# get_weights() of convergence.make_mnist1d_transformer, in order.
_TRANSFORMER_WEIGHTS = (
    "conv_kernel", "conv_bias", "position", "norm1_gamma", "norm1_beta",
    "query_kernel", "query_bias", "key_kernel", "key_bias", "value_kernel", "value_bias",
    "output_kernel", "output_bias", "norm2_gamma", "norm2_beta",
    "hidden_kernel", "hidden_bias", "projection_kernel", "projection_bias",
    "norm3_gamma", "norm3_beta", "logits_kernel", "logits_bias")
_LAYER_NORM_EPSILON = 1e-3           # Keras' LayerNormalization default


def _layer_norm(x, gamma, beta):
    """Keras' LayerNormalization over the last axis; written as ``normalized * gamma + beta``
    so that kfac-jax's scale-and-shift pattern finds it."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + _LAYER_NORM_EPSILON) * gamma + beta


def _transformer_params(weights):
    """The transformer's Keras weights as a dict of JAX arrays, reshaped where kfac-jax
    needs it: the Conv1D kernel to HWIO, and the attention's EinsumDense kernels
    ((32, heads, 16) query, key and value; (heads, 16, 32) output) and biases with their
    head axes merged. kfac-jax 0.0.8's repeated-dense block takes one input and one
    output axis only (with (32, heads, 16) kernels its curvature update fails on a shape
    mismatch), and recognises a kernel only as it is passed in, not reshaped inside."""
    p = {name: np.asarray(w, np.float32) for name, w in zip(_TRANSFORMER_WEIGHTS, weights)}
    p["conv_kernel"] = p["conv_kernel"][None]
    width = p["output_kernel"].shape[-1]
    for name in ("query", "key", "value"):
        p[f"{name}_kernel"] = p[f"{name}_kernel"].reshape(width, -1)
        p[f"{name}_bias"] = p[f"{name}_bias"].reshape(-1)
    p["output_kernel"] = p["output_kernel"].reshape(-1, width)
    return {name: jnp.asarray(w) for name, w in p.items()}


def _transformer_logits(p, x, heads=2):
    """convergence.make_mnist1d_transformer without its softmax, on
    :func:`_transformer_params`' arrays."""
    # Each bias is added to its layer's product before anything else: kfac-jax's patterns
    # then see "dense (or conv) with bias", not a layer without one and a separate shift.
    x = jax.lax.conv_general_dilated(x[:, None], p["conv_kernel"], window_strides=(1, 2),
                                     padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = (x + p["conv_bias"][None, None, None])[:, 0] + p["position"]
    h = _layer_norm(x, p["norm1_gamma"], p["norm1_beta"])
    batch, length, width = h.shape
    query, key, value = ((h @ p[f"{name}_kernel"] + p[f"{name}_bias"]).reshape(
                             batch, length, heads, -1) for name in ("query", "key", "value"))
    query = query / np.float32(np.sqrt(query.shape[-1]))
    scores = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", query, key), axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", scores, value).reshape(batch, length, -1)
    x = x + (attended @ p["output_kernel"] + p["output_bias"])
    h = _layer_norm(x, p["norm2_gamma"], p["norm2_beta"])
    h = jax.nn.gelu(h @ p["hidden_kernel"] + p["hidden_bias"],
                    approximate=False)            # Keras' "gelu" is the exact one
    x = x + (h @ p["projection_kernel"] + p["projection_bias"])
    x = jnp.mean(_layer_norm(x, p["norm3_gamma"], p["norm3_beta"]), axis=1)
    return x @ p["logits_kernel"] + p["logits_bias"]


def params_from_keras(kind, weights):
    """The JAX parameters of ``kind`` from its Keras model's ``get_weights()``.

    Conv1D kernels (w, in, out) become (1, w, in, out) here, not in :func:`logits`:
    kfac-jax's graph matcher only recognises a convolution whose kernel is a parameter
    unchanged."""
    if kind == "transformer":
        return _transformer_params(weights)
    return tuple((jnp.asarray(w[None] if w.ndim == 3 else w, jnp.float32),
                  jnp.asarray(b, jnp.float32))
                 for w, b in zip(weights[::2], weights[1::2]))


def logits(params, x, kind):
    """The Keras model's forward pass up to (not including) the final softmax."""
    if kind == "transformer":
        return _transformer_logits(params, x)
    strides = _CONV_STRIDES[kind]
    one_d = x.ndim == 3                  # (n, length, channels): Conv1D layers
    if one_d:                            # as Conv2D over a height-1 image (see the docstring)
        x = x[:, None]
    for (kernel, bias), stride in zip(params, strides):
        if kernel.ndim == 3:
            kernel = kernel[None]        # Keras' Conv1D kernel (w, in, out) -> HWIO
        x = jax.lax.conv_general_dilated(x, kernel,
                                         window_strides=(1, stride) if one_d else (stride, stride),
                                         padding="SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = jax.nn.relu(x + bias[None, None, None])
    x = x.reshape(x.shape[0], -1)        # Keras' Flatten of NHWC / NWC: row-major
    *hidden, (kernel, bias) = params[len(strides):]
    activations = _HIDDEN_ACTIVATIONS.get(kind, (jax.nn.relu,) * len(hidden))
    for (w, b), activation in zip(hidden, activations):
        x = activation(x @ w + b)
    return x @ kernel + bias


def predictions(params, x, kind):
    """The Keras model's output: softmax of the logits, or for the autoencoder sigmoid."""
    scores = logits(params, x, kind)
    return jax.nn.sigmoid(scores) if kind == "autoencoder" else jax.nn.softmax(scores)


def _loss(params, batch, kind):
    x, y = batch
    scores = logits(params, x, kind)
    if kind == "autoencoder":
        kfac_jax.register_sigmoid_cross_entropy_loss(scores, y)
        return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(scores, y), axis=1))
    kfac_jax.register_softmax_cross_entropy_loss(scores, y)
    log_probs = jax.nn.log_softmax(scores)
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


@functools.partial(jax.jit, static_argnums=3)
def _validation(params, x, y, kind):
    """The accuracy, or for the autoencoder Keras' binary cross-entropy (mean per pixel)."""
    scores = logits(params, x, kind)
    if kind == "autoencoder":
        return jnp.mean(optax.sigmoid_binary_cross_entropy(scores, y))
    return jnp.mean(jnp.argmax(scores, axis=1) == y)


def train_kfac_jax(kind, data, initial_weights, epochs, batch_size, seed, learning_rate=None,
                   damping=None, momentum=MOMENTUM, inverse_update_period=None,
                   curvature_update_period=1, estimation_mode=None, norm_constraint=None,
                   adaptive=False, initial_damping=None, target=None, verbose=0):
    """Trains ``kind`` with ``kfac_jax.Optimizer``; returns the history.

    Args:
        kind: one of :data:`MODELS` (see the module docstring).
        data: ``(x_train, x_val, y_train, y_val)`` as convergence.py's ``load_task``
            returns (flat features for ``mlp``, (n, 8, 8, 1) images for ``cnn``,
            (n, 40, 1) sequences for ``mnist1d`` and ``transformer``).
        initial_weights: the Keras model's ``get_weights()``.
        epochs, batch_size, seed: as for the Keras runs; ``epochs`` is the most run.
        learning_rate, damping, momentum: fixed for the whole run (not with ``adaptive``).
        inverse_update_period: steps between inverse refreshes; None gives
            ``max(2, steps_per_epoch // 2)``, THOR's frequency in convergence.py (in
            the adaptive mode, the model's :data:`ADAPTIVE_OPTIONS` first).
        curvature_update_period: steps between curvature (factor) updates.
        estimation_mode: kfac-jax's curvature estimator; None is its default.
        norm_constraint: kfac-jax's bound on the update's approximate squared
            Fisher norm (None: no bound); 1e-3 keeps large learning rates stable.
        adaptive: kfac-jax's adaptive mode (Martens & Grosse 2015): the learning rate and
            momentum that minimise the quadratic model at every step, and the damping
            adapted by Levenberg-Marquardt from the reduction ratio, starting at
            ``initial_damping`` (None: the model's :data:`ADAPTIVE_OPTIONS`, else
            :data:`INITIAL_DAMPING`), with the model's other :data:`ADAPTIVE_OPTIONS`.
        target: if given, training stops after the first epoch whose validation
            accuracy (the autoencoder's loss) reaches ``target`` (``targets.reaches``,
            as convergence.py's ``StopAtTarget``).
        verbose: 1 prints one line per epoch.

    Returns:
        ``{"val_accuracy": [...], "loss": [...], "epoch_seconds": [...],
        "seconds": [...]}`` (``"val_loss"`` for the autoencoder), one entry per epoch
        run: validation accuracy (loss), mean training loss over the epoch's batches, the
        epoch's wall time (validation included; the first epoch's includes JIT
        compilation, as Keras' ``fit`` includes tracing) and the sum of those up to the
        epoch.
    """
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; choose from {MODELS}")
    if not adaptive and (learning_rate is None or damping is None):
        raise ValueError("learning_rate and damping are needed unless adaptive=True")
    x_train, x_val, y_train, y_val = (np.asarray(a) for a in data)
    if kind in _FLAT_INPUTS:
        x_train, x_val = x_train.reshape(len(x_train), -1), x_val.reshape(len(x_val), -1)
    elif kind == "cnn" and x_train.ndim != 4:
        raise ValueError(f"{kind}: expected images (n, height, width, channels), "
                         f"got x_train of shape {x_train.shape}")
    elif kind in ("mnist1d", "transformer") and x_train.ndim != 3:
        raise ValueError(f"{kind}: expected sequences (n, length, channels), "
                         f"got x_train of shape {x_train.shape}")
    x_train, x_val = x_train.astype(np.float32), x_val.astype(np.float32)
    labels = np.float32 if kind == "autoencoder" else np.int32
    y_train, y_val = y_train.astype(labels), y_val.astype(labels)
    expected = (len(_TRANSFORMER_WEIGHTS) if kind == "transformer"
                else 2 * (len(_CONV_STRIDES[kind]) + _DENSE_LAYERS[kind]))
    if len(initial_weights) != expected:
        raise ValueError(f"initial_weights: expected the {expected} arrays of the {kind}'s "
                         f"get_weights(), got {len(initial_weights)}")
    steps_per_epoch = -(-len(x_train) // batch_size)
    options = dict(ADAPTIVE_OPTIONS.get(kind, {})) if adaptive else {}
    kind_damping = options.pop("initial_damping", INITIAL_DAMPING)
    initial_damping = kind_damping if initial_damping is None else initial_damping
    options.setdefault("inverse_update_period", max(2, steps_per_epoch // 2))
    if inverse_update_period is not None:
        options["inverse_update_period"] = inverse_update_period
    metric = "val_loss" if kind == "autoencoder" else "val_accuracy"

    params = params_from_keras(kind, initial_weights)
    x_val_j, y_val_j = jnp.asarray(x_val), jnp.asarray(y_val)
    optimizer = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(functools.partial(_loss, kind=kind)),
        l2_reg=0.0,
        use_adaptive_learning_rate=adaptive,
        use_adaptive_momentum=adaptive,
        use_adaptive_damping=adaptive,
        initial_damping=initial_damping if adaptive else None,
        norm_constraint=norm_constraint,
        num_burnin_steps=0,
        curvature_update_period=curvature_update_period,
        estimation_mode=estimation_mode,
        multi_device=False,
        **options,
    )
    rng = jax.random.PRNGKey(seed)
    rng, init_rng = jax.random.split(rng)
    order_rng = np.random.default_rng(seed)
    hyper = {} if adaptive else {"learning_rate": jnp.asarray(learning_rate, jnp.float32),
                                 "momentum": jnp.asarray(momentum, jnp.float32),
                                 "damping": jnp.asarray(damping, jnp.float32)}

    state = None
    history = {metric: [], "loss": [], "epoch_seconds": [], "seconds": []}
    for epoch in range(epochs):
        start = time.perf_counter()
        order = order_rng.permutation(len(x_train))
        loss_sum = 0.0
        for step in range(steps_per_epoch):
            rows = order[step * batch_size:(step + 1) * batch_size]
            batch = (jnp.asarray(x_train[rows]), jnp.asarray(y_train[rows]))
            if state is None:
                state = optimizer.init(params, init_rng, batch)
            rng, step_rng = jax.random.split(rng)
            params, state, stats = optimizer.step(params, state, step_rng, batch=batch, **hyper)
            loss_sum += float(stats["loss"]) * len(rows)
        history["loss"].append(loss_sum / len(x_train))
        history[metric].append(float(_validation(params, x_val_j, y_val_j, kind)))
        history["epoch_seconds"].append(time.perf_counter() - start)
        history["seconds"].append(sum(history["epoch_seconds"]))
        if verbose:
            print(f"epoch {epoch + 1}: loss {history['loss'][-1]:.4f} "
                  f"{metric} {history[metric][-1]:.4f} "
                  f"{history['seconds'][-1]:.2f}s", flush=True)
        if target is not None and reaches(history[metric][-1], target, metric):
            break
    return history
