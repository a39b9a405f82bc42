"""THOR's refresh: when the preconditioner's state is recomputed, and with what damping.

One job: the refresh of the layers' preconditioner state, on one device: on which steps
(:meth:`Refresh.due`), with what damping per factor (:class:`FactorDamping`, from
``sqrt(lambda)`` and ``damping_mode`` or ``pi_damping``), which layers the trace rule lets
refresh (its state and decisions per layer), the counts of the blocks whose inversion
was retried or kept its previous state, and how many factors the last refresh computed
anew. Each layer's refresh is one :class:`LayerRefresh`.
"""
import dataclasses

import keras
import tensorflow as tf

from tf_msopt.thor.block_diagonal import count_true
from tf_msopt.thor.curvature_base import FactorDamping
from tf_msopt.thor.execution import when

__all__ = ["LayerRefresh", "NOT_REFRESHED", "Refresh"]

#: ``bases_recomputed`` before the first refresh since THOR was built (or loaded: the count
#: is no part of its saved state).
NOT_REFRESHED = -1


@dataclasses.dataclass(frozen=True)
class LayerRefresh:
    """What a preconditioner's ``refresh`` recomputes one layer's state from.

    Attributes:
        layer: the layer's :class:`~tf_msopt.thor.curvature_estimator.LayerCurvature`.
        a, g: its mean statistics (the factors ``A`` and ``G``).
        use: where the new state is assigned (a bool tensor): the layer was observed and,
            with the trace rule, the rule says refresh.
        damping: its :class:`~tf_msopt.thor.curvature_base.FactorDamping`; None where the
            preconditioner does not damp the factors.
    """

    layer: object
    a: object
    g: object
    use: object
    damping: FactorDamping = None


def _positive_or_one(value):
    return tf.where((value > 0) & tf.math.is_finite(value), value, 1.0)


def _relative_damping(a_mean, g_mean, root_damping):
    return FactorDamping(root_damping * _positive_or_one(a_mean),
                         root_damping * _positive_or_one(g_mean))


def _pi_damping(a_mean, g_mean, root_damping):
    pi = _positive_or_one(tf.sqrt(tf.math.divide_no_nan(a_mean, g_mean)))
    return FactorDamping(root_damping * pi, root_damping / pi)


