"""AdamOffload's host step: MindSpore's ``ops.AdamNoUpdateParam`` on TensorFlow.

One step on the moments ``m`` and ``v`` (variables on the host), with
``g = grad * grad_scale`` (``grad_scale = 1 / loss_scale``)::

    lr_t  = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
    m     = m * beta1 + (1 - beta1) * g
    v     = v * beta2 + (1 - beta2) * g * g
    delta = -lr_t * m / (sqrt(v) + epsilon)
    delta = -lr_t * (m * beta1 + (1 - beta1) * g) / (sqrt(v) + epsilon)   # use_nesterov

``epsilon`` is added to ``sqrt(v)`` without bias correction. The compiled
kernels (``MsOptAdamOffloadDeltas`` / ``MsOptAdamOffloadUpdates`` in
``custom_ops/adam_offload.cc``) do this in one multi-threaded pass over g, m
and v of any number of variables, for float32 and float64 on CPU; otherwise (no library, the
``TF_MSOPT_DISABLE_CUSTOM_OPS`` kill switch, float16, an accelerator) the same
arithmetic runs as TensorFlow ops, in the same order, giving the same numbers.
"""
import numpy as np
import tensorflow as tf

from tf_msopt.ops._loader import load_custom_ops

__all__ = ["adam_offload_step", "adam_offload_steps"]

_KERNEL_DTYPES = (tf.float32, tf.float64)
_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_BETA1_POWER_TOLERANCE = float(np.finfo(np.float32).eps)


def _on_cpu(variable):
    return tf.DeviceSpec.from_string(variable.device or "").device_type in (None, "CPU")


def adam_offload_step(m, v, grad, beta1_power, beta2_power, lr, beta1, beta2, epsilon,
                      grad_scale=1.0, use_nesterov=False, use_locking=False, var=None,
                      assign=None, assign_add=None):
    """Runs one AdamOffload step on the device of ``m`` and ``v``.

    Args:
        m, v: ``tf.Variable`` moments, updated in place.
        grad: the gradient, a tensor with the moments' shape and dtype.
        beta1_power, beta2_power: ``beta1**t`` and ``beta2**t`` at step ``t``.
        lr, beta1, beta2, epsilon, grad_scale: scalars.
        use_nesterov: use the Nesterov form of ``delta``.
        use_locking: hold the moments' locks while writing (the kernel always
            does, as TensorFlow's dense training ops do; kept for MindSpore).
        var: optional ``tf.Variable`` on the same device as ``m`` and ``v``:
            ``delta`` is then added to it in the same pass.
        assign, assign_add: ``f(variable, value)`` that write the moments and
            ``var`` where TensorFlow ops (not the kernel) do it; an optimizer
            passes its own ``assign`` / ``assign_add`` (Keras' rule). Default:
            the variables' methods.

    Returns:
        ``delta`` (a tensor on the moments' device), or None when ``var`` is given.

    Raises:
        TypeError: non-float dtypes, or a dtype that differs from the moments'.
        ValueError: a gradient whose shape differs from the moments'.
        tf.errors.InvalidArgumentError: ``beta1_power`` is 1 (when run).
    """
    deltas = adam_offload_steps([m], [v], [grad], beta1_power, beta2_power, lr, beta1, beta2,
                                epsilon, grad_scale, use_nesterov, use_locking,
                                None if var is None else [var], assign, assign_add)
    return None if deltas is None else deltas[0]


