"""LARS around SGD with momentum: the trust ratio and the update in two passes over memory.

For a variable ``w``, its gradient ``g`` and Keras SGD's momentum slot ``a``
(MindSpore ``nn.LARS`` semantics)::

    trust = coefficient * |w| / (weight_decay * |w| + |g| + epsilon)
    trust = clip(trust / lr, 0, 1)                 # use_clip
    trust = 1                                      # |w| = 0 or |g| = 0
    a     = momentum * a - trust * lr * (g + weight_decay * w)
    w    += a                                      # Nesterov: momentum * a - trust*lr*(g + wd*w)

The compiled kernel (``MsOptResourceApplyLarsMomentum`` in
``custom_ops/lars_ops.cc``; float32/float64 on CPU, outside XLA) reads ``w`` and
``g`` once for both norms, then reads ``w``, ``g``, ``a`` and writes ``w``, ``a``
once: 7 words per element, where TensorFlow ops need 10 (``g + wd * w`` is
written out and read back). Otherwise (no library, the
``TF_MSOPT_DISABLE_CUSTOM_OPS`` kill switch, another dtype or device, an
XLA-compiled step) the same arithmetic runs as TensorFlow ops; both agree to
about 1e-7 relative (the kernel may fuse multiply-adds). Around any other wrapped
optimizer, :func:`lars_gradient` gives it ``trust * (g + weight_decay * w)`` the same way
(``MsOptLarsGradient``).
"""
import tensorflow as tf

from tf_msopt._common import in_xla_context, tf_variable
from tf_msopt.ops._loader import load_custom_ops

__all__ = ["apply_lars_momentum", "decayed_gradient_and_trust", "lars_gradient",
           "lars_momentum_kernel", "norm", "trust_ratio"]

_KERNEL_DTYPES = (tf.float32, tf.float64)


def lars_momentum_kernel(variable, gradient):
    """The compiled momentum update's wrapper when it can run this update here, else None.

    It can when the library is loaded (and not switched off), the gradient is
    dense, the dtype is float32/float64, the variable is on a CPU and the step is
    not being XLA-compiled.
    """
    return _kernel("ms_opt_resource_apply_lars_momentum", variable, gradient)


def _kernel(name, variable, gradient):
    """The compiled LARS kernel ``name`` where it can run (see :func:`lars_momentum_kernel`),
    else None."""
    if isinstance(gradient, tf.IndexedSlices) or in_xla_context():
        return None
    variable = tf_variable(variable)
    if variable.dtype not in _KERNEL_DTYPES:
        return None
    if tf.DeviceSpec.from_string(variable.device or "").device_type not in (None, "CPU"):
        return None
    return getattr(load_custom_ops(), name, None)


def _scalar(x, dtype):
    """A Python number straight in ``dtype`` (``tf.cast`` would round it to float32 first)."""
    if isinstance(x, (int, float)):
        return tf.constant(x, dtype)
    return tf.cast(x, dtype)


def norm(x):
    """The L2 norm of the whole tensor ``x``."""
    # L2Loss (sum(x**2) / 2) reads x once with no temporary, unlike reduce_sum(square(x)),
    # and XLA compiles it too.
    return tf.sqrt(2.0 * tf.nn.l2_loss(x))


def trust_ratio(w_norm, g_norm, coefficient, epsilon, weight_decay=None, use_clip=False,
                learning_rate=None):
    """LARS' ``trust`` from the norms of a variable and its gradient (scalars of one dtype);
    ``weight_decay`` None leaves its term out. 1 where either norm is 0."""
    denominator = g_norm + epsilon
    if weight_decay is not None:
        denominator += weight_decay * w_norm
    trust = coefficient * w_norm / denominator
    if use_clip:
        trust = tf.clip_by_value(trust / learning_rate, 0.0, 1.0)
    # Zero norms: leave the step to the plain update rather than freeze w.
    return tf.where((w_norm > 0) & (g_norm > 0), trust, tf.ones_like(trust))


