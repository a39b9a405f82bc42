"""THOR's curvature estimator: the layers' curvature state, its averages and inversions.

The estimator owns one :class:`LayerCurvature` per layer with Kronecker factors: its
inverses and, with the options that need them, the moving averages of its statistics
and the trace rule's state. Each step the optimizer hands it the statistics its
layers captured (per replica), the damping and the scale of ``G``; the estimator
sums them over replicas (one all-reduce per bucket), updates the averages, applies
the trace rule and recomputes the inverses on the steps the optimizer's schedule
says. It reads nothing back from the optimizer.
"""
import dataclasses

import tensorflow as tf

from tf_msopt.thor.block_diagonal import robust_eigenvectors, robust_inverses
from tf_msopt.thor.curvature_base import CurvatureBlock, Preconditioning
from tf_msopt.thor.execution import TracedOnce, buckets, on_each_device, sum_over_replicas, when
from tf_msopt.thor.grafting import adam_step, second_moment
from tf_msopt.thor.options import ADAM_EXPONENT

__all__ = ["CurvatureEstimator", "LayerCurvature"]


#: With an exponent other than Adam's, the rotated second moment is damped by this fraction of
#: its mean: a direction the gradients have not reached takes no huge step.
EIGENBASIS_DAMPING = 1e-2


def rotated_step(moment, rotated, step, assign, exponent=ADAM_EXPONENT):
    """The step on a gradient ``rotated`` into an eigenbasis: Adam's
    ``r / (sqrt(v_hat) + eps)`` at exponent 1/2, else ``r / (v_hat + 1e-2 mean(v_hat))^e``
    (exponent 1: EKFAC's natural gradient in that basis); ``v_hat`` as :func:`second_moment`."""
    if exponent == ADAM_EXPONENT:
        return adam_step(moment, rotated, step, assign)
    estimate = second_moment(moment, rotated, step, assign)
    return tf.math.divide_no_nan(rotated, tf.pow(
        estimate + EIGENBASIS_DAMPING * tf.reduce_mean(estimate), exponent))


def _identity_blocks(shape, dtype=None):
    if len(shape) == 1:
        return tf.ones(shape, dtype)
    return tf.eye(shape[-1], batch_shape=[shape[0]], dtype=dtype)


@dataclasses.dataclass
class LayerCurvature:
    """The curvature state of one layer with Kronecker factors (optimizer variables).

    Attributes:
        block: the layer's curvature block.
        a_inverse, g_inverse: the inverses of its damped factors (``preconditioner="inverse"``;
            ``a_inverse`` stays the identity without ``precondition_inputs``).
        a_eigenvectors, g_eigenvectors, rotated_second_moment: with
            ``preconditioner="eigenbasis"``, the eigenvectors of its factors (none for ``A``
            when it is diagonal or its side is not preconditioned) and Adam's second moment
            of the gradient rotated into them, flat.
        a_average, g_average, count: with ``statistics_decay``, the moving averages of
            ``A`` and ``G`` and how many updates they have had.
        trace, trace_decisions: with ``trace_thresholds``, the trace of the last
            inversion and the counts of ``(refreshed, reused, frozen)`` inversions.
    """

    block: CurvatureBlock
    a_inverse: object = None
    g_inverse: object = None
    a_eigenvectors: object = None
    g_eigenvectors: object = None
    rotated_second_moment: object = None
    a_average: object = None
    g_average: object = None
    count: object = None
    trace: object = None
    trace_decisions: object = None

    @property
    def device_variable(self):
        """A variable of this state: says on which device a per-device function runs."""
        return self.g_inverse if self.g_inverse is not None else self.g_eigenvectors

    def inverses(self):
        return tf.convert_to_tensor(self.a_inverse), tf.convert_to_tensor(self.g_inverse)

    def precondition(self, gradient, block_size, inputs=True):
        """The block's preconditioned ``gradient`` with the current inverses; on the output
        side only (``A_inv`` left out) unless ``inputs``."""
        a_inverse, g_inverse = self.inverses()
        return self.block.precondition(
            gradient, Preconditioning(a_inverse=a_inverse if inputs else None,
                                      g_inverse=g_inverse), block_size)

    def eigenbasis_step(self, gradient, block_size, step, assign, exponent=ADAM_EXPONENT):
        """Adam's step (no first moment; see :func:`rotated_step` for ``exponent``) on
        ``gradient`` rotated into the eigenbases of the factors, ``Q_A^T g Q_G``, rotated
        back."""
        a = None if self.a_eigenvectors is None else tf.convert_to_tensor(self.a_eigenvectors)
        g = tf.convert_to_tensor(self.g_eigenvectors)
        rotated = self.block.precondition(gradient, Preconditioning(
            a_inverse=None if a is None else tf.linalg.matrix_transpose(a), g_inverse=g),
            block_size)
        scaled = rotated_step(self.rotated_second_moment, rotated, step, assign, exponent)
        return self.block.precondition(scaled, Preconditioning(
            a_inverse=a, g_inverse=tf.linalg.matrix_transpose(g)), block_size)


