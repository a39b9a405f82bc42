"""THOR's preconditioners: what a factored layer's kernel gradient becomes.

A preconditioner owns its part of each layer's curvature state (created by :meth:`build` on
the layer's :class:`~tf_msopt.thor.curvature_estimator.LayerCurvature`), recomputes it from
the layer's factors on refresh steps (:meth:`refresh`) and turns a gradient into a step
(:meth:`step`). ``preconditioner="inverse"`` is MindSpore's, ``"eigenbasis"`` the
default's; another is one more class in :data:`PRECONDITIONERS`.
"""
import tensorflow as tf

from tf_msopt.thor.block_diagonal import (basis_drift, count_true, joined, per_block,
                                          robust_eigenvectors, robust_inverses, unjoined)
from tf_msopt.thor.curvature_base import Preconditioning
from tf_msopt.thor.grafting import adam_step, second_moment

__all__ = ["ADAM_EXPONENT", "EigenbasisPreconditioner", "InversePreconditioner",
           "PRECONDITIONERS"]

#: The exponent of Adam's second moment in an eigenbasis where none is given (SOAP's).
ADAM_EXPONENT = 0.5
#: With an exponent other than Adam's, the rotated second moment is damped by this fraction of
#: its mean: a direction the gradients have not reached takes no huge step.
EIGENBASIS_DAMPING = 1e-2
#: With ``eigenbasis_tolerance`` and moving averages, bases are kept only after this many
#: time constants ``1 / (1 - statistics_decay)`` of statistics updates.
FILLED = 2
#: Factors of one layout with blocks at most this wide are decomposed together, in one call
#: under one conditional taken where any of them needs it (each still keeps or replaces its
#: own basis): fewer conditionals to trace and optimise, for little wasted work. Wider
#: factors each have their own conditional.
GROUPED_SIZE = 128
#: Layouts of blocks at most this wide are decomposed at every refresh, without a
#: conditional: such a decomposition costs less than the conditional.
UNCONDITIONAL_SIZE = 64


def _identity_blocks(shape, dtype=None):
    if len(shape) == 1:
        return tf.ones(shape, dtype)
    return tf.eye(shape[-1], batch_shape=[shape[0]], dtype=dtype)