class Refresh:
    """The refresh of ``layers``' preconditioner state, its damping and the trace rule.

    Args:
        layers: the estimator's :class:`~tf_msopt.thor.curvature_estimator.LayerCurvature`
            list (filled as the state is built).
        options: the optimizer's :class:`~tf_msopt.thor.options.ThorOptions`.
        preconditioner: the optimizer's preconditioner, whose state is refreshed.
        averages: the :class:`~tf_msopt.thor.curvature_averages.CurvatureAverages` the
            refresh reads its statistics from.
        is_refresh_step: returns whether this step refreshes (a bool tensor, or ``True``).
        assign, assign_add: ``(variable, value)``, the optimizer's (``assign_add`` casts).
    """

    def __init__(self, layers, options, preconditioner, averages, is_refresh_step, assign,
                 assign_add):
        self.layers, self.options = layers, options
        self.preconditioner, self.averages = preconditioner, averages
        self.is_refresh_step = is_refresh_step
        self.trace_thresholds = options.experimental.trace_thresholds
        # How sqrt(lambda) is split between the factors by their mean eigenvalues; None for
        # sqrt(lambda) on both (damping_mode="sqrt"), which needs no eigenvalues.
        self._factor_damping = (_pi_damping if options.experimental.pi_damping else
                                _relative_damping if options.damping_mode == "relative" else None)
        self._assign, self._assign_add = assign, assign_add
        self.damping_retries = self.failed_inverses = self.bases_recomputed = None
        #: How many factors a refresh considers (each layer's ``refreshed_state``).
        self.factor_count = 0
        #: Whether the refreshes traced from now on count the factors they compute anew: off
        #: until THOR is asked (``count_refreshed_bases``), so a step without a monitor
        #: traces no op for it.
        self.counts_bases = False

    # --- state

    def build_trace_rule(self, layer, add_variable):
        """Creates ``layer``'s trace and decision counts (with the trace rule)."""
        if self.trace_thresholds is None:
            return
        name = layer.block.name
        layer.trace = add_variable((), "zeros", f"{name}_trace")
        # (refreshed, reused, frozen) refreshes
        layer.trace_decisions = add_variable((3,), "zeros", f"{name}_trace_decisions", "int64")

    def build_counters(self, add_variable):
        """Creates the counts of blocks whose inversion was retried and that kept their
        previous state (optimizer state, with ``add_variable``), and of the factors the last
        refresh computed anew (a variable of the strategy's, which no checkpoint holds: the
        optimizer does not track it)."""
        self.damping_retries = add_variable((), "zeros", "damping_retries", "int64")
        self.failed_inverses = add_variable((), "zeros", "failed_inverses", "int64")
        self.bases_recomputed = keras.Variable(NOT_REFRESHED, dtype="int64", trainable=False,
                                               name="bases_recomputed")
        self.factor_count = sum(len(self.preconditioner.refreshed_state(layer))
                                for layer in self.layers)

    def refreshed_bases(self):
        """``(recomputed, kept)``: how many factors the last refresh computed anew and how
        many it left as they were (int64 tensors); ``(0, 0)`` before the first refresh that
        counted them (:attr:`counts_bases`) since THOR was built or loaded."""
        recomputed = tf.convert_to_tensor(self.bases_recomputed)
        refreshed = recomputed != NOT_REFRESHED
        return (tf.where(refreshed, recomputed, 0),
                tf.where(refreshed, self.factor_count - recomputed, 0))

    def trace_decisions(self):
        """``{block name: (refreshed, reused, frozen)}`` with the trace rule."""
        return {layer.block.name: tuple(int(n) for n in layer.trace_decisions.numpy())
                for layer in self.layers if layer.trace_decisions is not None}

    # --- the schedule

    def due(self):
        """Whether a statistics step refreshes: always without moving averages (each
        refresh reads its own step's statistics), else on the optimizer's refresh steps."""
        return True if self.options.statistics_decay is None else self.is_refresh_step()

    def refresh_bucket(self, device_variable, bucket, statistics, root_damping, g_scale):
        """The layers at indices ``bucket`` on one device (the one of ``device_variable``),
        from their ``statistics`` summed over replicas: the moving averages (with
        ``statistics_decay``), then the refresh where it is due."""
        if self.options.statistics_decay is not None:
            self.averages.update_bucket(device_variable, bucket, statistics, g_scale)
        # The bias-corrected averages are read only where they are refreshed from.
        return when(self.due(), lambda: self.refresh(
            self.averages.refreshes(bucket, statistics, g_scale), root_damping,
            first=bucket[0] == 0))

    # --- the refresh

    def with_damping(self, refreshes, root_damping):
        """``refreshes`` with their damping, from ``root_damping`` (``sqrt(lambda)``); none
        where the preconditioner does not damp the factors."""
        if not self.options.damps_factors:
            return list(refreshes)
        return [dataclasses.replace(entry, damping=self._layer_damping(
            entry.layer.block, entry.a, entry.g, root_damping)) for entry in refreshes]

    def refresh(self, refreshes, root_damping, first=True):
        """Refreshes the preconditioner of ``refreshes`` (undamped), where they are used
        and the trace rule (if any) says so; ``first``: the refresh's first bucket, whose
        count of factors computed anew replaces the previous refresh's."""
        refreshes = self.with_damping(refreshes, root_damping)
        if self.trace_thresholds is None:
            self._refresh_layers(refreshes, first)
            return tf.constant(True)
        if first and self.counts_bases:    # each layer the rule refreshes adds to the count
            self._assign(self.bases_recomputed, tf.zeros([], tf.int64))
        for entry in refreshes:
            refresh = self._trace_rule(entry.layer, entry.layer.block.damped_trace(
                entry.a, entry.g, entry.damping, self.options.block_size), entry.use)
            # The rule exists to save the refresh: skip it, not only its result.
            tf.cond(refresh, lambda decided=dataclasses.replace(entry, use=refresh):
                    self._refresh_layers([decided]), lambda: tf.constant(False))
        return tf.constant(True)

    def _refresh_layers(self, refreshes, first=False):
        """The preconditioner's refresh of ``refreshes``, counted."""
        retried, kept, recomputed = self.preconditioner.refresh(refreshes, self._assign)
        return self.count(None, retried, kept,
                          count_true(recomputed) if self.counts_bases else None, first)

    def count(self, device_variable, retried, kept, recomputed=None, first=False):
        """Adds the blocks a refresh retried (None: the preconditioner retries none) and
        kept to the counts, and the factors it ``recomputed`` (None: the bases are not
        counted) to this refresh's (``first``: as its first bucket, in place of the previous
        refresh's), on the device of ``device_variable``, if any."""
        if retried is not None:
            self._assign_add(self.damping_retries, retried)
        self._assign_add(self.failed_inverses, kept)
        if recomputed is not None:
            (self._assign if first else self._assign_add)(
                self.bases_recomputed, tf.cast(recomputed, tf.int64))
        return tf.constant(True)

    def _layer_damping(self, block, a, g, root_damping):
        """``sqrt(lambda)`` on both factors (``damping_mode="sqrt"``), in units of each
        factor's mean eigenvalue (``"relative"``) or split by them (``pi_damping``)."""
        if self._factor_damping is None:
            return FactorDamping(root_damping, root_damping)
        a_mean, g_mean = block.mean_eigenvalues(a, g, self.options.block_size)
        return self._factor_damping(a_mean, g_mean, root_damping)

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