class CurvatureEstimator:
    """Curvature state and its updates for the factored layers among ``blocks``.

    Args:
        blocks: the curvature blocks of the treated layers (those without factors are
            skipped).
        options: the optimizer's :class:`~tf_msopt.thor.options.ThorOptions`
            (``block_size``, ``split_indices``, ``damping_mode``, ``statistics_decay``,
            ``trace_thresholds``).
        is_inverse_step: returns whether this step recomputes the inverses (a bool
            tensor, or the Python ``True``); called while a step is traced.
        assign, assign_add: ``(variable, value)``, the optimizer's (through which Keras
            keeps sparse updates sparse).
    """

    def __init__(self, blocks, options, is_inverse_step, assign, assign_add):
        self.blocks = tuple(block for block in blocks if block.has_factors)
        self.options = options
        self.is_inverse_step = is_inverse_step
        self._assign = assign
        self._assign_add = lambda variable, value: assign_add(
            variable, tf.cast(value, variable.dtype))
        self.layers = []
        self.damping_retries = self.failed_inverses = None
        self.traced_refresh = TracedOnce(self._refresh_bucket)

    # --- state

    def build_layers(self, add_variable):
        """Creates each layer's state with ``add_variable(shape, initializer, name, dtype)``
        (the optimizer's), in the order checkpoints hold it."""
        options = self.options
        for block in self.blocks:
            a_shape, g_shape = block.factor_shapes(options.block_size)
            if options.preconditioner == "inverse":
                layer = LayerCurvature(
                    block, add_variable(a_shape, _identity_blocks, f"{block.layer}_a_inverse"),
                    add_variable(g_shape, _identity_blocks, f"{block.layer}_g_inverse"))
            else:
                layer = LayerCurvature(
                    block, g_eigenvectors=add_variable(g_shape, _identity_blocks,
                                                       f"{block.layer}_g_eigenvectors"),
                    rotated_second_moment=add_variable(
                        (block.kernel_elements,), "zeros",
                        f"{block.layer}_rotated_second_moment"))
                if options.precondition_inputs and len(a_shape) == 3:
                    layer.a_eigenvectors = add_variable(a_shape, _identity_blocks,
                                                        f"{block.layer}_a_eigenvectors")
            if options.statistics_decay is not None:
                layer.a_average = add_variable(a_shape, "zeros", f"{block.layer}_a_average")
                layer.g_average = add_variable(g_shape, "zeros", f"{block.layer}_g_average")
                layer.count = add_variable((), "zeros", f"{block.layer}_statistics_count")
            if options.trace_thresholds is not None:
                layer.trace = add_variable((), "zeros", f"{block.layer}_trace")
                # (refreshed, reused, frozen) inversions
                layer.trace_decisions = add_variable((3,), "zeros",
                                                     f"{block.layer}_trace_decisions", "int64")
            self.layers.append(layer)

    def build_counters(self, add_variable):
        """Creates the counts of blocks whose inversion was retried and that kept their
        previous inverse (after the optimizer's own variables, as checkpoints hold them)."""
        self.damping_retries = add_variable((), "zeros", "damping_retries", "int64")
        self.failed_inverses = add_variable((), "zeros", "failed_inverses", "int64")

    def trace_decisions(self):
        """``{layer name: (refreshed, reused, frozen)}`` with ``trace_thresholds``."""
        return {layer.block.layer: tuple(int(n) for n in layer.trace_decisions.numpy())
                for layer in self.layers if layer.trace_decisions is not None}

    # --- the update

    def update(self, distribution, statistics, damping, g_scale, is_statistics_step):
        """Sums this replica's ``statistics`` (``(a, g, rows)`` per layer) over replicas and
        updates the averages and inverses, where ``is_statistics_step`` holds (cross-replica
        context). ``damping`` is ``sqrt(lambda)``, ``g_scale`` what ``G`` is multiplied by."""
        if not statistics:
            return

        def refresh():
            for bucket in buckets(len(statistics), self.options.split_indices):
                first = self.layers[bucket[0]].device_variable
                reduced = sum_over_replicas(
                    distribution, [value for index in bucket for value in statistics[index]],
                    first)
                summed = [reduced[3 * offset:3 * offset + 3] for offset in range(len(bucket))]
                on_each_device(distribution, first, self.traced_refresh,
                               (bucket, summed, damping, g_scale))
            return tf.constant(True)

        when(is_statistics_step, refresh)

    def _refresh_bucket(self, device_variable, bucket, statistics, damping, g_scale):
        """One bucket's layers on one device, from statistics summed over replicas: the
        moving averages (with ``statistics_decay``), then new inverses on inverse steps.
        ``device_variable`` (a variable of the bucket's first layer there) only says which
        device."""
        decay = self.options.statistics_decay
        fresh = []
        for index, (a, g, rows) in zip(bucket, statistics):
            observed = rows > 0
            rows = tf.maximum(rows, 1.0)
            a, g = a / rows, g / rows * g_scale
            if decay is None:
                fresh.append((self.layers[index], a, g, observed))
            else:
                self._update_averages(self.layers[index], a, g, observed)
        if decay is None:   # statistics steps are inverse steps
            return self._invert(fresh, damping)
        # The bias-corrected averages are read only where they are inverted.
        return when(self.is_inverse_step(), lambda: self._invert(
            [self._corrected_averages(self.layers[index]) for index in bucket], damping))

    def _update_averages(self, layer, a, g, observed):
        """Updates one layer's moving averages of A and G and its count of updates."""
        beta = self.options.statistics_decay
        # A step whose statistics are not finite leaves the averages alone.
        update = observed & tf.reduce_all(tf.math.is_finite(a)) & tf.reduce_all(
            tf.math.is_finite(g))
        for average, value in ((layer.a_average, a), (layer.g_average, g)):
            self._assign(average,
                         tf.where(update, beta * average + (1.0 - beta) * value, average))
        self._assign_add(layer.count, update)

    def _corrected_averages(self, layer):
        """``(layer, A, G, observed)`` from its bias-corrected moving averages; observed once
        anything is averaged."""
        count = tf.convert_to_tensor(layer.count)
        correction = 1.0 - tf.pow(tf.constant(self.options.statistics_decay),
                                  tf.maximum(count, 1.0))
        return (layer, tf.convert_to_tensor(layer.a_average) / correction,
                tf.convert_to_tensor(layer.g_average) / correction, count > 0)

    def _layer_damping(self, block, a, g, damping):
        """``(d_A, d_G)``: ``sqrt(lambda)`` on both, split by the factors' traces ("pi"), or
        in units of each factor's mean eigenvalue ("relative")."""
        if self.options.damping_mode == "sqrt":
            return damping, damping
        a_mean, g_mean = block.mean_eigenvalues(a, g, self.options.block_size)
        if self.options.damping_mode == "relative":
            return damping * _positive_or_one(a_mean), damping * _positive_or_one(g_mean)
        pi = _positive_or_one(tf.sqrt(tf.math.divide_no_nan(a_mean, g_mean)))
        return damping * pi, damping / pi

    def _invert(self, fresh, damping):
        """New inverses for ``fresh`` (``(layer, a, g, observed)``), where ``observed`` and
        the trace rule (if any) say so."""
        damped = self.options.damps_factors
        fresh = [(layer, a, g, observed,
                  self._layer_damping(layer.block, a, g, damping) if damped else None)
                 for layer, a, g, observed in fresh]
        if self.options.trace_thresholds is None:
            self._assign_factors(fresh)
            return tf.constant(True)
        for layer, a, g, observed, layer_damping in fresh:
            refresh = self._trace_rule(layer, layer.block.damped_trace(
                a, g, layer_damping, self.options.block_size), observed)
            inversion = (layer, a, g, refresh, layer_damping)
            # The rule exists to save the inversion: skip it, not only its result.
            tf.cond(refresh, lambda inversion=inversion: self._assign_factors([inversion]),
                    lambda: tf.constant(False))
        return tf.constant(True)

    def _assign_factors(self, inversions):
        """New inverses, or eigenvectors with ``preconditioner="eigenbasis"``."""
        if self.options.preconditioner == "eigenbasis":
            return self._assign_eigenvectors(inversions)
        return self._assign_inverses(inversions)

    def _assign_eigenvectors(self, inversions):
        """The eigenvectors of the factors of ``inversions`` (``(layer, a, g, use, damping)``;
        damping leaves them unchanged), assigned where ``use`` holds."""
        block_size, kept = self.options.block_size, []
        for layer, a, g, used, _ in inversions:
            block = layer.block
            sides = [(layer.g_eigenvectors, g, block.g_layout(block_size))]
            if layer.a_eigenvectors is not None:
                sides.append((layer.a_eigenvectors, a, block.a_layout(block_size)))
            for variable, statistics, layout in sides:
                vectors, failed = robust_eigenvectors(statistics, layout,
                                                      tf.convert_to_tensor(variable), used)
                self._assign(variable, vectors)
                kept.append(failed)
        self._assign_add(self.failed_inverses, tf.add_n(kept))
        return tf.constant(True)

    def _assign_inverses(self, inversions):
        """Inverts every factor of ``inversions`` (``(layer, a, g, use, damping)``; blocks of
        one size in one call) and assigns them where ``use`` holds."""
        # Without the input side, A's inverse is never read: G's alone is computed.
        inputs = self.options.precondition_inputs
        factors, use = [], []
        for layer, a, g, used, layer_damping in inversions:
            a_factor, g_factor = layer.block.inversion_factors(
                a, g, layer_damping, layer.inverses(), self.options.block_size)
            factors += [a_factor, g_factor] if inputs else [g_factor]
            use += [used] * (2 if inputs else 1)
        inverses, retried, kept = robust_inverses(factors, use)
        inverses = iter(inverses)
        for layer, *_ in inversions:
            if inputs:
                self._assign(layer.a_inverse, next(inverses))
            self._assign(layer.g_inverse, next(inverses))
        self._assign_add(self.damping_retries, retried)
        self._assign_add(self.failed_inverses, kept)
        return tf.constant(True)

    def _trace_rule(self, layer, trace, observed):
        """THOR's per-layer rule; returns whether to invert, counts the decision."""
        omega1, omega2 = self.options.trace_thresholds
        previous, decisions = layer.trace, layer.trace_decisions
        frozen = decisions[2] > 0
        change = tf.math.divide_no_nan(tf.abs(tf.abs(trace) - tf.abs(previous)),
                                       tf.abs(previous))
        first = tf.equal(previous, 0.0)
        refresh = observed & ~frozen & (first | (change > omega1))
        freeze = observed & ~frozen & ~first & (change <= omega2)
        reuse = observed & ~frozen & ~refresh & ~freeze
        self._assign_add(decisions, tf.cast(tf.stack([refresh, reuse, freeze | (
            observed & frozen)]), tf.int64))
        self._assign(previous, tf.where(observed & ~frozen, trace, previous))
        return refresh


def _positive_or_one(value):
    return tf.where((value > 0) & tf.math.is_finite(value), value, 1.0)
