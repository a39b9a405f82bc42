"""THOR's damped block inverse: ``inv(M + damping * I)`` for a batch of SPD blocks.

For each ``n x n`` block ``M`` of ``matrices`` (shape ``[..., n, n]``)::

    A = M + damping * I,   A = L L^T (Cholesky),   inv(A) = L^-T L^-1

Only the lower triangle of ``M`` is read (as ``tf.linalg.cholesky`` does), so
``M`` is meant to be symmetric; a block counts as failed when any of its
entries is NaN/Inf, when ``A`` is not positive definite, or when its inverse
overflows.

Back-ends, picked when the op is traced (``inverse_backend()`` names the one in use):

- the compiled ``MsOptDampedInverse`` op (``custom_ops/damped_inverse.cc``):
  damping, Cholesky, triangular inverse and ``L^-T L^-1`` fused in one
  multi-threaded CPU kernel; on GPU (when built with CUDA,
  ``damped_inverse.cu``) one thread block per matrix runs Gauss-Jordan
  elimination, whose pivots are positive exactly when Cholesky's are. Used
  outside XLA when the op library is loaded and ``TF_MSOPT_DISABLE_CUSTOM_OPS``
  is not set.
- otherwise, and always inside ``tf.function(jit_compile=True)`` (XLA cannot
  compile the custom op): ``tf.linalg.cholesky`` + ``cholesky_solve``. On
  TensorFlow 2.21 a failed factorisation fills the block's Cholesky factor with
  NaN (CPU, GPU and XLA alike) instead of raising, so failures are detected
  from the finiteness of the result.

The compiled op has no gradient (THOR does not differentiate through it).
"""
import numbers

import keras
import numpy as np
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import entry_point, in_xla_context
from tf_msopt.ops._loader import load_custom_ops

__all__ = ["damped_inverse", "damped_inverse_with_status", "damped_inverse_with_retry",
           "retry_damping", "inverse_backend"]

OP_NAME = "MsOptDampedInverse"
RETRY_OP_NAME = "MsOptDampedInverseRetry"
_OWNER = "damped_inverse"
_DTYPES = (tf.float32, tf.float64)


def _check_matrices(matrices):
    if isinstance(matrices, keras.Variable):
        matrices = matrices.value
    if not isinstance(matrices, (tf.Tensor, tf.Variable)):
        matrices = tf.convert_to_tensor(matrices)
    if matrices.dtype not in _DTYPES:
        raise TypeError(f"For '{_OWNER}', the 'matrices' must be a float32 or float64 tensor, "
                        f"but got {matrices.dtype.name}.")
    shape = matrices.shape
    if shape.rank is not None:
        if shape.rank < 2:
            raise ValueError(f"For '{_OWNER}', the 'matrices' must have rank >= 2 (shape "
                             f"[..., n, n]), but got shape {shape}.")
        rows, cols = shape[-2], shape[-1]
        if rows is not None and cols is not None and rows != cols:
            raise ValueError(f"For '{_OWNER}', the 'matrices' must be square in the last two "
                             f"dimensions, but got shape {shape}.")
    return tf.convert_to_tensor(matrices)


def _check_damping(damping, dtype):
    if isinstance(damping, (bool, np.bool_)):
        raise TypeError(f"For '{_OWNER}', the 'damping' must be a real number or a 0-D real "
                        f"tensor, but got bool.")
    if isinstance(damping, numbers.Real):
        return tf.constant(damping, dtype)
    if isinstance(damping, keras.Variable):
        damping = damping.value
    try:
        tensor = tf.convert_to_tensor(damping)
    except (TypeError, ValueError) as err:
        raise TypeError(f"For '{_OWNER}', the 'damping' must be a real number or a 0-D real "
                        f"tensor, but got {type(damping).__name__}.") from err
    if not (tensor.dtype.is_floating or tensor.dtype.is_integer):
        raise TypeError(f"For '{_OWNER}', the 'damping' must be a real number or a 0-D real "
                        f"tensor, but got a {tensor.dtype.name} tensor.")
    if tensor.shape.rank != 0:
        raise ValueError(f"For '{_OWNER}', the 'damping' must be a scalar (rank 0), but got "
                         f"shape {tensor.shape}.")
    return tf.cast(tensor, dtype)


def _loaded_op():
    """The compiled op's wrapper, or None when the library (or this op in it) is not loaded."""
    return getattr(load_custom_ops(), "ms_opt_damped_inverse", None)


def _op():
    """The compiled op when this trace may use it (never inside XLA)."""
    return None if in_xla_context() else _loaded_op()