def decayed_gradient_and_trust(weight, gradient, learning_rate, weight_decay, coefficient,
                               epsilon, use_clip=False):
    """``(g + weight_decay * w, trust)`` from TensorFlow ops, the norms taken before the decay
    term is added; tensors of one dtype, ``weight_decay`` None for no decay term."""
    trust = trust_ratio(norm(weight), norm(gradient), coefficient, epsilon, weight_decay,
                        use_clip, learning_rate)
    return (gradient if weight_decay is None else gradient + weight_decay * weight), trust


def apply_lars_momentum(variable, accumulator, gradient, learning_rate, momentum,
                        weight_decay=0.0, coefficient=0.001, epsilon=1e-5, use_clip=False,
                        use_nesterov=False, use_kernel=None):
    """One LARS + SGD-momentum update of ``variable`` and ``accumulator``, in place.

    Args:
        variable, accumulator: variables (``tf.Variable`` or ``keras.Variable``)
            of one shape and dtype; ``accumulator`` holds Keras SGD's momentum
            (``a = momentum * a - lr * g``).
        gradient: dense tensor (``tf.IndexedSlices`` are densified).
        learning_rate, momentum, weight_decay, coefficient, epsilon: scalars.
        use_clip: LARC's clip mode, ``trust = clip(trust / lr, 0, 1)``.
        use_nesterov: Keras SGD's Nesterov form.
        use_kernel: None picks the compiled kernel where it can run; False
            forces the TensorFlow ops.

    Returns:
        None (inside a ``tf.function`` the update is ordered by automatic control
        dependencies, as for ``tf.Variable.assign``).
    """
    var = tf_variable(variable)
    accum = tf_variable(accumulator)
    dtype = var.dtype
    kernel = lars_momentum_kernel(var, gradient) if use_kernel is not False else None
    gradient = tf.cast(tf.convert_to_tensor(gradient), dtype)
    scalars = [_scalar(x, dtype) for x in (learning_rate, momentum, weight_decay, coefficient,
                                           epsilon)]
    if kernel is not None:
        kernel(var=var.handle, accum=accum.handle, grad=gradient, lr=scalars[0],
                      momentum=scalars[1], weight_decay=scalars[2], coefficient=scalars[3],
                      epsilon=scalars[4], use_clip=bool(use_clip),
                      use_nesterov=bool(use_nesterov))
        return
    lr, momentum, weight_decay, coefficient, epsilon = scalars
    gradient, trust = decayed_gradient_and_trust(tf.convert_to_tensor(var), gradient, lr,
                                                 weight_decay, coefficient, epsilon, use_clip)
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=var.handle, accum=accum.handle, lr=trust * lr, grad=gradient, momentum=momentum,
        use_nesterov=bool(use_nesterov))


def lars_gradient(variable, gradient, learning_rate, weight_decay, coefficient, epsilon,
                  use_clip=False, use_kernel=None):
    """LARS' gradient for a wrapped optimizer, ``trust * (g + weight_decay * w)``.

    The compiled ``MsOptLarsGradient`` (where the momentum update's kernel could run)
    reads ``w`` and ``g`` once for both norms and once more to write the result; the
    TensorFlow ops read them for each norm and write ``g + weight_decay * w`` before
    scaling it; a ``weight_decay`` of 0 leaves its term out (``w`` is not read again).
    ``use_kernel=False`` forces the TensorFlow ops; both agree to about 1e-7.
    """
    var = tf_variable(variable)
    dtype = var.dtype
    kernel = _kernel("ms_opt_lars_gradient", var, gradient) if use_kernel is not False else None
    gradient = tf.cast(tf.convert_to_tensor(gradient), dtype)   # IndexedSlices: dense
    weight = tf.convert_to_tensor(var)
    no_decay = isinstance(weight_decay, (int, float)) and not weight_decay
    lr, weight_decay, coefficient, epsilon = (
        _scalar(x, dtype) for x in (learning_rate, weight_decay, coefficient, epsilon))
    if kernel is not None:
        return kernel(var=weight, grad=gradient, lr=lr, weight_decay=weight_decay,
                      coefficient=coefficient, epsilon=epsilon, use_clip=bool(use_clip))
    gradient, trust = decayed_gradient_and_trust(weight, gradient, lr,
                                                 None if no_decay else weight_decay,
                                                 coefficient, epsilon, use_clip)
    return trust * gradient
