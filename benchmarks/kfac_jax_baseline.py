"""K-FAC baseline for benchmarks/convergence.py: its three models trained with kfac-jax.

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
``tf_msopt.compare.make_model`` and the ``mnist1d`` model of
``convergence.make_mnist1d_model``, written as plain JAX functions:

* mlp: 64 standardised features -> Dense(64, relu) -> Dense(64, relu) -> Dense(10).
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

``initial_weights`` is the Keras model's ``get_weights()`` list, (kernel, bias)
per layer; Keras kernels are (in, out) for Dense and (h, w, in, out) = HWIO for
Conv2D, so they apply unchanged and both frameworks start from the same weights.
The final softmax is folded into the loss: the network returns logits, the loss
is the mean softmax cross-entropy over the batch (Keras'
``sparse_categorical_crossentropy`` on the softmax output), and the logits are
registered with ``kfac_jax.register_softmax_cross_entropy_loss``.

Checked once (a one-off script, not part of this module): from the Keras
models' weights (biases perturbed so that they matter), softmax of the JAX
logits equals ``model.predict`` on 16 validation samples to 3e-8 (mlp), 2e-8
(cnn) and 3e-8 (mnist1d); a stride-2 convolution padded (1, 1) or (1, 0) instead
differs by 1.5. kfac-jax's graph matcher registers every layer itself (its INFO
log, "Graph parameter registrations" / "BlockDiagonalCurvature blocks", with absl
logging at INFO): cnn -> conv2d_with_bias x2 (Conv2DTwoKroneckerFactored, kernels
(3, 3, 1, 16) and (3, 3, 16, 32)) and dense_with_bias x2
(DenseTwoKroneckerFactored, (512, 64) and (64, 10)); mlp -> dense_with_bias x3;
mnist1d -> conv2d_with_bias x3 ((1, 5, 1, 32), (1, 3, 32, 32) x2) and
dense_with_bias x2 ((320, 64), (64, 10)).
No parameter is left to a generic (diagonal) block, so every layer gets
Kronecker factors, as under THOR.

The optimizer is ``kfac_jax.Optimizer`` with a fixed learning rate and damping,
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

    from kfac_jax_baseline import MODELS, grid, train_kfac_jax   # benchmarks/ on sys.path
    for label, kwargs in grid("cnn"):
        history = train_kfac_jax("cnn", data, initial_weights, epochs=25, batch_size=64,
                                 seed=0, target=0.98, **kwargs)
"""
import functools
import time

import jax
import jax.numpy as jnp
import kfac_jax
import numpy as np

__all__ = ["MODELS", "grid", "train_kfac_jax"]

MODELS = ("mlp", "cnn", "mnist1d")
MOMENTUM = 0.9
# Strides of the leading convolutions of each model (Conv2D for cnn, Conv1D for mnist1d)
# and the number of Dense layers after them.
_CONV_STRIDES = {"mlp": (), "cnn": (1, 2), "mnist1d": (1, 2, 2)}
_DENSE_LAYERS = {"mlp": 3, "cnn": 2, "mnist1d": 2}
_GRIDS = {  # (learning rates, dampings); see grid()
    "mlp": ((0.01, 0.03, 0.1), (0.1, 0.3, 1.0)),
    "cnn": ((0.02, 0.03, 0.05), (0.05, 0.1, 0.2)),
    "mnist1d": ((0.001, 0.003, 0.01), (0.003, 0.01, 0.03)),
}


def grid(kind):
    """(setting label, keyword arguments of :func:`train_kfac_jax`) pairs to try for ``kind``.

    Learning rate x damping, nine settings, as THOR's grid in convergence.py.
    mlp: on digits at batch 64 the best setting is the middle one, lr=0.03
    damping=0.3; at batch 256 it is lr=0.1 damping=0.1, where the settings beyond
    it (lr 0.3, or damping 0.03) diverge without a norm constraint.
    cnn: probed on seed 0, batch 64, target 0.98, 15 epochs at most. Only
    lr=0.03 damping=0.1, the middle setting, reached it (epoch 5); lr 0.02 with
    damping 0.05 or 0.1, lr 0.03 damping 0.2 and lr 0.05 damping 0.2 level off at
    0.97-0.978; lr 0.03 damping 0.05 and lr 0.05 damping 0.1 diverge
    (lr 0.05 damping 0.05 was not run). So 0.98 is barely within kfac-jax's reach
    on this split; learning rate / damping >= 0.5 diverged. Outside the grid: lr 0.01
    (damping 0.03 or 0.1) and lr 0.03 damping 0.3 level off at 0.97, lr 0.1
    (damping 0.1 or 0.3) and lr 0.03 damping 0.03 diverge or oscillate.
    mnist1d (target 0.90, seeds 0-2, 12 epochs at most): over lr 0.01-0.1 x damping
    0.1-1.0 the best was lr=0.01 damping=0.1 (6 epochs, a corner); lr=0.03 damping=0.3
    and lr=0.1 damping=1.0 took 8, the rest missed on at least two seeds. Moving the
    grid towards smaller values twice, each time the best setting sat on its edge
    (lr=0.01 damping=0.03: 5 epochs), found lr=0.003 damping=0.01 (4, 3, 4 epochs),
    inside the grid; along the same ratio, lr=0.001 damping=0.003 took 4 (4, 5, 4)
    and lr=0.01 damping=0.03 5 (benchmarks/results/mnist1d_kfac*.json hold every run).
    """
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; choose from {MODELS}")
    learning_rates, dampings = _GRIDS[kind]
    return [(f"lr={lr} damping={damping}", {"learning_rate": lr, "damping": damping})
            for lr in learning_rates for damping in dampings]


