"""THOR's curvature statistics between capture and refresh: their averages and pending sums.

One job: turning the statistics summed over replicas into what a refresh reads, one
:class:`~tf_msopt.thor.refresh.LayerRefresh` per layer: the sums divided by their rows or,
with ``statistics_decay``, the bias-corrected moving averages that this module updates;
and, with gradient accumulation, keeping the sums of the earlier steps of a cycle.
"""
import tensorflow as tf

from tf_msopt.thor.refresh import LayerRefresh

__all__ = ["CurvatureAverages"]


class CurvatureAverages:
    """The moving averages and pending sums of the statistics of ``layers``.

    Args:
        layers: the estimator's :class:`~tf_msopt.thor.curvature_estimator.LayerCurvature`
            list (filled as the state is built).
        statistics_decay: the averages' decay; None: no averages, every refresh reads the
            statistics of its own step.
        assign, assign_add: ``(variable, value)``, the optimizer's (``assign_add`` casts
            ``value`` to the variable's dtype).
    """

    def __init__(self, layers, statistics_decay, assign, assign_add):
        self.layers = layers
        self.statistics_decay = statistics_decay
        self._assign, self._assign_add = assign, assign_add

    # --- state

    def build_averages(self, layer, a_shape, g_shape, add_variable):
        """Creates ``layer``'s averages of ``A`` and ``G`` and their count (with a decay)."""
        if self.statistics_decay is None:
            return
        name = layer.block.name
        layer.a_average = add_variable(a_shape, "zeros", f"{name}_a_average")
        layer.g_average = add_variable(g_shape, "zeros", f"{name}_g_average")
        layer.count = add_variable((), "zeros", f"{name}_statistics_count")

    def build_pending(self, layer, a_shape, g_shape, add_variable):
        """Creates ``layer``'s ``(A, G, rows)`` sums of an accumulation cycle."""
        layer.pending = tuple(add_variable(shape, "zeros", f"{layer.block.name}_pending_{part}")
                              for shape, part in ((a_shape, "a"), (g_shape, "g"), ((), "rows")))

    # --- gradient accumulation

    def accumulate(self, statistics):
        """Adds this replica's ``statistics`` (``(a, g, rows)`` per layer) to the pending
        sums."""
        for layer, values in zip(self.layers, statistics):
            for variable, value in zip(layer.pending, values):
                self._assign_add(variable, value)
        return tf.constant(True)

    def with_pending(self, statistics):
        """``statistics`` plus the pending sums, which start again from zero."""
        total = [tuple(value + tf.convert_to_tensor(variable)
                       for value, variable in zip(values, layer.pending))
                 for layer, values in zip(self.layers, statistics)]
        with tf.control_dependencies(tf.nest.flatten(total)):
            for layer in self.layers:
                for variable in layer.pending:
                    self._assign(variable, tf.zeros(variable.shape, variable.dtype))
        return total

    # --- the averages

    def update_bucket(self, device_variable, bucket, statistics, g_scale):
        """Updates the averages of the layers at indices ``bucket`` from their summed
        ``statistics`` (``(a, g, rows)`` each) on one device: the one of
        ``device_variable``."""
        for index, (a, g, rows) in zip(bucket, statistics):
            self._update(self.layers[index], a, g, rows, g_scale)
        return tf.constant(True)

    def _update(self, layer, a, g, rows, g_scale):
        """Updates one layer's moving averages of A and G from their sums over ``rows``
        (``G`` scaled by ``g_scale``), and its count of updates."""
        beta = self.statistics_decay
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

    # --- what a refresh reads

    def refreshes(self, indices, statistics, g_scale):
        """A :class:`~tf_msopt.thor.refresh.LayerRefresh` (undamped) for each layer at
        ``indices``: from its bias-corrected averages, or without a decay from its summed
        ``statistics`` (``(a, g, rows)`` each, in the order of ``indices``) divided by their
        rows, ``G`` scaled by ``g_scale``; used where anything was observed."""
        if self.statistics_decay is not None:
            return [self._corrected(self.layers[index]) for index in indices]
        fresh = []
        for index, (a, g, rows) in zip(indices, statistics):
            observed = rows > 0
            rows = tf.maximum(rows, 1.0)
            fresh.append(LayerRefresh(self.layers[index], a / rows, g / rows * g_scale,
                                      observed))
        return fresh

    def _corrected(self, layer):
        """``layer``'s refresh from its bias-corrected averages; observed once anything is
        averaged."""
        count = tf.convert_to_tensor(layer.count)
        correction = 1.0 - tf.pow(tf.constant(self.statistics_decay), tf.maximum(count, 1.0))
        return LayerRefresh(layer, tf.convert_to_tensor(layer.a_average) / correction,
                            tf.convert_to_tensor(layer.g_average) / correction, count > 0)
