"""AdamOffload's host step: MindSpore's ``ops.AdamNoUpdateParam`` on TensorFlow.

One step on the moments ``m`` and ``v`` (variables on the host), with
``g = grad * grad_scale`` (``grad_scale = 1 / loss_scale``)::

    lr_t  = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
    m     = m * beta1 + (1 - beta1) * g
    v     = v * beta2 + (1 - beta2) * g * g
    delta = -lr_t * m / (sqrt(v) + epsilon)
    delta = -lr_t * (m * beta1 + (1 - beta1) * g) / (sqrt(v) + epsilon)   # use_nesterov

``epsilon`` is added to ``sqrt(v)`` without bias correction.

With ``state_dtype`` the moments are stored in fewer bytes and the arithmetic is float32:
``"bfloat16"`` stores m and v as bfloat16 (the new values rounded to nearest even);
``"int8"`` stores them as codes of blocks of :data:`BLOCK_SIZE` elements, each block with a
float32 scale (its largest ``|m|``, its largest ``v``): ``m`` as the signed int8
``sign(m) * encode(|m| / scale, 4 exponent bits)``, ``v`` as the uint8
``encode(v / scale, 5 exponent bits)``, where ``encode`` rounds a number in [0, 1] to the
nearest 8-bit float with 3 fraction bits and the given exponent bits whose largest value is
1.0 (ties away from zero; below the smallest one, about 2**-15 for m and 2**-31 for v, it
gives 0).
``delta`` is computed from the new moments before they are stored. The compiled
``MsOptAdamOffloadCompactDeltas`` / ``...Updates`` and the TensorFlow ops below do the same
operations in the same order, none of them fused, so both store the same bits, codes and
scales; ``delta`` agrees to a few ulp (with AVX-512 or AVX2 the kernels divide by a refined
reciprocal estimate).

The compiled
kernels (``MsOptAdamOffloadDeltas`` / ``MsOptAdamOffloadUpdates`` in
``custom_ops/adam_offload.cc``) do this in one multi-threaded pass over g, m
and v of any number of variables, for float32 and float64 on CPU; otherwise (no library, the
``TF_MSOPT_DISABLE_CUSTOM_OPS`` kill switch, float16, an accelerator) the same
arithmetic runs as TensorFlow ops, in the same order, giving the same numbers.
"""
import functools

import numpy as np
import tensorflow as tf

from tf_msopt._common import entry_point
from tf_msopt.ops._loader import load_custom_ops

__all__ = ["BLOCK_SIZE", "STATE_DTYPES", "adam_offload_step", "adam_offload_steps",
           "decode_moments", "host_step_bytes", "scale_shape"]

#: How the moments can be stored: float32 (the arithmetic's dtype), or in fewer bytes.
STATE_DTYPES = ("float32", "bfloat16", "int8")
#: Elements per float32 scale of the int8 moments.
BLOCK_SIZE = 2048
#: The dtypes of (m, v) for each compact state_dtype.
COMPACT_MOMENT_DTYPES = {"bfloat16": (tf.bfloat16, tf.bfloat16), "int8": (tf.int8, tf.uint8)}
#: Bytes of one stored moment element.
MOMENT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}
# Offsets of the 8-bit floats' exponents (their top value, 1.0, is code (127 << 3) - offset).
_MOMENT_OFFSET, _SQUARE_OFFSET = 112 << 3, 96 << 3

_KERNEL_DTYPES = (tf.float32, tf.float64)
_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_BETA1_POWER_TOLERANCE = float(np.finfo(np.float32).eps)


def _on_cpu(variable):
    return tf.DeviceSpec.from_string(variable.device or "").device_type in (None, "CPU")