def _logits(params, x, kind):
    """The Keras model's forward pass up to (not including) the final softmax."""
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
    for w, b in hidden:
        x = jax.nn.relu(x @ w + b)
    return x @ kernel + bias


def _loss(params, batch, kind):
    x, y = batch
    logits = _logits(params, x, kind)
    kfac_jax.register_softmax_cross_entropy_loss(logits, y)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


@functools.partial(jax.jit, static_argnums=3)
def _accuracy(params, x, y, kind):
    return jnp.mean(jnp.argmax(_logits(params, x, kind), axis=1) == y)


def train_kfac_jax(kind, data, initial_weights, epochs, batch_size, seed, learning_rate, damping,
                   momentum=MOMENTUM, inverse_update_period=None, curvature_update_period=1,
                   estimation_mode=None, norm_constraint=None, target=None, verbose=0):
    """Trains ``kind`` (``"mlp"`` or ``"cnn"``) with ``kfac_jax.Optimizer``; returns the history.

    Args:
        kind: one of :data:`MODELS`, the model of ``tf_msopt.compare.make_model``.
        data: ``(x_train, x_val, y_train, y_val)`` as
            ``tf_msopt.compare.prepare(kind, load_digits_split(seed))`` returns
            (flat features for ``mlp``, (n, 8, 8, 1) images for ``cnn``).
        initial_weights: the Keras model's ``get_weights()``.
        epochs, batch_size, seed: as for the Keras runs; ``epochs`` is the most run.
        learning_rate, damping, momentum: fixed for the whole run.
        inverse_update_period: steps between inverse refreshes; None gives
            ``max(2, steps_per_epoch // 2)``, THOR's frequency in convergence.py.
        curvature_update_period: steps between curvature (factor) updates.
        estimation_mode: kfac-jax's curvature estimator; None is its default.
        norm_constraint: kfac-jax's bound on the update's approximate squared
            Fisher norm (None: no bound); 1e-3 keeps large learning rates stable.
        target: if given, training stops after the first epoch whose validation
            accuracy is >= ``target`` (as convergence.py's ``StopAtTarget``).
        verbose: 1 prints one line per epoch.

    Returns:
        ``{"val_accuracy": [...], "loss": [...], "epoch_seconds": [...],
        "seconds": [...]}``, one entry per epoch run: validation accuracy, mean
        training loss over the epoch's batches, the epoch's wall time (validation
        included; the first epoch's includes JIT compilation, as Keras' ``fit``
        includes tracing) and the sum of those up to the epoch.
    """
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; choose from {MODELS}")
    x_train, x_val, y_train, y_val = (np.asarray(a) for a in data)
    if kind == "mlp":
        x_train, x_val = x_train.reshape(len(x_train), -1), x_val.reshape(len(x_val), -1)
    elif kind == "cnn" and x_train.ndim != 4:
        raise ValueError(f"{kind}: expected images (n, height, width, channels), "
                         f"got x_train of shape {x_train.shape}")
    elif kind == "mnist1d" and x_train.ndim != 3:
        raise ValueError(f"{kind}: expected sequences (n, length, channels), "
                         f"got x_train of shape {x_train.shape}")
    x_train, x_val = x_train.astype(np.float32), x_val.astype(np.float32)
    y_train, y_val = y_train.astype(np.int32), y_val.astype(np.int32)
    layers = len(_CONV_STRIDES[kind]) + _DENSE_LAYERS[kind]
    if len(initial_weights) != 2 * layers:
        raise ValueError(f"initial_weights: expected {2 * layers} arrays ((kernel, bias) per "
                         f"layer of the {kind}), got {len(initial_weights)}")
    steps_per_epoch = -(-len(x_train) // batch_size)
    if inverse_update_period is None:
        inverse_update_period = max(2, steps_per_epoch // 2)

    # Conv1D kernels (w, in, out) become (1, w, in, out) here, not in _logits: kfac-jax's
    # graph matcher only recognises a convolution whose kernel is a parameter unchanged.
    params = tuple((jnp.asarray(w[None] if w.ndim == 3 else w, jnp.float32),
                    jnp.asarray(b, jnp.float32))
                   for w, b in zip(initial_weights[::2], initial_weights[1::2]))
    x_val_j, y_val_j = jnp.asarray(x_val), jnp.asarray(y_val)
    optimizer = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(functools.partial(_loss, kind=kind)),
        l2_reg=0.0,
        use_adaptive_learning_rate=False,
        use_adaptive_momentum=False,
        use_adaptive_damping=False,
        norm_constraint=norm_constraint,
        num_burnin_steps=0,
        curvature_update_period=curvature_update_period,
        inverse_update_period=inverse_update_period,
        estimation_mode=estimation_mode,
        multi_device=False,
    )
    rng = jax.random.PRNGKey(seed)
    rng, init_rng = jax.random.split(rng)
    order_rng = np.random.default_rng(seed)
    hyper = {"learning_rate": jnp.asarray(learning_rate, jnp.float32),
             "momentum": jnp.asarray(momentum, jnp.float32),
             "damping": jnp.asarray(damping, jnp.float32)}

    state = None
    history = {"val_accuracy": [], "loss": [], "epoch_seconds": [], "seconds": []}
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
        history["val_accuracy"].append(float(_accuracy(params, x_val_j, y_val_j, kind)))
        history["epoch_seconds"].append(time.perf_counter() - start)
        history["seconds"].append(sum(history["epoch_seconds"]))
        if verbose:
            print(f"epoch {epoch + 1}: loss {history['loss'][-1]:.4f} "
                  f"val_accuracy {history['val_accuracy'][-1]:.4f} "
                  f"{history['seconds'][-1]:.2f}s", flush=True)
        if target is not None and history["val_accuracy"][-1] >= target:
            break
    return history