def _loaded_retry_op():
    return getattr(load_custom_ops(), "ms_opt_damped_inverse_retry", None)


def _identity_like(blocks):
    shape = tf.shape(blocks)
    return tf.eye(shape[-1], batch_shape=shape[:-2], dtype=blocks.dtype)


def _damped(matrices, damping):
    return tf.linalg.set_diag(matrices, tf.linalg.diag_part(matrices) + damping)


def _all_finite(blocks):
    return tf.reduce_all(tf.math.is_finite(blocks), axis=[-2, -1])


def _keep_ok(inverses, ok):
    return tf.where(ok[..., None, None], inverses, tf.zeros_like(inverses))


def _tf_linalg_with_status(matrices, damping):
    damped = _damped(matrices, damping)
    inverse = tf.linalg.cholesky_solve(tf.linalg.cholesky(damped), _identity_like(damped))
    inverse = 0.5 * (inverse + tf.linalg.matrix_transpose(inverse))  # as the op: exactly symmetric
    ok = _all_finite(matrices) & tf.math.is_finite(damping) & _all_finite(inverse)
    return _keep_ok(inverse, ok), ok


def _with_status(matrices, damping):
    op = _op()
    if op is not None:
        return op(matrices, damping)
    return _tf_linalg_with_status(matrices, damping)


def damped_inverse_with_status(matrices, damping):
    """``inv(M + damping * I)`` per block, and which blocks succeeded; never raises on numbers.

    Works eagerly, in ``tf.function`` (with or without ``jit_compile``) and in
    ``tf.distribute`` replica or cross-replica code.

    Args:
        matrices: float32/float64 tensor ``[..., n, n]`` of symmetric blocks (the
            lower triangle is read).
        damping: a real number or 0-D tensor added to each block's diagonal.

    Returns:
        ``(inverses, ok)``: ``inverses`` has the shape and dtype of ``matrices``;
        ``ok`` is a bool tensor of the batch shape ``[...]``, True where the block
        was finite and its damped form factorised (positive definite) with a
        finite inverse. Failed blocks have all-zero inverses.

    Raises:
        TypeError: ``matrices`` is not float32/float64, or ``damping`` is not real.
        ValueError: ``matrices`` has rank < 2 or non-square blocks, or ``damping``
            is not a scalar.
    """
    matrices = _check_matrices(matrices)
    damping = _check_damping(damping, matrices.dtype)
    return _with_status(matrices, damping)


def _failure_message(ok):
    failed = np.argwhere(~ok.numpy()).tolist()
    return (f"For '{_OWNER}', every block of 'matrices' plus damping * I must be finite and "
            f"positive definite, but {len(failed)} of {ok.numpy().size} blocks are not, at batch "
            f"indices {failed}.")


@entry_point
def damped_inverse(matrices, damping):
    """``inv(M + damping * I)`` for a batch ``[..., n, n]`` of symmetric positive definite ``M``.

    THOR's block inverse, usable on its own. The op path fuses
    damping, Cholesky and the triangular inverse; see the module docstring for
    the back-ends and :func:`inverse_backend` for the one in use.

    Args:
        matrices: float32/float64 tensor ``[..., n, n]`` of symmetric blocks (the
            lower triangle is read).
        damping: a real number or 0-D tensor added to each block's diagonal.

    Returns:
        The inverses, with the shape and dtype of ``matrices``.

    Raises:
        TypeError, ValueError: as :func:`damped_inverse_with_status`.
        tf.errors.InvalidArgumentError: a block has NaN/Inf entries or its damped
            form is not positive definite (eagerly at the call, in a graph when
            it runs). Under ``jit_compile=True`` nothing can be raised: such
            blocks come back filled with NaN.
    """
    matrices = _check_matrices(matrices)
    damping = _check_damping(damping, matrices.dtype)
    inverse, ok = _with_status(matrices, damping)
    if in_xla_context():  # nothing can be raised from compiled code
        return tf.where(ok[..., None, None], inverse, tf.fill(tf.shape(inverse), np.nan))
    if tf.executing_eagerly():
        if not bool(tf.reduce_all(ok)):
            raise tf.errors.InvalidArgumentError(None, None, _failure_message(ok))
        return inverse
    check = tf.debugging.Assert(
        tf.reduce_all(ok),
        [f"For '{_OWNER}', every block of 'matrices' plus damping * I must be finite and "
         "positive definite; failed batch indices:", tf.where(~ok)], summarize=16)
    with tf.control_dependencies([check]):
        return tf.identity(inverse)


