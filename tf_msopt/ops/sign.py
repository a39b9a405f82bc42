"""AddSign / PowerSign updates: MindSpore's op contract on TensorFlow.

One step (Bello et al. 2017; MindSpore ``ops.ApplyAddSign`` / ``ops.ApplyPowerSign``)::

    m   = beta * m + (1 - beta) * grad
    AddSign:   var -= lr * (alpha + sign_decay * sign(grad) * sign(m)) * grad
    PowerSign: var -= lr * exp(logbase * sign_decay * sign(grad) * sign(m)) * grad

``sign`` uses the NEW ``m`` and ``sign(0) = 0``. Variables are updated, fastest
first, by the package's one-pass CPU kernels (``custom_ops/sign_ops.cc``; float32
and float64, when the compiled ops are loaded and the step is not XLA-compiled),
by TensorFlow's fused ``ResourceApplyAddSign`` / ``ResourceApplyPowerSign``
kernels where the dtype and device have one (CPU: half, bfloat16, float, double;
GPU: no bfloat16), otherwise by the same arithmetic in plain ops. All paths give
the same numbers; the last two compile under ``jit_compile=True``.
"""
import numbers

import keras
import numpy as np
import tensorflow as tf

from tf_msopt._common import entry_point, in_xla_context
from tf_msopt.ops._loader import load_custom_ops

__all__ = ["apply_add_sign", "apply_power_sign", "update_sign_variables"]

_FLOAT_DTYPES = (tf.float16, tf.float32, tf.float64)
_FUSED_CPU_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_FUSED_GPU_DTYPES = (tf.float16, tf.float32, tf.float64)

# Which fused kernel and which plain formula each rule uses; `coefficient` is
# alpha for AddSign and logbase for PowerSign.
_KERNELS = {"add_sign": tf.raw_ops.ResourceApplyAddSign,
            "power_sign": tf.raw_ops.ResourceApplyPowerSign}
_OP_NAMES = {"add_sign": "ApplyAddSign", "power_sign": "ApplyPowerSign"}
_COEFFICIENT_NAMES = {"add_sign": "alpha", "power_sign": "logbase"}
_CUSTOM_KERNELS = {"add_sign": "ms_opt_resource_apply_add_sign",
                   "power_sign": "ms_opt_resource_apply_power_sign"}
_CUSTOM_DTYPES = (tf.float32, tf.float64)


def _sign_step(rule, var, m, lr, coefficient, sign_decay, beta, grad):
    """Plain-op arithmetic, written as TensorFlow's fused kernels evaluate it."""
    m = m * beta + grad * (1 - beta)
    sign_product = tf.sign(grad) * tf.sign(m)
    if rule == "add_sign":
        scale = coefficient + sign_decay * sign_product
    else:
        scale = tf.exp(coefficient * sign_decay * sign_product)
    return var - lr * scale * grad, m


def _on_gpu(device):
    return "GPU" in (device or "").upper()


def has_fused_kernel(dtype, device):
    return dtype in (_FUSED_GPU_DTYPES if _on_gpu(device) else _FUSED_CPU_DTYPES)


def _custom_kernel(rule, dtype, device):
    """The one-pass compiled kernel for this update, or None."""
    if dtype not in _CUSTOM_DTYPES or _on_gpu(device) or in_xla_context():
        return None
    ops = load_custom_ops()
    return getattr(ops, _CUSTOM_KERNELS[rule], None) if ops is not None else None


def update_sign_variables(rule, var, m, lr, coefficient, sign_decay, beta, grad, fused=None):
    """Updates the variables ``var`` and ``m`` in place (no validation; hot path).

    Hyper-parameters must already have ``var.dtype``. ``fused=None`` picks the
    fastest kernel the dtype, device and context allow; True forces
    TensorFlow's fused kernel; False forces plain ops.
    """
    kernel = _custom_kernel(rule, var.dtype, var.device) if fused is None else None
    if kernel is None and (fused or (fused is None and has_fused_kernel(var.dtype, var.device))):
        kernel = _KERNELS[rule]
    if kernel is not None:
        return kernel(var=var.handle, m=m.handle, lr=lr, sign_decay=sign_decay, beta=beta,
                      grad=grad, **{_COEFFICIENT_NAMES[rule]: coefficient})
    var_value, m_value = _sign_step(rule, var, m, lr, coefficient, sign_decay, beta, grad)
    m.assign(m_value)
    return var.assign(var_value)


def _is_variable(x):
    return isinstance(x, (tf.Variable, keras.Variable))


def _as_tensor(x):
    return x.value if isinstance(x, keras.Variable) else tf.convert_to_tensor(x)


def _check_tensor(x, arg, op):
    dtype = tf.as_dtype(x.dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"For primitive[{op}], the input argument[{arg}] must be a type of "
            f"{{Float16, Float32, Float64}}, but got Tensor[{dtype.name}]."
        )


