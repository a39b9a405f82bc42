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
import math
import os
import warnings

import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.curvature_base import CurvatureBlock
from tf_msopt.thor.execution import (TracedOnce, balanced_owners, buckets, device_of,
                                     gather_device_values, on_each_device, replica_ids,
                                     sum_device_values, sum_over_replicas, when)

__all__ = ["CurvatureEstimator", "LayerCurvature"]

XLA_REFRESH_WARNING = (
    "THOR's refresh is being compiled with XLA (jit_compile=True). On a CPU, XLA factorises "
    "with its own kernels, far slower than TensorFlow's: its eigendecompositions (the "
    "default's refresh) took 57-174x as long on 128- and 512-wide factors, its inverses "
    "(MindSpore's form) 12-51x. Compile the train step without XLA "
    "(model.compile(..., jit_compile=False)); tf_msopt.thor(model, jit_compile=True) "
    "compiles only THOR's updates with XLA.")


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
        pending: with gradient accumulation, the ``(A, G, rows)`` sums captured by the
            earlier steps of the accumulation cycle.
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
    pending: object = None

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
        self.traced_averages = TracedOnce(self._update_bucket_averages)
        self.traced_part = TracedOnce(self._refresh_part)

    # --- state

    def build_layers(self, add_variable, accumulates=False):
        """Creates each layer's state with ``add_variable(shape, initializer, name, dtype)``
        (the optimizer's), in the order checkpoints hold it; ``accumulates``: the optimizer
        accumulates gradients over several steps, and the statistics with them."""
        for block in self.blocks:
            layer, name = LayerCurvature(block), block.name
            self.preconditioner.build(layer, add_variable)
            a_shape, g_shape = self.preconditioner.statistics_shapes(block)
            if self.options.statistics_decay is not None:
                layer.a_average = add_variable(a_shape, "zeros", f"{name}_a_average")
                layer.g_average = add_variable(g_shape, "zeros", f"{name}_g_average")
                layer.count = add_variable((), "zeros", f"{name}_statistics_count")
            if self.trace_thresholds is not None:
                layer.trace = add_variable((), "zeros", f"{name}_trace")
                # (refreshed, reused, frozen) refreshes
                layer.trace_decisions = add_variable((3,), "zeros", f"{name}_trace_decisions",
                                                     "int64")
            if accumulates:
                layer.pending = tuple(add_variable(shape, "zeros", f"{name}_pending_{part}")
                                      for shape, part in ((a_shape, "a"), (g_shape, "g"),
                                                          ((), "rows")))
            self.layers.append(layer)

    def build_counters(self, add_variable):
        """Creates the counts of blocks whose inversion was retried and that kept their
        previous state (after the optimizer's own variables, as checkpoints hold them)."""
        self.damping_retries = add_variable((), "zeros", "damping_retries", "int64")
        self.failed_inverses = add_variable((), "zeros", "failed_inverses", "int64")

    def trace_decisions(self):
        """``{block name: (refreshed, reused, frozen)}`` with the trace rule."""
        return {layer.block.name: tuple(int(n) for n in layer.trace_decisions.numpy())
                for layer in self.layers if layer.trace_decisions is not None}

    def step(self, layer, gradient, correction):
        """The preconditioner's step on the kernel ``gradient`` of ``layer`` (``correction``:
        Adam's bias correction at this step, for a preconditioner with second moments)."""
        return self.preconditioner.step(layer, gradient, correction, self._assign)

    # --- the update

    def accumulate(self, statistics):
        """Adds this replica's ``statistics`` (``(a, g, rows)`` per layer) to the sums of
        the accumulation cycle (a step that accumulates its gradients, and does not
        update)."""
        for layer, values in zip(self.layers, statistics):
            for variable, value in zip(layer.pending, values):
                self._assign_add(variable, value)
        return tf.constant(True)

    def with_pending(self, statistics):
        """``statistics`` plus the sums of the earlier steps of the accumulation cycle,
        which start again from zero."""
        total = [tuple(value + tf.convert_to_tensor(variable)
                       for value, variable in zip(values, layer.pending))
                 for layer, values in zip(self.layers, statistics)]
        with tf.control_dependencies(tf.nest.flatten(total)):
            for layer in self.layers:
                for variable in layer.pending:
                    self._assign(variable, tf.zeros(variable.shape, variable.dtype))
        return total

    def update(self, distribution, statistics, root_damping, g_scale, is_statistics_step):
        """Sums this replica's ``statistics`` (``(a, g, rows)`` per layer) over replicas and
        updates the averages and the preconditioner, where ``is_statistics_step`` holds
        (cross-replica context). ``root_damping`` is ``sqrt(lambda)``, ``g_scale`` what ``G``
        is multiplied by."""
        if not statistics:
            return
        if compat.in_xla_context() and not tf.config.list_logical_devices("GPU"):
            warnings.warn(XLA_REFRESH_WARNING, stacklevel=2)
        divided = self._divides(distribution)

        def refresh():
            for bucket in buckets(len(statistics), self.options.split_indices):
                first = self.layers[bucket[0]].device_variable
                reduced = sum_over_replicas(
                    distribution, [value for index in bucket for value in statistics[index]],
                    first)
                summed = [reduced[3 * offset:3 * offset + 3] for offset in range(len(bucket))]
                if divided:
                    self._divided_update(distribution, first, bucket, summed, root_damping,
                                         g_scale)
                else:
                    on_each_device(distribution, first, self.traced_refresh,
                                   (bucket, summed, root_damping, g_scale))
            return tf.constant(True)

        when(is_statistics_step, refresh)

    def _normalized(self, bucket, statistics, g_scale):
        """``(layer, A, G, observed)`` of each layer of ``bucket`` from its summed
        statistics: divided by their rows, ``G`` scaled by ``g_scale``."""
        fresh = []
        for index, (a, g, rows) in zip(bucket, statistics):
            observed = rows > 0
            rows = tf.maximum(rows, 1.0)
            fresh.append((self.layers[index], a / rows, g / rows * g_scale, observed))
        return fresh

    def _refresh_bucket(self, device_variable, bucket, statistics, root_damping, g_scale):
        """One bucket's layers on one device, from statistics summed over replicas: the
        moving averages (with ``statistics_decay``), then the refresh on refresh steps.
        ``device_variable`` (a variable of the bucket's first layer there) only says which
        device."""
        if self.options.statistics_decay is None:   # statistics steps are refresh steps
            return self._refresh(self._normalized(bucket, statistics, g_scale), root_damping)
        self._update_bucket_averages(device_variable, bucket, statistics, g_scale)
        # The bias-corrected averages are read only where they are refreshed from.
        return when(self.is_refresh_step(), lambda: self._refresh(
            [self._corrected_averages(self.layers[index]) for index in bucket], root_damping))

    def _update_bucket_averages(self, device_variable, bucket, statistics, g_scale):
        """The moving averages of one bucket's layers on one device."""
        for index, (a, g, rows) in zip(bucket, statistics):
            self._update_averages(self.layers[index], a, g, rows, g_scale)
        return tf.constant(True)

    # --- the refresh divided among replicas

    def _divides(self, distribution):
        """Whether the refresh is divided among the replicas: under a strategy of several,
        without the trace rule (whose decisions each replica keeps for every layer), and
        unless ``TF_MSOPT_THOR_UNDIVIDED_REFRESH=1`` (for comparisons)."""
        return (tf.distribute.in_cross_replica_context()
                and distribution.num_replicas_in_sync > 1 and self.trace_thresholds is None
                and os.environ.get("TF_MSOPT_THOR_UNDIVIDED_REFRESH", "0") in ("", "0"))

    def refresh_owners(self, replicas):
        """``{block name: replica}``: which of ``replicas`` refreshes each block's state
        when the refresh is divided, balanced by the cost of its factorisations (``count *
        size^3`` a factor of ``count`` blocks). A function of the model and the number of
        replicas alone: a restarted worker takes the same layers."""
        def cost(shape):
            return math.prod(shape[:-2]) * shape[-1] ** 3 if len(shape) >= 2 else shape[0]

        costs = [sum(cost(tuple(variable.shape)) for variable in
                     self.preconditioner.refreshed_state(layer)) for layer in self.layers]
        return {layer.block.name: owner for layer, owner in zip(
            self.layers, balanced_owners(costs, replicas))}

    def _divided_update(self, distribution, first, bucket, summed, root_damping, g_scale):
        """One bucket's layers with the refresh divided: the averages on every device, each
        layer's refresh on the replica that owns it, one all-reduce of whether the
        replicas' refreshes computed anything and of their counts, and, where any did, one
        all-gather that hands every replica all of the refreshed state."""
        if self.options.statistics_decay is not None:
            on_each_device(distribution, first, self.traced_averages,
                           (bucket, summed, g_scale))
        ids, replicas = replica_ids(distribution), distribution.num_replicas_in_sync

        def share():
            parts, summaries = {}, {}

            def part(component, *args):
                replica = ids[device_of(component)]
                parts[replica], summaries[replica] = self.traced_part(replica, *args)
                return summaries[replica]

            distribution.extended.update(first.value, part, group=False, args=(
                replicas, bucket, summed, root_damping, g_scale))
            changed, retried, kept = tf.unstack(sum_device_values(distribution, summaries))
            on_each_device(distribution, first, self._count_failures, (retried, kept))

            def hand_around():
                flat = {}
                for device, replica in ids.items():
                    with tf.device(device):   # (the empty tensor: a replica may own nothing)
                        flat[replica] = tf.concat([tf.reshape(value, [-1])
                                                   for value in parts[replica]]
                                                  + [tf.zeros([0])], 0)
                gathered = gather_device_values(distribution, flat)
                on_each_device(distribution, first, self._assign_gathered,
                               (replicas, bucket, gathered))
                return tf.constant(True)

            # A refresh that kept every basis computed nothing: nothing to hand around.
            when(changed > 0, hand_around)
            return tf.constant(True)

        when(True if self.options.statistics_decay is None else self.is_refresh_step(), share)

    def _owned(self, replica, replicas, bucket):
        """The layers of ``bucket`` that ``replica`` (of ``replicas``) refreshes."""
        owners = self.refresh_owners(replicas)
        return [index for index in bucket if owners[self.layers[index].block.name] == replica]

    def _refresh_part(self, replica, replicas, bucket, statistics, root_damping, g_scale):
        """This replica's share of one bucket's refresh: the refreshed state of the layers
        it owns, in layer order, and ``(changed, retried, kept)``: whether any of it was
        computed anew, and the counts of blocks retried and kept."""
        owned = self._owned(replica, replicas, bucket)
        if self.options.statistics_decay is None:
            fresh = self._normalized(owned, [statistics[bucket.index(index)] for index in owned],
                                     g_scale)
        else:
            fresh = [self._corrected_averages(self.layers[index]) for index in owned]
        values, retried, kept, changed = {}, 0, 0, False
        if fresh:
            retried, kept, changed = self.preconditioner.refresh(
                self._with_damping(fresh, root_damping),
                lambda variable, value: values.__setitem__(id(variable), value))
        state = [values[id(variable)] for index in owned
                 for variable in self.preconditioner.refreshed_state(self.layers[index])]
        return state, tf.stack([tf.cast(count, tf.float32) for count in (
            changed, 0 if retried is None else retried, kept)])

    def _count_failures(self, device_variable, retried, kept):
        """Adds the blocks a refresh retried (None: the preconditioner retries none) and
        kept to the counts (on the device of ``device_variable``, if any)."""
        if retried is not None:
            self._assign_add(self.damping_retries, retried)
        self._assign_add(self.failed_inverses, kept)
        return tf.constant(True)

    def _assign_gathered(self, device_variable, replicas, bucket, gathered):
        """Assigns one bucket's refreshed state from ``gathered`` (every replica's
        :meth:`_refresh_part`, in replica order) on one device."""
        offset = 0
        for replica in range(replicas):
            for index in self._owned(replica, replicas, bucket):
                for variable in self.preconditioner.refreshed_state(self.layers[index]):
                    size = variable.shape.num_elements()
                    self._assign(variable, tf.reshape(gathered[offset:offset + size],
                                                      variable.shape))
                    offset += size
        return tf.constant(True)

    def _update_averages(self, layer, a, g, rows, g_scale):
        """Updates one layer's moving averages of A and G from their sums over ``rows``
        (``G`` scaled by ``g_scale``), and its count of updates."""
        beta = self.options.statistics_decay
        # A step without rows, or whose statistics are not finite (then neither is their
        # sum), leaves the averages alone: weight 1 on the average and 0 on the statistics,
        # which multiply_no_nan keeps 0 even where they are NaN. The division by the rows
        # rides on that weight: each pass over a wide factor costs as much as its product.
        update = (rows > 0) & tf.math.is_finite(tf.reduce_sum(a) + tf.reduce_sum(g))
        keep = tf.where(update, beta, 1.0)
        weight = tf.where(update, (1.0 - beta) / tf.maximum(rows, 1.0), 0.0)
        for moving, value, scale in ((layer.a_average, a, weight),
                                     (layer.g_average, g, weight * g_scale)):
            self._assign(moving, keep * moving + tf.math.multiply_no_nan(value, scale))
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

    def _with_damping(self, fresh, root_damping):
        """``(layer, a, g, observed, damping)`` for each of ``fresh``; damping None where
        the preconditioner does not damp the factors."""
        return [(layer, a, g, observed,
                 self._layer_damping(layer.block, a, g, root_damping)
                 if self.options.damps_factors else None)
                for layer, a, g, observed in fresh]

    def _refresh(self, fresh, root_damping):
        """Refreshes the preconditioner of ``fresh`` (``(layer, a, g, observed)``), where
        ``observed`` and the trace rule (if any) say so."""
        fresh = self._with_damping(fresh, root_damping)
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
        retried, kept, _ = self.preconditioner.refresh(refreshes, self._assign)
        return self._count_failures(None, retried, kept)

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