def retry_damping(diagonal, damping):
    """THOR's damping for a second try, per block (the last axis of ``diagonal`` is one
    block's diagonal): ten times ``damping``, and at least a small fraction of the block's
    mean finite diagonal entry (so that damping 0 on singular statistics also gets a second
    try, whatever non-finite entry sits beside it)."""
    finite = tf.math.is_finite(diagonal)
    mean = tf.math.divide_no_nan(
        tf.reduce_sum(tf.where(finite, tf.abs(diagonal), 0.0), axis=-1),
        tf.reduce_sum(tf.cast(finite, diagonal.dtype), axis=-1))
    return tf.maximum(10.0 * damping, 1e-4 * mean) + 1e-6


def _invert_damped(matrices, diagonal, damping):
    """:func:`damped_inverse_with_status` of ``matrices`` whose diagonal is ``diagonal``,
    with a damping per block (bit-identical to the op adding it: one addition either way)."""
    damped = tf.linalg.set_diag(matrices, diagonal + damping[..., None])
    return _with_status(damped, tf.zeros([], matrices.dtype))


def damped_inverse_with_retry(matrices, damping):
    """:func:`damped_inverse_with_status` with a second try: a block that fails with its
    ``damping`` is inverted again with :func:`retry_damping`.

    Args:
        matrices: float32/float64 tensor ``[batch, n, n]`` of symmetric blocks.
        damping: the damping of each block, a tensor ``[batch]`` (or a scalar for all).

    Returns:
        ``(inverses, retried, ok)``: ``retried`` (bool ``[batch]``) where the first try
        failed, ``ok`` where one of the tries succeeded; failed blocks are all zero.

    Raises:
        TypeError, ValueError: as :func:`damped_inverse_with_status`, and ValueError for a
            ``damping`` that is neither a scalar nor of the batch shape.
    """
    matrices = _check_matrices(matrices)
    damping = (tf.cast(damping, matrices.dtype) if tf.is_tensor(damping)
               else tf.constant(damping, matrices.dtype))
    if damping.shape.rank == 0:
        damping = tf.broadcast_to(damping, tf.shape(matrices)[:-2])
    elif not damping.shape.is_compatible_with(matrices.shape[:-2]):
        raise ValueError(f"For '{_OWNER}', the 'damping' must be a scalar or have the batch "
                         f"shape {matrices.shape[:-2]}, but got shape {damping.shape}.")
    fused = _loaded_retry_op() if inverse_backend() == "custom op (CPU)" else None
    if fused is not None:
        # One op: the retry in the graph is about thirty ops, dearer to trace and start
        # than inverting small blocks. (A library built before it existed has not got it.)
        return fused(matrices, damping)
    diagonal = tf.linalg.diag_part(matrices)
    inverses, ok = _invert_damped(matrices, diagonal, damping)
    retried = tf.logical_not(ok)
    if in_xla_context():
        # Compiled code needs static shapes: every block is retried, under a conditional.
        def retry():
            second, second_ok = _invert_damped(matrices, diagonal,
                                               retry_damping(diagonal, damping))
            return tf.where(ok[:, None, None], inverses, second), ok | second_ok

        inverses, ok = tf.cond(tf.reduce_all(ok), lambda: (inverses, ok), retry)
        return inverses, retried, ok
    # Only the failed blocks (usually none) are inverted again, with no conditional: one
    # costs far more to build and start than a few ops on an empty batch.
    failed = tf.where(retried)
    failed_diagonal = tf.gather_nd(diagonal, failed)
    second, second_ok = _invert_damped(
        tf.gather_nd(matrices, failed), failed_diagonal,
        retry_damping(failed_diagonal, tf.gather_nd(damping, failed)))
    return (tf.tensor_scatter_nd_update(inverses, failed, second), retried,
            tf.tensor_scatter_nd_update(ok, failed, second_ok))


def _has_gpu_kernel():
    return "GPU" in compat.registered_kernel_devices(OP_NAME)


def inverse_backend():
    """Short name of the back-end :func:`damped_inverse` uses if called here and now.

    One of ``"custom op (GPU)"``, ``"custom op (CPU)"``, ``"tf.linalg (XLA)"``
    (inside ``jit_compile=True``) or ``"tf.linalg (custom op not loaded)"``; then
    ``tf_msopt.ops.custom_ops_status()`` says why.
    """
    if in_xla_context():
        return "tf.linalg (XLA)"
    if _loaded_op() is None:
        return "tf.linalg (custom op not loaded)"
    if tf.config.list_logical_devices("GPU") and _has_gpu_kernel():
        return "custom op (GPU)"
    return "custom op (CPU)"