def adam_offload_steps(ms, vs, grads, beta1_power, beta2_power, lr, beta1, beta2, epsilon,
                       grad_scale=1.0, use_nesterov=False, use_locking=False, variables=None,
                       assign=None, assign_add=None):
    """:func:`adam_offload_step` for several variables at once, with shared scalars.

    The compiled kernel takes them all in one call: one op dispatch and one parallel
    pass over every element, not one per variable. The moments must all be on one device
    and have one dtype. The arguments not listed here are those of
    :func:`adam_offload_step`.

    Args:
        ms, vs, grads: equal-length lists; entry ``i`` is one variable's moments
            and gradient, as in :func:`adam_offload_step`.
        variables: optional list of ``tf.Variable`` beside the moments: each
            ``delta`` is added to its variable in the same pass.

    Returns:
        The list of ``delta`` tensors, or None when ``variables`` is given.
    """
    ms, vs, grads = list(ms), list(vs), list(grads)
    dtype = ms[0].dtype if ms else None
    if not (len(ms) == len(vs) == len(grads) > 0) or (
            variables is not None and len(variables) != len(ms)):
        raise ValueError(
            f"For 'AdamOffload', 'm', 'v', 'grad' (and 'var') must be non-empty lists of one "
            f"length, but got lengths {len(ms)}, {len(vs)}, {len(grads)}"
            f"{'' if variables is None else ', ' + str(len(variables))}.")
    for index, (m, v, var) in enumerate(zip(ms, vs, variables or [None] * len(ms))):
        if (dtype not in _FLOAT_DTYPES or m.dtype != dtype or v.dtype != dtype
                or (var is not None and var.dtype != dtype)):
            raise TypeError(
                f"For 'AdamOffload', 'm', 'v' (and 'var') must have one float dtype, but got "
                f"{m.dtype.name}, {v.dtype.name}{'' if var is None else ', ' + var.dtype.name}"
                f" (entry {index}).")
    with tf.device(ms[0].device):
        grads = [tf.convert_to_tensor(grad, dtype=dtype) for grad in grads]
        for index, (m, v, grad) in enumerate(zip(ms, vs, grads)):
            if not (grad.shape.is_compatible_with(m.shape)
                    and v.shape.is_compatible_with(m.shape)):
                raise ValueError(
                    f"For 'AdamOffload', 'grad', 'm' and 'v' must have the same shape, but got "
                    f"{grad.shape}, {m.shape} and {v.shape} (entry {index}).")
        scalars = [tf.cast(x, dtype) for x in (beta1_power, beta2_power, lr, beta1, beta2, epsilon,
                                               grad_scale)]
        module = load_custom_ops()
        # (A library built before these ops existed lacks them: use the pure-TF path then.)
        if (hasattr(module, "ms_opt_adam_offload_deltas") and dtype in _KERNEL_DTYPES
                and _on_cpu(ms[0])):
            attrs = dict(use_locking=use_locking, use_nesterov=use_nesterov)
            handles = [[x.handle for x in xs] for xs in (ms, vs)]
            if variables is None:
                return module.ms_opt_adam_offload_deltas(*handles, grads, *scalars, **attrs)
            module.ms_opt_adam_offload_updates([x.handle for x in variables], *handles, grads,
                                               *scalars, **attrs)
            return None
        assign = assign or (lambda variable, value: variable.assign(value))
        assign_add = assign_add or (lambda variable, value: variable.assign_add(value))
        deltas = [_adam_delta(m, v, grad, *scalars, use_nesterov, assign)
                  for m, v, grad in zip(ms, vs, grads)]
        if variables is None:
            return deltas
        for var, delta in zip(variables, deltas):
            assign_add(var, delta)
        return None


def _adam_delta(m, v, grad, beta1_power, beta2_power, lr, beta1, beta2, epsilon, grad_scale,
                use_nesterov, assign):
    """The kernel's arithmetic as TensorFlow ops, operation for operation."""
    one = tf.ones([], grad.dtype)
    check = tf.debugging.assert_greater_equal(
        tf.abs(beta1_power - one), tf.cast(_BETA1_POWER_TOLERANCE, grad.dtype),
        message="the 'beta1_power' can not be 1.")
    with tf.control_dependencies([check]):
        neg_lr_t = -(lr * tf.sqrt(one - beta2_power) / (one - beta1_power))
    g = grad * grad_scale
    m_value = m * beta1 + (one - beta1) * g
    v_value = v * beta2 + (one - beta2) * g * g
    assign(m, m_value)
    assign(v, v_value)
    step = m_value * beta1 + (one - beta1) * g if use_nesterov else m_value
    return neg_lr_t * step / (tf.sqrt(v_value) + epsilon)
