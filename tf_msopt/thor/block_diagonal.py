"""Block-diagonal Kronecker factors: layout, statistics, damped inverses, preconditioning.

A factor of dimension ``n`` is kept as its ``ceil(n/b)`` diagonal blocks of
size ``b`` (THOR's hardware-driven split; off-diagonal blocks are dropped). The
last block is padded to ``b``: padded rows and columns of the statistics are
zero except for a 1 on the diagonal, so each padded block is invertible and
its padded part never touches a real entry.
"""
import math
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_msopt.ops.inverse import damped_inverse_with_retry, retry_damping

__all__ = ["BlockLayout", "basis_drift", "count_true", "covariance_blocks", "joined",
           "per_block", "robust_eigenvectors", "robust_inverse", "robust_inverses",
           "left_multiply", "right_multiply", "robust_reciprocal", "unjoined"]


class BlockLayout(NamedTuple):
    """How a factor of dimension ``dim`` splits into ``count`` blocks of ``size``."""

    dim: int
    size: int
    count: int

    @classmethod
    def of(cls, dim, block_size):
        size = dim if block_size is None else min(dim, block_size)
        return cls(dim, size, math.ceil(dim / size))

    @property
    def shape(self):
        return (self.count, self.size, self.size)

    @property
    def padding(self):
        return self.count * self.size - self.dim

    def with_padding_identity(self, blocks):
        """``blocks`` (``[count, size, size]``, zero on padded positions) with a 1 on the
        diagonal of each padded position; a constant, built once per trace."""
        return self.with_padding_diagonal(blocks, 1.0)

    def with_padding_diagonal(self, blocks, value):
        """``blocks`` (one or more factors of this layout, stacked: ``[copies * count, size,
        size]``) with ``value`` on the diagonal of each padded position."""
        if not self.padding:
            return blocks
        mask = (np.arange(self.count * self.size) >= self.dim).reshape(self.count, 1, self.size)
        copies = blocks.shape[0] // self.count
        return blocks + tf.constant(value * np.eye(self.size, dtype=np.float32)
                                    * np.tile(mask, (copies, 1, 1)), blocks.dtype)


def _split(matrix, layout, axis):
    """``matrix`` cut along ``axis`` into the layout's blocks (the last one unpadded)."""
    if layout.count == 1:
        return [matrix]
    last = layout.size - layout.padding
    return tf.split(matrix, [layout.size] * (layout.count - 1) + [last], axis=axis)


def _unstack(blocks, layout):
    """``[count, size, size]`` -> the list of blocks, the last one without its padding."""
    if layout.count == 1:
        return [tf.squeeze(blocks, 0)]
    blocks = tf.unstack(blocks, num=layout.count)
    if layout.padding:
        last = layout.size - layout.padding
        blocks[-1] = blocks[-1][:last, :last]
    return blocks


def joined(tensors, axis=0):
    """``tensors`` concatenated along ``axis``; a single one as it is (no op in the trace)."""
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, axis=axis)


def unjoined(tensor, counts):
    """:func:`joined` (along axis 0) undone: ``tensor`` split into parts of ``counts`` rows;
    a single part as it is."""
    return [tensor] if len(counts) == 1 else tf.split(tensor, counts)


# One plain matmul per block: on CPU a batched matmul costs more per call at THOR's small
# shapes, and was not faster at large ones (docs/performance.md).

def covariance_blocks(rows, layout):
    """The diagonal blocks of ``rows^T rows`` (a sum over rows), ``[count, size, size]``,
    zero on padded positions."""
    products = [tf.matmul(part, part, transpose_a=True) for part in _split(rows, layout, 1)]
    if layout.padding:
        products[-1] = tf.pad(products[-1], [[0, layout.padding]] * 2)
    return tf.stack(products)


def left_multiply(blocks, layout, matrix, transpose=False):
    """``blockdiag(blocks) @ matrix`` (``transpose``: ``blockdiag(blocks)^T @ matrix``) for
    ``matrix`` of shape ``[dim, k]``."""
    return joined([tf.matmul(block, part, transpose_a=transpose) for block, part in
                  zip(_unstack(blocks, layout), _split(matrix, layout, 0))], axis=0)