class InversePreconditioner:
    """MindSpore's: ``A_inv g G_inv`` with the inverses of the damped factors (``a_inverse``,
    ``g_inverse``; without ``precondition_inputs``, ``g G_inv`` and ``a_inverse`` stays the
    identity). A block that cannot be inverted is retried with more damping, then keeps its
    previous inverse (:func:`~tf_msopt.thor.block_diagonal.robust_inverses`)."""

    name = "inverse"
    damps_factors = True     # the inverses read the damping
    step_products = 1        # a step multiplies the gradient by each inverse once

    @staticmethod
    def refresh_flops(size):
        """Operations of one block's inverse: Cholesky, triangular inverse and ``L^-T L^-1``,
        ``size^3 / 3`` multiply-adds each."""
        return 2.0 * size**3

    def __init__(self, block_size, precondition_inputs=True):
        self.block_size, self.precondition_inputs = block_size, precondition_inputs

    @classmethod
    def from_options(cls, options):
        """The preconditioner a :class:`~tf_msopt.thor.options.ThorOptions` describes."""
        return cls(options.block_size, options.experimental.precondition_inputs)

    def statistics_shapes(self, block):
        """The shapes of ``block``'s ``(A, G)`` statistics: both factors are inverted."""
        return block.factor_shapes(self.block_size)

    def preconditioned_sides(self, block):
        """``(A, G)``: whether ``block``'s kernel is preconditioned on its input and its
        output side."""
        return self.precondition_inputs, True

    def build(self, layer, add_variable):
        """Creates ``layer``'s inverses with ``add_variable(shape, initializer, name)``."""
        a_shape, g_shape = layer.block.factor_shapes(self.block_size)
        name = layer.block.name
        layer.a_inverse = add_variable(a_shape, _identity_blocks, f"{name}_a_inverse")
        layer.g_inverse = add_variable(g_shape, _identity_blocks, f"{name}_g_inverse")

    def refreshed_state(self, layer):
        """The variables of ``layer`` that :meth:`refresh` assigns."""
        return [layer.a_inverse, layer.g_inverse] if self.precondition_inputs else [
            layer.g_inverse]

    def refreshed_shapes(self, block):
        """The shapes of :meth:`refreshed_state`, known before it is built."""
        a_shape, g_shape = block.factor_shapes(self.block_size)
        return [a_shape, g_shape] if self.precondition_inputs else [g_shape]

    def refresh(self, refreshes, assign):
        """New inverses for ``refreshes`` (:class:`~tf_msopt.thor.refresh.LayerRefresh` each;
        blocks of one size inverted in one call), assigned where their ``use`` holds. Returns
        the counts of blocks retried and kept, and whether each factor was computed anew
        (left to the caller to reduce, so a refresh that counts nothing adds no op)."""
        inputs = self.precondition_inputs
        factors, use = [], []
        for entry in refreshes:
            layer = entry.layer
            previous = tf.convert_to_tensor(layer.a_inverse), tf.convert_to_tensor(
                layer.g_inverse)
            a_factor, g_factor = layer.block.inversion_factors(entry.a, entry.g, entry.damping,
                                                               previous, self.block_size)
            # Without the input side, A's inverse is never read: G's alone is computed.
            factors += [a_factor, g_factor] if inputs else [g_factor]
            use += [entry.use] * (2 if inputs else 1)
        inverses, retried, kept = robust_inverses(factors, use)
        inverses = iter(inverses)
        for entry in refreshes:
            if inputs:
                assign(entry.layer.a_inverse, next(inverses))
            assign(entry.layer.g_inverse, next(inverses))
        return retried, kept, use

    def stepped_state(self, layer):
        """The variables of ``layer`` that :meth:`step` assigns: none."""
        return []

    def step(self, layer, gradient, correction, assign):
        a_inverse = tf.convert_to_tensor(layer.a_inverse) if self.precondition_inputs else None
        return layer.block.precondition(gradient, Preconditioning(
            a_inverse=a_inverse, g_inverse=tf.convert_to_tensor(layer.g_inverse)),
            self.block_size)