@entry_point
def adam_offload_step(m, v, grad, beta1_power, beta2_power, lr, beta1, beta2, epsilon,
                      grad_scale=1.0, use_nesterov=False, use_locking=False, var=None,
                      assign=None, assign_add=None, state_dtype=None, scales=None):
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
        state_dtype: None (the moments are in the arithmetic's dtype), or ``"bfloat16"`` /
            ``"int8"``: compact moments (see the module's docstring), float32 gradients.
        scales: for ``"int8"``, the pair ``(m_scale, v_scale)`` of float32 variables of
            shape :func:`scale_shape` beside the codes ``m`` (int8) and ``v`` (uint8).

    Returns:
        ``delta`` (a tensor on the moments' device), or None when ``var`` is given.

    Raises:
        TypeError: non-float dtypes, or a dtype that differs from the moments'.
        ValueError: a gradient whose shape differs from the moments'.
        tf.errors.InvalidArgumentError: ``beta1_power`` is 1 (when run).
    """
    deltas = adam_offload_steps([m], [v], [grad], beta1_power, beta2_power, lr, beta1, beta2,
                                epsilon, grad_scale, use_nesterov, use_locking,
                                None if var is None else [var], assign, assign_add,
                                state_dtype, None if scales is None else [[x] for x in scales])
    return None if deltas is None else deltas[0]


@entry_point
def adam_offload_steps(ms, vs, grads, beta1_power, beta2_power, lr, beta1, beta2, epsilon,
                       grad_scale=1.0, use_nesterov=False, use_locking=False, variables=None,
                       assign=None, assign_add=None, state_dtype=None, scales=None):
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
        scales: for ``state_dtype="int8"``, the pair of lists ``(m_scales, v_scales)``.

    Returns:
        The list of ``delta`` tensors, or None when ``variables`` is given.
    """
    ms, vs, grads = list(ms), list(vs), list(grads)
    if not (len(ms) == len(vs) == len(grads) > 0) or (
            variables is not None and len(variables) != len(ms)):
        raise ValueError(
            f"For 'AdamOffload', 'm', 'v', 'grad' (and 'var') must be non-empty lists of one "
            f"length, but got lengths {len(ms)}, {len(vs)}, {len(grads)}"
            f"{'' if variables is None else ', ' + str(len(variables))}.")
    dtype = ms[0].dtype if state_dtype is None else tf.float32
    m_scales, v_scales = _check_state(ms, vs, variables, state_dtype, scales, dtype)
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
        kernel = "ms_opt_adam_offload_" + ("deltas" if state_dtype is None else "compact_deltas")
        if hasattr(module, kernel) and dtype in _KERNEL_DTYPES and _on_cpu(ms[0]):
            attrs = dict(use_locking=use_locking, use_nesterov=use_nesterov)
            handles = [[x.handle for x in xs] for xs in (ms, vs)]
            if state_dtype is None:
                deltas_op = module.ms_opt_adam_offload_deltas
                updates_op = module.ms_opt_adam_offload_updates
            else:
                attrs["state_dtype"] = state_dtype
                # (bfloat16 moments have no scales: two empty lists)
                handles += [[x.handle for x in xs if x is not None]
                            for xs in (m_scales, v_scales)]
                deltas_op = module.ms_opt_adam_offload_compact_deltas
                updates_op = module.ms_opt_adam_offload_compact_updates
            if variables is None:
                return deltas_op(*handles, grads, *scalars, **attrs)
            updates_op([x.handle for x in variables], *handles, grads, *scalars, **attrs)
            return None
        assign = assign or (lambda variable, value: variable.assign(value))
        assign_add = assign_add or (lambda variable, value: variable.assign_add(value))
        neg_lr_t = _neg_lr_t(*scalars[:3])
        step = functools.partial(_compact_delta, state_dtype) if state_dtype else _float_delta
        deltas = [step(m, v, m_scale, v_scale, grad, neg_lr_t, *scalars[3:], use_nesterov,
                       assign)
                  for m, v, m_scale, v_scale, grad in zip(ms, vs, m_scales, v_scales, grads)]
        if variables is None:
            return deltas
        for var, delta in zip(variables, deltas):
            assign_add(var, delta)
        return None


def host_step_bytes(state_dtype, sizes):
    """The memory traffic of one in-place host step (float32 variables on the host) over
    variables of ``sizes`` elements: w read and written, g read, m and v read and written
    (28, 20 and 16 bytes a parameter for float32, bfloat16, int8), and int8's scales."""
    per_element = 3 * 4 + 2 * 2 * MOMENT_BYTES[state_dtype]
    scales = 2 * 2 * 4 if state_dtype == "int8" else 0   # m's and v's, read and written
    return sum(n * per_element + scales * -(-n // BLOCK_SIZE) for n in sizes)


def scale_shape(shape):
    """The shape of an int8 moment's scales: one per :data:`BLOCK_SIZE` elements."""
    return (-(-int(np.prod(shape, dtype=np.int64)) // BLOCK_SIZE),)


def _check_state(ms, vs, variables, state_dtype, scales, dtype):
    """Checks the moments' (and variables') dtypes; returns the lists of scales (Nones
    where the state has none)."""
    none = [None] * len(ms)
    if state_dtype is None:
        for index, (m, v, var) in enumerate(zip(ms, vs, variables or none)):
            if (dtype not in _FLOAT_DTYPES or m.dtype != dtype or v.dtype != dtype
                    or (var is not None and var.dtype != dtype)):
                raise TypeError(
                    f"For 'AdamOffload', 'm', 'v' (and 'var') must have one float dtype, but "
                    f"got {m.dtype.name}, {v.dtype.name}"
                    f"{'' if var is None else ', ' + var.dtype.name} (entry {index}).")
        return none, none
    if state_dtype not in COMPACT_MOMENT_DTYPES:
        raise ValueError(
            f"For 'AdamOffload', the 'state_dtype' must be one of "
            f"{[None, *COMPACT_MOMENT_DTYPES]}, but got {state_dtype!r}.")
    m_dtype, v_dtype = COMPACT_MOMENT_DTYPES[state_dtype]
    for index, (m, v, var) in enumerate(zip(ms, vs, variables or none)):
        if m.dtype != m_dtype or v.dtype != v_dtype or (var is not None
                                                         and var.dtype != tf.float32):
            raise TypeError(
                f"For 'AdamOffload', state_dtype {state_dtype!r} takes 'm' of dtype "
                f"{m_dtype.name}, 'v' of dtype {v_dtype.name} (and a float32 'var'), but got "
                f"{m.dtype.name}, {v.dtype.name}"
                f"{'' if var is None else ', ' + var.dtype.name} (entry {index}).")
    if state_dtype != "int8":
        if scales is not None:
            raise ValueError(f"For 'AdamOffload', state_dtype {state_dtype!r} has no scales.")
        return none, none
    m_scales, v_scales = scales if scales is not None else (None, None)
    if m_scales is None or not len(m_scales) == len(v_scales) == len(ms):
        raise ValueError(
            "For 'AdamOffload', state_dtype 'int8' needs 'scales': (m_scales, v_scales), one "
            "of each per moment.")
    for index, (m, m_scale, v_scale) in enumerate(zip(ms, m_scales, v_scales)):
        want = scale_shape(m.shape)
        if (m_scale.dtype, v_scale.dtype) != (tf.float32, tf.float32) or not (
                tuple(m_scale.shape) == tuple(v_scale.shape) == want):
            raise ValueError(
                f"For 'AdamOffload', the scales of an int8 moment must be float32 of shape "
                f"{want}, but got {m_scale.dtype.name} {tuple(m_scale.shape)} and "
                f"{v_scale.dtype.name} {tuple(v_scale.shape)} (entry {index}).")
    return list(m_scales), list(v_scales)


def _neg_lr_t(beta1_power, beta2_power, lr):
    one = tf.ones([], lr.dtype)
    check = tf.debugging.assert_greater_equal(
        tf.abs(beta1_power - one), tf.cast(_BETA1_POWER_TOLERANCE, lr.dtype),
        message="the 'beta1_power' can not be 1.")
    with tf.control_dependencies([check]):
        return -(lr * tf.sqrt(one - beta2_power) / (one - beta1_power))


def _adam_arithmetic(m, v, grad, neg_lr_t, beta1, beta2, epsilon, grad_scale, use_nesterov):
    """The kernel's arithmetic as TensorFlow ops, operation for operation: the new moments
    and delta."""
    one = tf.ones([], grad.dtype)
    g = grad * grad_scale
    m_value = m * beta1 + (one - beta1) * g
    v_value = v * beta2 + (one - beta2) * g * g
    step = m_value * beta1 + (one - beta1) * g if use_nesterov else m_value
    return m_value, v_value, neg_lr_t * step / (tf.sqrt(v_value) + epsilon)


def _float_delta(m, v, m_scale, v_scale, grad, neg_lr_t, beta1, beta2, epsilon, grad_scale,
                 use_nesterov, assign):
    del m_scale, v_scale  # float moments have none
    m_value, v_value, delta = _adam_arithmetic(m, v, grad, neg_lr_t, beta1, beta2, epsilon,
                                               grad_scale, use_nesterov)
    assign(m, m_value)
    assign(v, v_value)
    return delta


def _compact_delta(state_dtype, m, v, m_scale, v_scale, grad, neg_lr_t, beta1, beta2, epsilon,
                   grad_scale, use_nesterov, assign):
    if state_dtype == "bfloat16":
        m_value, v_value, delta = _adam_arithmetic(
            tf.cast(m, tf.float32), tf.cast(v, tf.float32), grad, neg_lr_t, beta1, beta2,
            epsilon, grad_scale, use_nesterov)
        assign(m, tf.cast(m_value, tf.bfloat16))   # to nearest even, as the kernel
        assign(v, tf.cast(v_value, tf.bfloat16))
        return delta
    size = grad.shape.num_elements()
    m_old, v_old = decode_moments(m, v, m_scale, v_scale, blocks=True)
    m_value, v_value, delta = _adam_arithmetic(m_old, v_old, _to_blocks(grad), neg_lr_t, beta1,
                                               beta2, epsilon, grad_scale, use_nesterov)
    m_max, v_max = (tf.reduce_max(tf.abs(x), axis=1) for x in (m_value, v_value))
    magnitude = _encode_unit(tf.abs(m_value) * tf.math.divide_no_nan(1.0, m_max)[:, None],
                             _MOMENT_OFFSET)
    m_code = tf.where(m_value < 0, -magnitude, magnitude)
    v_code = _encode_unit(tf.abs(v_value) * tf.math.divide_no_nan(1.0, v_max)[:, None],
                          _SQUARE_OFFSET)
    assign(m, tf.reshape(tf.cast(tf.reshape(m_code, [-1])[:size], tf.int8), m.shape))
    assign(v, tf.reshape(tf.cast(tf.reshape(v_code, [-1])[:size], tf.uint8), v.shape))
    assign(m_scale, m_max)
    assign(v_scale, v_max)
    return tf.reshape(tf.reshape(delta, [-1])[:size], grad.shape)


def decode_moments(m, v, m_scale=None, v_scale=None, blocks=False):
    """The float32 values of stored moments: bfloat16 ones, or int8 codes (``m`` int8,
    ``v`` uint8) with their scales. ``blocks``: as ``[blocks, BLOCK_SIZE]`` (zero-padded)."""
    if m.dtype == tf.bfloat16:
        return tf.cast(m, tf.float32), tf.cast(v, tf.float32)
    m_code, v_code = (tf.cast(_to_blocks(x), tf.int32) for x in (m, v))
    m_magnitude = _decode_unit(tf.abs(m_code), _MOMENT_OFFSET) * tf.convert_to_tensor(
        m_scale)[:, None]
    m_value = tf.where(m_code < 0, -m_magnitude, m_magnitude)
    v_value = _decode_unit(v_code, _SQUARE_OFFSET) * tf.convert_to_tensor(v_scale)[:, None]
    if blocks:
        return m_value, v_value
    size = m.shape.num_elements()
    return tuple(tf.reshape(tf.reshape(x, [-1])[:size], m.shape) for x in (m_value, v_value))


def _to_blocks(x):
    flat = tf.reshape(x, [-1])
    return tf.reshape(tf.pad(flat, [[0, -flat.shape[0] % BLOCK_SIZE]]), [-1, BLOCK_SIZE])


def _encode_unit(x, offset):
    """x in [0, 1] to its 8-bit float code (int32), with integer operations on its bits."""
    # Half a code step added and the offset taken off before the (arithmetic) shift: to
    # nearest, ties away from zero; what lies below the range comes out negative.
    code = tf.bitwise.right_shift(tf.bitcast(x, tf.int32) + (0x80000 - (offset << 20)), 20)
    return tf.clip_by_value(code, 0, (127 << 3) - offset)


def _decode_unit(code, offset):
    value = tf.bitcast(tf.bitwise.left_shift(code + offset, 20), tf.float32)
    return tf.where(code > 0, value, tf.zeros_like(value))