def right_multiply(matrix, blocks, layout, transpose=False):
    """``matrix @ blockdiag(blocks)`` (``transpose``: ``matrix @ blockdiag(blocks)^T``) for
    ``matrix`` of shape ``[k, dim]``."""
    return joined([tf.matmul(part, block, transpose_b=transpose) for part, block in
                  zip(_split(matrix, layout, 1), _unstack(blocks, layout))], axis=1)


def robust_inverse(matrices, damping, previous):
    """``inv(M + damping*I)`` per block that never returns a non-finite block.

    A block whose factorisation fails (not positive definite, or non-finite)
    is retried with more damping; if that fails too, the block of
    ``previous`` is kept.

    Returns:
        ``(inverses, retried, kept)``: the blocks, and how many blocks needed a
        retry and how many kept their previous value (int64 scalars).
    """
    (inverse,), retried, kept = robust_inverses([(matrices, damping, previous)])
    return inverse, retried, kept


def robust_inverses(factors, use=None):
    """:func:`robust_inverse` (blocks ``[count, n, n]``) or :func:`robust_reciprocal`
    (diagonals ``[n]``) of several factors ``[(statistics, damping, previous)]`` at once:
    the blocks of every factor of one size go to one inversion call, and its failed blocks
    to one more.
    ``use`` (a scalar bool per factor, all true if not given): a factor not used keeps
    ``previous`` and counts nothing.

    Returns:
        ``(inverses, retried, kept)``: one inverse per factor, and how many blocks of the
        used factors needed a retry and kept their previous value (int64 scalars).
    """
    use = [tf.constant(True)] * len(factors) if use is None else use
    inverses, retried, kept = [None] * len(factors), [], []
    sizes = {}
    for i, (statistics, damping, previous) in enumerate(factors):
        if statistics.shape.rank == 1:
            inverse, tried, failed = robust_reciprocal(statistics, damping, previous)
            inverses[i] = tf.where(use[i], inverse, previous)
            retried.append(tf.where(use[i], tried, tf.zeros_like(tried)))
            kept.append(tf.where(use[i], failed, tf.zeros_like(failed)))
        else:
            sizes.setdefault(statistics.shape[-1], []).append(i)
    for indices in sizes.values():
        group, tried, failed = _robust_inverse_group([factors[i] for i in indices],
                                                     [use[i] for i in indices])
        for i, inverse in zip(indices, group):
            inverses[i] = inverse
        retried.append(tried)
        kept.append(failed)
    return inverses, tf.add_n(retried), tf.add_n(kept)


def _robust_inverse_group(factors, use):
    """:func:`robust_inverses` of factors whose blocks have one size, in one call."""
    counts = [m.shape[0] for m, _, _ in factors]
    matrices = joined([m for m, _, _ in factors])
    if all(damping is factors[0][1] for _, damping, _ in factors):
        dampings = factors[0][1]    # one for every block
    else:
        dampings = tf.concat([tf.fill([count], tf.cast(damping, matrices.dtype))
                              for count, (_, damping, _) in zip(counts, factors)], axis=0)
    inverses, retried, ok = damped_inverse_with_retry(matrices, dampings)
    used = per_block(tf.stack(use), counts)
    inverses = tf.where(tf.reshape(ok & used, [-1, 1, 1]), inverses,
                        joined([previous for _, _, previous in factors]))
    return (unjoined(inverses, counts), count_true(retried & used),
            count_true(used & tf.logical_not(ok)))


