"""LARS around SGD with momentum: the trust ratio and the update in two passes over memory.

For a variable ``w``, its gradient ``g`` and Keras SGD's momentum slot ``a``
(MindSpore ``nn.LARS`` semantics, DESIGN §4.3)::

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
about 1e-7 relative (the kernel may fuse multiply-adds).
"""
import tensorflow as tf

from tf_msopt._common import in_xla_context
from tf_msopt.ops._loader import load_custom_ops

__all__ = ["apply_lars_momentum", "lars_momentum_kernel"]

_KERNEL_DTYPES = (tf.float32, tf.float64)


def _tf_variable(variable):
    """The ``tf.Variable`` behind a ``keras.Variable`` (or the variable itself)."""
    value = getattr(variable, "value", None)
    return value if isinstance(value, tf.Variable) else variable


def lars_momentum_kernel(variable, gradient):
    """The compiled kernel's wrapper when it can run this update here, else None.

    It can when the library is loaded (and not switched off), the gradient is
    dense, the dtype is float32/float64, the variable is on a CPU and the step is
    not being XLA-compiled.
    """
    if isinstance(gradient, tf.IndexedSlices) or in_xla_context():
        return None
    variable = _tf_variable(variable)
    if variable.dtype not in _KERNEL_DTYPES:
        return None
    if tf.DeviceSpec.from_string(variable.device or "").device_type not in (None, "CPU"):
        return None
    module = load_custom_ops()
    return getattr(module, "ms_opt_resource_apply_lars_momentum", None)


def _scalar(x, dtype):
    """A Python number straight in ``dtype`` (``tf.cast`` would round it to float32 first)."""
    if isinstance(x, (int, float)):
        return tf.constant(x, dtype)
    return tf.cast(x, dtype)


def _norm(x):
    return tf.sqrt(2.0 * tf.nn.l2_loss(x))


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
    var = _tf_variable(variable)
    accum = _tf_variable(accumulator)
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
    weight = tf.convert_to_tensor(var)
    w_norm, g_norm = _norm(weight), _norm(gradient)
    trust = coefficient * w_norm / (g_norm + epsilon + weight_decay * w_norm)
    if use_clip:
        trust = tf.clip_by_value(trust / lr, 0.0, 1.0)
    trust = tf.where((w_norm > 0) & (g_norm > 0), trust, tf.ones_like(trust))
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=var.handle, accum=accum.handle, lr=trust * lr,
        grad=gradient + weight_decay * weight, momentum=momentum,
        use_nesterov=bool(use_nesterov))
