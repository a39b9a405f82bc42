"""The optimizers of the contract suite, and the small models and loops it drives them with.

Every case is built by ``make(model, **keras_kwargs)``: the usual Keras keyword arguments
(``weight_decay``, ``clipnorm``, ``use_ema``, ``gradient_accumulation_steps``,
``jit_compile``, ...) go where a user would put them (on the wrapped optimizer for LARS and
for a LossScaleOptimizer). THOR needs the model it preconditions; the others ignore it.
Importable from a fresh process (``sys.path`` holding ``tests`` and ``tests/contract``).
"""
import keras
import numpy as np
import tensorflow as tf

import tf_msopt as mso

#: Loss scale of the LossScaleOptimizer cases (a power of two: scaling is exact).
INITIAL_SCALE = 2.0**8


def _lars(inner_class, learning_rate):
    def make(model, jit_compile=None, **kwargs):
        inner = inner_class(learning_rate, **kwargs)
        return mso.LARS(inner, coefficient=0.02, jit_compile=jit_compile)
    return make


def _sgd(learning_rate, **kwargs):
    return keras.optimizers.SGD(learning_rate, momentum=0.9, **kwargs)


def _thor(model, **kwargs):
    # frequency 3: THOR steps 0, 3, ...; block_size 4 keeps several blocks per factor.
    return mso.thor(model, 0.05, 0.03, 0.9, frequency=3, block_size=4, **kwargs)


#: name -> (make, whether its path differs without the compiled custom ops)
BASE = {
    "addsign": (lambda model, **kw: mso.AddSign(0.01, **kw), True),
    "powersign": (lambda model, **kw: mso.PowerSign(0.01, **kw), True),
    "lars_sgd": (_lars(_sgd, 0.1), True),
    # Keras' Adam computes in the variable's dtype: in float16 its epsilon 1e-7 is 0, and in
    # bfloat16 its beta_2 0.999 is 1.0 (so it never steps). Values both dtypes hold:
    "lars_adam": (_lars(lambda lr, **kw: keras.optimizers.Adam(lr, beta_2=0.99, epsilon=1e-3,
                                                               **kw), 0.01), False),
    "adam_offload": (lambda model, **kw: mso.AdamOffload(0.01, **kw), True),
    # Moments in fewer bytes (another kernel, and int8 codes that any change of a moment
    # by one ulp could move: every equivalence below must hold bit for bit in the moments).
    "adam_offload_bf16": (lambda model, **kw: mso.AdamOffload(0.01, state_dtype="bfloat16",
                                                              **kw), True),
    "adam_offload_int8": (lambda model, **kw: mso.AdamOffload(0.01, state_dtype="int8", **kw),
                          True),
    "thor": (_thor, True),
}


def _loss_scaled(make):
    def wrapped(model, **kwargs):
        # Keras' form (a dynamic scale, doubled every 2 clean steps).
        return mso.LossScaleOptimizer(make(model, **kwargs), initial_scale=INITIAL_SCALE,
                                      dynamic_growth_steps=2)
    return wrapped


CASES = dict(BASE)
CASES.update({f"lso_{name}": (_loss_scaled(make), ops) for name, (make, ops) in BASE.items()})


def make(case, model, **kwargs):
    return CASES[case][0](model, **kwargs)


def is_thor(case):
    return case.endswith("thor")


def is_loss_scaled(case):
    return case.startswith("lso_")


# --------------------------------------------------------------------------- models, data

def mlp(seed=0, dtype=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh", name="fc1", dtype=dtype),
        keras.layers.Dense(2, name="head", dtype=dtype),
    ])


def embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((3,), dtype="int32"),
        keras.layers.Embedding(10, 4, name="emb"),
        keras.layers.Flatten(),
        keras.layers.Dense(2, name="head"),
    ])


def data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    w = rng.normal(size=(6, 2)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, 2))).astype("float32")
    return x, y


def batches(steps, batch=8, seed=0):
    """The first ``steps`` batches of a fixed pool (the same whatever ``steps`` is)."""
    x, y = data(max(128, steps * batch), seed)
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(steps)]


def token_batches(steps, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    n = max(128, steps * batch)
    x = rng.integers(0, 10, size=(n, 3)).astype("int32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(steps)]


def compiled(case, seed=0, **kwargs):
    """A compiled MLP with the case's optimizer (for ``fit`` / ``train_on_batch`` / saving)."""
    model = mlp(seed)
    model.compile(optimizer=make(case, model, **kwargs), loss="mse")
    return model


def weights(model):
    return [np.array(w) for w in model.get_weights()]


# --------------------------------------------------------------------------- custom loop

def current_scale(optimizer):
    """The loss scale the next ``apply`` divides by (1 without loss scaling)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return float(np.asarray(optimizer.loss_scale if optimizer.built
                                else optimizer.initial_scale))
    return 1.0


def on_unscaled(fn):
    """A gradient transform for :func:`loop_step` that applies ``fn`` to the unscaled
    gradients (the loss scale is a power of two, so unscaling and rescaling are exact)."""
    def transform(grads, scale):
        return [g * scale for g in fn([g / scale for g in grads])]
    return transform


def loop_step(model, optimizer, x, y, transform=None, variables=None):
    """One custom-loop step, the loss scaled by ``optimizer.scale_loss``;
    ``transform(grads, scale)`` stands for what a Keras feature should do to the gradients."""
    with tf.GradientTape() as tape:
        prediction = model(x, training=True)
        loss = keras.ops.mean(keras.ops.square(keras.ops.cast(prediction, "float32") - y))
        scaled = optimizer.scale_loss(loss)
    trainable = model.trainable_variables
    grads = tape.gradient(scaled, trainable)
    if transform is not None:
        grads = transform(grads, current_scale(optimizer))
    optimizer.apply(grads, variables if variables is not None else trainable)


def train(model, optimizer, steps, transform=None, variables=None, token=False, seed=0):
    """``steps`` custom-loop steps; returns the weights after each."""
    trace = []
    for x, y in (token_batches if token else batches)(steps, seed=seed):
        loop_step(model, optimizer, x, y, transform, variables)
        trace.append(weights(model))
    return trace
