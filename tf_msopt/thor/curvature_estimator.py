"""THOR's curvature estimator: the layers' curvature state, its averages and refreshes.

The estimator owns one :class:`LayerCurvature` per layer with Kronecker factors: the
preconditioner's state (:mod:`tf_msopt.thor.preconditioners`) and, with the options that
need them, the moving averages of its statistics and the trace rule's state. Each step the
optimizer hands it the statistics its layers captured (per replica), the damping and the
scale of ``G``; the estimator sums them over replicas (one all-reduce per bucket), updates
the averages, applies the trace rule and has the preconditioner refresh its state on the
steps the optimizer's schedule says. It reads nothing back from the optimizer.
"""
import dataclasses

import tensorflow as tf

from tf_msopt.thor.curvature_base import CurvatureBlock
from tf_msopt.thor.execution import TracedOnce, buckets, on_each_device, sum_over_replicas, when

__all__ = ["CurvatureEstimator", "LayerCurvature"]


@dataclasses.dataclass
class LayerCurvature:
    """The curvature state of one layer with Kronecker factors (optimizer variables; None
    where the options keep none).

    Attributes:
        block: the layer's curvature block.
        a_inverse, g_inverse: the inverses of its damped factors (``preconditioner="inverse"``).
        a_eigenvectors, g_eigenvectors, rotated_second_moment: the eigenvectors of its
            factors and Adam's second moment of the gradient rotated into them, flat
            (``preconditioner="eigenbasis"``).
        a_average, g_average, count: with ``statistics_decay``, the moving averages of
            ``A`` and ``G`` and how many updates they have had.
        trace, trace_decisions: with the trace rule, the trace of the last refresh and the
            counts of ``(refreshed, reused, frozen)`` refreshes.
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
        return self.g_inverse if self.g_inverse is not None else self.rotated_second_moment


def _positive_or_one(value):
    return tf.where((value > 0) & tf.math.is_finite(value), value, 1.0)


def _relative_damping(a_mean, g_mean, root_damping):
    return root_damping * _positive_or_one(a_mean), root_damping * _positive_or_one(g_mean)


def _pi_damping(a_mean, g_mean, root_damping):
    pi = _positive_or_one(tf.sqrt(tf.math.divide_no_nan(a_mean, g_mean)))
    return root_damping * pi, root_damping / pi


class CurvatureEstimator:
    """Curvature state and its updates for the factored layers among ``blocks``.

    Args:
        blocks: the curvature blocks of the treated layers (those without factors are
            skipped).
        options: the optimizer's :class:`~tf_msopt.thor.options.ThorOptions`.
        preconditioner: the optimizer's preconditioner (:mod:`tf_msopt.thor.preconditioners`),
            whose state the estimator keeps per layer and refreshes.
        is_refresh_step: returns whether this step refreshes the preconditioner (a bool
            tensor, or the Python ``True``); called while a step is traced.
        assign, assign_add: ``(variable, value)``, the optimizer's (through which Keras
            keeps sparse updates sparse).
    """

    def __init__(self, blocks, options, preconditioner, is_refresh_step, assign, assign_add):
        self.blocks = tuple(block for block in blocks if block.has_factors)
        self.options = options
        self.preconditioner = preconditioner
        self.trace_thresholds = options.experimental.trace_thresholds
        # How sqrt(lambda) is split between the factors by their mean eigenvalues; None for
        # sqrt(lambda) on both (damping_mode="sqrt"), which needs no eigenvalues.
        self._factor_damping = (_pi_damping if options.experimental.pi_damping else
                                _relative_damping if options.damping_mode == "relative" else None)
        self.is_refresh_step = is_refresh_step
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
        for block in self.blocks:
            layer, name = LayerCurvature(block), block.layer
            self.preconditioner.build(layer, add_variable)
            if self.options.statistics_decay is not None:
                a_shape, g_shape = self.preconditioner.statistics_shapes(block)
                layer.a_average = add_variable(a_shape, "zeros", f"{name}_a_average")
                layer.g_average = add_variable(g_shape, "zeros", f"{name}_g_average")
                layer.count = add_variable((), "zeros", f"{name}_statistics_count")
            if self.trace_thresholds is not None:
                layer.trace = add_variable((), "zeros", f"{name}_trace")
                # (refreshed, reused, frozen) refreshes
                layer.trace_decisions = add_variable((3,), "zeros", f"{name}_trace_decisions",
                                                     "int64")
            self.layers.append(layer)

    def build_counters(self, add_variable):
        """Creates the counts of blocks whose inversion was retried and that kept their
        previous state (after the optimizer's own variables, as checkpoints hold them)."""
        self.damping_retries = add_variable((), "zeros", "damping_retries", "int64")
        self.failed_inverses = add_variable((), "zeros", "failed_inverses", "int64")

    def trace_decisions(self):
        """``{layer name: (refreshed, reused, frozen)}`` with the trace rule."""
        return {layer.block.layer: tuple(int(n) for n in layer.trace_decisions.numpy())
                for layer in self.layers if layer.trace_decisions is not None}

    def step(self, layer, gradient, step):
        """The preconditioner's step on the kernel ``gradient`` of ``layer`` at ``step``."""
        return self.preconditioner.step(layer, gradient, step, self._assign)

    # --- the update

    def update(self, distribution, statistics, root_damping, g_scale, is_statistics_step):
        """Sums this replica's ``statistics`` (``(a, g, rows)`` per layer) over replicas and
        updates the averages and the preconditioner, where ``is_statistics_step`` holds
        (cross-replica context). ``root_damping`` is ``sqrt(lambda)``, ``g_scale`` what ``G``
        is multiplied by."""
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
                               (bucket, summed, root_damping, g_scale))
            return tf.constant(True)

        when(is_statistics_step, refresh)

    def _refresh_bucket(self, device_variable, bucket, statistics, root_damping, g_scale):
        """One bucket's layers on one device, from statistics summed over replicas: the
        moving averages (with ``statistics_decay``), then the refresh on refresh steps.
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
        if decay is None:   # statistics steps are refresh steps
            return self._refresh(fresh, root_damping)
        # The bias-corrected averages are read only where they are refreshed from.
        return when(self.is_refresh_step(), lambda: self._refresh(
            [self._corrected_averages(self.layers[index]) for index in bucket], root_damping))

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

    def _layer_damping(self, block, a, g, root_damping):
        """``(d_A, d_G)``: ``sqrt(lambda)`` on both (``damping_mode="sqrt"``), in units of each
        factor's mean eigenvalue (``"relative"``) or split by them (``pi_damping``)."""
        if self._factor_damping is None:
            return root_damping, root_damping
        a_mean, g_mean = block.mean_eigenvalues(a, g, self.options.block_size)
        return self._factor_damping(a_mean, g_mean, root_damping)

    def _refresh(self, fresh, root_damping):
        """Refreshes the preconditioner of ``fresh`` (``(layer, a, g, observed)``), where
        ``observed`` and the trace rule (if any) say so."""
        fresh = [(layer, a, g, observed,
                  self._layer_damping(layer.block, a, g, root_damping)
                  if self.options.damps_factors else None)
                 for layer, a, g, observed in fresh]
        if self.trace_thresholds is None:
            self._refresh_layers(fresh)
            return tf.constant(True)
        for layer, a, g, observed, damping in fresh:
            refresh = self._trace_rule(layer, layer.block.damped_trace(
                a, g, damping, self.options.block_size), observed)
            # The rule exists to save the refresh: skip it, not only its result.
            tf.cond(refresh, lambda args=(layer, a, g, refresh, damping): self._refresh_layers(
                [args]), lambda: tf.constant(False))
        return tf.constant(True)

    def _refresh_layers(self, refreshes):
        """The preconditioner's refresh of ``refreshes`` (``(layer, a, g, use, damping)``), its
        failures counted."""
        retried, kept = self.preconditioner.refresh(refreshes, self._assign)
        if retried is not None:
            self._assign_add(self.damping_retries, retried)
        self._assign_add(self.failed_inverses, kept)
        return tf.constant(True)

    def _trace_rule(self, layer, trace, observed):
        """THOR's per-layer rule; returns whether to refresh, counts the decision."""
        omega1, omega2 = self.trace_thresholds
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