class EigenbasisPreconditioner:
    """The default's: Adam run in the eigenbases of the factors (SOAP), ``Q_A (r /
    (sqrt(v_hat) + eps)) Q_G^T`` with ``r = Q_A^T g Q_G`` and ``v`` Adam's second moment of
    ``r`` (``beta2`` 0.999, ``eps`` 1e-7); ``a_eigenvectors`` (none for a diagonal ``A`` or
    without ``precondition_inputs``), ``g_eigenvectors``, ``rotated_second_moment``.
    Eigenvectors do not depend on the damping.

    ``exponent``: None (1/2 for every kernel), a number in (0, 1], or a dict of layer kinds to
    numbers (1/2 for the kinds it leaves out). Other than 1/2 the step is ``r / (v_hat + 1e-2
    mean(v_hat))^e``, the mean over the layer's entries; 1 is EKFAC's natural gradient in the
    eigenbasis.
    """

    name = "eigenbasis"
    damps_factors = False
    step_products = 2        # a step rotates the gradient into each eigenbasis and back

    def __init__(self, block_size, precondition_inputs=True, exponent=None, tolerance=None,
                 max_rotated_dim=None, statistics_decay=None):
        self.block_size, self.precondition_inputs = block_size, precondition_inputs
        self.exponent, self.tolerance = exponent, tolerance
        self.max_rotated_dim = max_rotated_dim
        # Bases are kept only once the factors' moving averages span FILLED time constants:
        # before, a factor averages a few batches and its small directions still turn.
        self.filled = None if statistics_decay is None else FILLED / (1.0 - statistics_decay)

    @classmethod
    def from_options(cls, options):
        return cls(options.block_size, options.experimental.precondition_inputs,
                   options.eigenbasis_exponent, options.eigenbasis_tolerance,
                   options.max_rotated_dim, options.statistics_decay)

    def refresh_flops(self, size):
        """Operations of one block's refresh: the eigendecomposition with its eigenvectors
        (LAPACK's count, ``9 size^3``) and, with a tolerance, the check of the previous basis
        (``P Q``, ``2 size^3``)."""
        return (9.0 + (2.0 if self.tolerance is not None else 0.0)) * size**3

    def preconditioned_sides(self, block):
        """``(A, G)``: whether ``block``'s kernel is rotated on its input and its output side.
        A diagonal ``A`` (or, without ``precondition_inputs``, any ``A``) is not; with
        ``max_rotated_dim``, neither is a factor wider than that and than the other factor
        (SOAP's one-sided form: the wide side's rotation and statistics cost the most)."""
        a_shape = block.factor_shapes(self.block_size)[0]
        wide = self._too_wide(block)
        return (self.precondition_inputs and len(a_shape) == 3 and not wide[0], not wide[1])

    def _too_wide(self, block):
        """``(A, G)``: whether each factor is wider than ``max_rotated_dim`` and the other."""
        dims = block.a_dim, block.g_dim
        shapes = block.factor_shapes(self.block_size)
        if self.max_rotated_dim is None or any(len(shape) != 3 for shape in shapes):
            return False, False
        return tuple(dim == max(dims) > self.max_rotated_dim and min(dims) < dim
                     for dim in dims)

    def statistics_shapes(self, block):
        """The shapes of ``block``'s ``(A, G)`` statistics; ``(0,)`` for a factor too wide to
        be rotated: nothing reads it, so nothing estimates it."""
        return tuple((0,) if wide else shape for shape, wide in zip(
            block.factor_shapes(self.block_size), self._too_wide(block)))

    def exponent_of(self, kind):
        """The exponent of the rotated second moment for a layer of block ``kind``."""
        if isinstance(self.exponent, dict):
            return self.exponent.get(kind, ADAM_EXPONENT)
        return ADAM_EXPONENT if self.exponent is None else self.exponent

    def build(self, layer, add_variable):
        block, name = layer.block, layer.block.name
        a_shape, g_shape = block.factor_shapes(self.block_size)
        rotate_a, rotate_g = self.preconditioned_sides(block)
        if rotate_g:
            layer.g_eigenvectors = add_variable(g_shape, _identity_blocks,
                                                f"{name}_g_eigenvectors")
        layer.rotated_second_moment = add_variable((block.kernel_elements,), "zeros",
                                                   f"{name}_rotated_second_moment")
        if rotate_a:
            layer.a_eigenvectors = add_variable(a_shape, _identity_blocks,
                                                f"{name}_a_eigenvectors")

    def refreshed_state(self, layer):
        """The variables of ``layer`` that :meth:`refresh` assigns."""
        return [vectors for vectors in (layer.g_eigenvectors, layer.a_eigenvectors)
                if vectors is not None]

    def refreshed_shapes(self, block):
        """The shapes of :meth:`refreshed_state`, known before it is built."""
        a_shape, g_shape = block.factor_shapes(self.block_size)
        rotate_a, rotate_g = self.preconditioned_sides(block)
        return [shape for shape, rotated in ((g_shape, rotate_g), (a_shape, rotate_a))
                if rotated]

    def refresh(self, refreshes, assign):
        """The eigenvectors of the factors of ``refreshes``
        (:class:`~tf_msopt.thor.refresh.LayerRefresh` each; their damping is not read),
        assigned where their ``use`` holds (and, with a tolerance, where the previous basis
        no longer holds): the factors of one layout with blocks of at most ``GROUPED_SIZE``
        in one call under one conditional (none up to ``UNCONDITIONAL_SIZE``), wider ones
        each under its own. Returns None (no block is retried), the count of blocks kept
        and whether each factor was decomposed (left to the caller to reduce)."""
        groups = {}
        for entry in refreshes:
            layer = entry.layer
            block, sides, filling = layer.block, [], self._filling(layer)
            if layer.g_eigenvectors is not None:
                sides.append((layer.g_eigenvectors, entry.g, block.g_layout(self.block_size)))
            if layer.a_eigenvectors is not None:
                sides.append((layer.a_eigenvectors, entry.a, block.a_layout(self.block_size)))
            for variable, statistics, layout in sides:
                key = layout if layout.size <= GROUPED_SIZE else (layout, id(variable))
                groups.setdefault(key, []).append((layout, variable, statistics, entry.use,
                                                   filling))
        # Each group's bookkeeping is repeated in the trace, so it is kept to few operations
        # (the refresh's graph is most of what THOR adds to a small model's first step): no
        # concatenation or split of a single factor, a decision per factor spread over its
        # blocks only where it has several, and one count of the kept blocks of all groups.
        kept, decomposed = [], []
        for members in groups.values():
            layouts, variables, statistics, used, filling = zip(*members)
            layout = layouts[0]
            counts = [layout.count] * len(members)
            statistics = joined(statistics)
            previous = joined([tf.convert_to_tensor(v) for v in variables])
            decompose = tf.stack(used)
            if self.tolerance is not None:
                # A basis that still diagonalises its factor is kept: its decomposition is
                # the refresh's cost, and a factor that barely moved would return it.
                moved = basis_drift(statistics, previous) > self.tolerance
                if layout.count > 1:
                    moved = tf.reduce_any(tf.reshape(moved, [len(members), -1]), axis=1)
                decompose &= tf.stack(filling) | moved
            use = per_block(decompose, counts)
            decomposed.append(decompose)
            if layout.size <= UNCONDITIONAL_SIZE:
                vectors, failed = robust_eigenvectors(statistics, layout, previous, use)
            else:
                vectors, failed = tf.cond(
                    tf.reduce_any(decompose),
                    lambda s=statistics, l=layout, p=previous, u=use: robust_eigenvectors(
                        s, l, p, u),
                    lambda p=previous: (p, tf.zeros(p.shape[:1], tf.bool)))
            for variable, part in zip(variables, unjoined(vectors, counts)):
                assign(variable, part)
            kept.append(failed)
        return None, count_true(joined(kept)), joined(decomposed)

    def _filling(self, layer):
        """Whether ``layer``'s moving averages are still filling (no average: never)."""
        if self.filled is None:
            return tf.constant(False)
        return tf.convert_to_tensor(layer.count) < self.filled

    def stepped_state(self, layer):
        """The variables of ``layer`` that :meth:`step` assigns."""
        return [layer.rotated_second_moment]

    def step(self, layer, gradient, correction, assign):
        """Adam's step without its first moment on ``gradient`` rotated into the eigenbases,
        ``Q_A^T g Q_G``, rotated back (``correction``: Adam's bias correction, this step's)."""
        a, g = (None if vectors is None else tf.convert_to_tensor(vectors)
                for vectors in (layer.a_eigenvectors, layer.g_eigenvectors))
        rotated = layer.block.precondition(gradient, Preconditioning(
            a_inverse=a, g_inverse=g, transpose_a=True), self.block_size)
        scaled = self._scaled(layer.rotated_second_moment, rotated, correction, assign,
                              self.exponent_of(layer.block.kind))
        return layer.block.precondition(scaled, Preconditioning(
            a_inverse=a, g_inverse=g, transpose_g=True), self.block_size)

    @staticmethod
    def _scaled(moment, rotated, correction, assign, exponent):
        """Adam's ``r / (sqrt(v_hat) + eps)`` at exponent 1/2, else ``r / (v_hat + 1e-2
        mean(v_hat))^e``."""
        if exponent == ADAM_EXPONENT:
            return adam_step(moment, rotated, correction, assign)
        estimate = second_moment(moment, rotated, correction, assign)
        return tf.math.divide_no_nan(rotated, _power(
            estimate + EIGENBASIS_DAMPING * tf.reduce_mean(estimate), exponent))


def _power(x, exponent):
    """``x^exponent`` for ``x >= 0``. Quarter powers go through square roots: ``tf.pow`` (an
    exponential and a logarithm per element) takes about five times as long on a large
    kernel's rotated second moment."""
    if exponent == 1:
        return x
    if exponent in (0.25, 0.75):
        quarter = tf.sqrt(tf.sqrt(x))
        return quarter if exponent == 0.25 else tf.sqrt(x) * quarter
    return tf.pow(x, exponent)


PRECONDITIONERS = {cls.name: cls for cls in (InversePreconditioner, EigenbasisPreconditioner)}