def robust_eigenvectors(statistics, layout, previous, use=True):
    """The eigenvectors (columns, eigenvalues descending) of each block of ``statistics``
    (``[blocks, size, size]``: one or more factors of ``layout`` stacked, zero on padded
    positions), with a zero column in place of each eigenvector whose eigenvalue is at the
    rounding level of the block's largest (``size * eps * max``, the numerical rank's
    tolerance); a block that is not finite, or whose eigenvectors are not, keeps its
    ``previous`` ones. Blocks not in ``use`` (a bool, scalar or per block), as in
    :func:`robust_inverses`: keep ``previous`` and are not counted.

    A gradient has no component along such a direction (its inputs or output gradients never
    vary there: dead units, pixels that are always zero, a softmax's sum); its rotated entry
    would be rounding alone, which Adam's division by its own size would make a full step.
    Padded positions get the eigenvalue -1, so their columns are zero too.

    Returns:
        ``(eigenvectors, kept)``: the blocks, and per block whether it was used and kept
        its previous value (bool ``[blocks]``).
    """
    finite = tf.reduce_all(tf.math.is_finite(statistics), axis=[-2, -1])
    # A block that is not finite is decomposed as zeros (any finite matrix would do) and
    # then keeps its previous eigenvectors. (Reshapes, not ``[:, None, None]``: a slice is
    # four operations in the trace, repeated for each group of factors.)
    finite_weight = tf.reshape(tf.cast(finite, statistics.dtype), [-1, 1, 1])
    matrices = tf.math.multiply_no_nan(layout.with_padding_diagonal(statistics, -1.0),
                                       finite_weight)
    values, vectors = tf.linalg.eigh(matrices)
    rounding = (layout.size * np.finfo(statistics.dtype.as_numpy_dtype).eps
                * tf.reduce_max(values, axis=-1, keepdims=True))
    vectors = tf.reverse(vectors * tf.reshape(tf.cast(values > rounding, vectors.dtype),
                                              [-1, 1, layout.size]), axis=[-1])
    ok = finite & tf.reduce_all(tf.math.is_finite(vectors), axis=[-2, -1])
    return tf.where(tf.reshape(ok & use, [-1, 1, 1]), vectors, previous), ~ok & use


def basis_drift(statistics, eigenvectors):
    """Per block, how far ``eigenvectors`` (``Q``) are from diagonalising ``statistics``
    (``P``): the share of ``P``'s squared Frobenius mass off the diagonal of ``Q^T P Q``,
    0 where ``Q`` is ``P``'s eigenbasis. A rotation keeps the Frobenius norm, so it is
    ``1 - |diag(Q^T P Q)|^2 / |P|^2``: one product ``P Q``; what a zero column of ``Q`` (a
    dropped direction) would carry counts as off the diagonal."""
    diagonal = tf.reduce_sum(eigenvectors * tf.matmul(statistics, eigenvectors), axis=-2)
    return 1.0 - tf.math.divide_no_nan(tf.reduce_sum(tf.square(diagonal), axis=-1),
                                       tf.reduce_sum(tf.square(statistics), axis=[-2, -1]))


def robust_reciprocal(diagonal, damping, previous):
    """``1 / (d + damping)`` elementwise, with :func:`robust_inverse`'s guarantees
    (one block per vector for the counts)."""
    def reciprocal(value):
        ok = tf.math.is_finite(value) & (value > 0)
        return tf.math.reciprocal_no_nan(tf.where(ok, value, 1.0)), ok

    first, ok = reciprocal(diagonal + damping)
    second, second_ok = reciprocal(diagonal + retry_damping(diagonal, damping))
    result = tf.where(ok, first, tf.where(second_ok, second, previous))
    retried = tf.logical_not(tf.reduce_all(ok))
    kept = tf.logical_not(tf.reduce_all(ok | second_ok))
    return result, count_true(retried), count_true(kept)


def per_block(flags, counts):
    """Each factor's flag in ``flags`` repeated over its ``counts`` blocks (one count per
    factor), as it is where every factor has one block. Which factor each block belongs to
    is known when tracing: one gather, not one operation per factor."""
    if all(count == 1 for count in counts):
        return flags
    return tf.gather(flags, np.repeat(np.arange(len(counts)), counts))


def count_true(flags):
    """How many of ``flags`` hold (an int64 scalar)."""
    return tf.reduce_sum(tf.cast(flags, tf.int64))