def _check_scalar(x, arg, op, dtype):
    """A float scalar or a float tensor of rank <= 1 with one element."""
    tensor_like = isinstance(x, (tf.Tensor, tf.Variable, keras.Variable, np.ndarray, np.generic))
    if isinstance(x, (bool, numbers.Integral)) or not (tensor_like or isinstance(x, numbers.Real)):
        raise TypeError(
            f"For primitive[{op}], the input argument[{arg}] must be a float scalar or a float "
            f"Tensor, but got {type(x).__name__}."
        )
    if isinstance(x, numbers.Real):
        return tf.constant(float(x), dtype)
    tensor = _as_tensor(x)
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"For primitive[{op}], the input argument[{arg}] must be a type of "
            f"{{Float16, Float32, Float64}}, but got Tensor[{tensor.dtype.name}]."
        )
    shape = tensor.shape
    if shape.rank is not None and shape.rank > 1:
        raise ValueError(f"For primitive[{op}], the '{arg}' must have rank <= 1, but got {shape.rank}.")
    if shape.rank == 1 and shape[0] != 1:
        raise ValueError(f"For primitive[{op}], the {arg}_shape[0] must be equal to 1, but got {shape[0]}.")
    return tf.cast(tf.reshape(tensor, []), dtype)


def _apply(rule, var, m, lr, coefficient, sign_decay, beta, grad):
    op = _OP_NAMES[rule]
    tensors = {"var": var, "m": m, "grad": grad}
    for arg, x in tensors.items():
        if not (_is_variable(x) or isinstance(x, tf.Tensor)):
            tensors[arg] = tf.convert_to_tensor(x)
        _check_tensor(tensors[arg], arg, op)
    var_shape = tensors["var"].shape
    for arg in ("m", "grad"):
        if not tensors[arg].shape.is_compatible_with(var_shape):
            raise ValueError(
                f"For '{op}', evaluator arg '{arg}' and 'var' must have the same shape, but got "
                f"{tensors[arg].shape} and {var_shape}."
            )
    in_place = _is_variable(var) and _is_variable(m)
    # In place the variables keep their dtype; functionally the inputs promote
    # (MindSpore returns float32 for a float16 grad with a float32 var).
    dtype = var.dtype if in_place else max(
        (tf.as_dtype(t.dtype) for t in tensors.values()), key=lambda d: d.size)
    dtype = tf.as_dtype(dtype)
    scalars = [_check_scalar(x, arg, op, dtype) for arg, x in
               (("lr", lr), (_COEFFICIENT_NAMES[rule], coefficient), ("sign_decay", sign_decay),
                ("beta", beta))]
    grad_value = tf.cast(_as_tensor(tensors["grad"]), dtype)
    if in_place:
        var_tf = var.value if isinstance(var, keras.Variable) else var
        m_tf = m.value if isinstance(m, keras.Variable) else m
        if m_tf.dtype != var_tf.dtype:
            raise TypeError(f"For '{op}', 'm' ({m_tf.dtype.name}) and 'var' ({var_tf.dtype.name}) "
                            "variables must have the same dtype.")
        update_sign_variables(rule, var_tf, m_tf, *scalars[:4], grad_value)
        return tf.identity(var_tf), tf.identity(m_tf)
    var_value = tf.cast(_as_tensor(tensors["var"]), dtype)
    m_value = tf.cast(_as_tensor(tensors["m"]), dtype)
    return _sign_step(rule, var_value, m_value, *scalars, grad_value)


@entry_point
def apply_add_sign(var, m, lr, alpha, sign_decay, beta, grad):
    """One AddSign step with MindSpore's ``ops.ApplyAddSign`` contract.

    ``var``/``m`` given as variables are updated in place; given as tensors or
    arrays, nothing is modified. Either way the new ``(var, m)`` values are
    returned.

    Args:
        var, m, grad: float16/32/64 tensors of one shape.
        lr, alpha, sign_decay, beta: float scalars or float tensors of rank <= 1
            holding one element.

    Raises:
        TypeError: a non-float tensor or scalar.
        ValueError: mismatched shapes, or a scalar of rank > 1 or size != 1.
    """
    return _apply("add_sign", var, m, lr, alpha, sign_decay, beta, grad)


@entry_point
def apply_power_sign(var, m, lr, logbase, sign_decay, beta, grad):
    """One PowerSign step with MindSpore's ``ops.ApplyPowerSign`` contract.

    Same arguments, in-place rule and errors as :func:`apply_add_sign`, with
    ``logbase`` (the natural log of the base) in place of ``alpha``.
    """
    return _apply("power_sign", var, m, lr, logbase, sign_decay, beta, grad)
