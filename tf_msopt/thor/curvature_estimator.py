"""THOR's curvature estimator: the owner of the layers' curvature state and its updates.

The estimator owns one :class:`LayerCurvature` per layer with Kronecker factors: the
preconditioner's state (:mod:`tf_msopt.thor.preconditioners`) and, with the options that
need them, the moving averages of its statistics and the trace rule's state. Each step the
optimizer hands it the statistics its layers captured (per replica), the damping and the
scale of ``G``; the estimator sums them over replicas (one all-reduce per bucket) and hands
each bucket to the parts that do the work, each a module of one job:

- :mod:`tf_msopt.thor.curvature_averages`: the moving averages and the pending sums of
  gradient accumulation (:class:`~tf_msopt.thor.curvature_averages.CurvatureAverages`);
- :mod:`tf_msopt.thor.refresh`: the refresh schedule, the factors' damping and the trace
  rule's decisions (:class:`~tf_msopt.thor.refresh.Refresh`);
- :mod:`tf_msopt.thor.replica_division`: the refresh divided among replicas, each layer's
  on its owner (:class:`~tf_msopt.thor.replica_division.ReplicaDivision`).

It reads nothing back from the optimizer.
"""
import dataclasses
import warnings

import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.curvature_averages import CurvatureAverages
from tf_msopt.thor.curvature_base import CurvatureBlock
from tf_msopt.thor.execution import (TracedOnce, buckets, on_each_device, sum_over_replicas,
                                     when)
from tf_msopt.thor.refresh import Refresh
from tf_msopt.thor.replica_division import ReplicaDivision

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

    def variables(self):
        """Every variable of this state."""
        values = [getattr(self, field.name) for field in dataclasses.fields(self)
                  if field.name != "block"]
        return [variable for value in values if value is not None
                for variable in (value if isinstance(value, tuple) else (value,))]


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

    Attributes:
        layers: the :class:`LayerCurvature` of each factored layer, in block order.
        averages, refresh, division: the parts that update it (see the module).
    """

    def __init__(self, blocks, options, preconditioner, is_refresh_step, assign, assign_add):
        self.blocks = tuple(block for block in blocks if block.has_factors)
        self.options = options
        self.preconditioner = preconditioner
        self._assign = assign

        def cast_assign_add(variable, value):
            return assign_add(variable, tf.cast(value, variable.dtype))

        self.layers = []
        self.averages = CurvatureAverages(self.layers, options.statistics_decay, assign,
                                          cast_assign_add)
        self.refresh = Refresh(self.layers, options, preconditioner, self.averages,
                               is_refresh_step, assign, cast_assign_add)
        self.division = ReplicaDivision(self.blocks, self.layers, preconditioner, self.averages,
                                        self.refresh, assign, options.replica_division)
        self.traced_refresh = TracedOnce(self.refresh.refresh_bucket)

    @property
    def anchor(self):
        """A variable on every replica's device (the count of blocks that kept their state,
        once built): says on which devices a per-device function runs."""
        return self.refresh.failed_inverses

    @property
    def damping_retries(self):
        """The count of blocks whose inversion was retried (None until built)."""
        return self.refresh.damping_retries

    @property
    def failed_inverses(self):
        """The count of blocks that kept their previous state (None until built)."""
        return self.refresh.failed_inverses

    # --- state

    def build_layers(self, add_variable, distribution, accumulates=False):
        """Creates each layer's state with ``add_variable(shape, initializer, name, dtype)``
        (the optimizer's), in the order checkpoints hold it: on every replica's device, or
        on its owner's alone where ``distribution`` divides the state
        (:meth:`ReplicaDivision.divide_state
        <tf_msopt.thor.replica_division.ReplicaDivision.divide_state>`); ``accumulates``:
        the optimizer accumulates gradients over several steps, and the statistics with
        them."""
        self.division.divide_state(distribution)
        for block in self.blocks:
            layer = LayerCurvature(block)
            a_shape, g_shape = self.preconditioner.statistics_shapes(block)
            with self.division.placement(block):
                self.preconditioner.build(layer, add_variable)
                self.averages.build_averages(layer, a_shape, g_shape, add_variable)
            self.refresh.build_trace_rule(layer, add_variable)
            if accumulates:
                self.averages.build_pending(layer, a_shape, g_shape, add_variable)
            self.layers.append(layer)

    def build_counters(self, add_variable):
        """Creates the counts of blocks whose inversion was retried and that kept their
        previous state (with ``add_variable``, after the optimizer's own variables, as
        checkpoints hold them), and of the factors the last refresh computed anew (not
        saved)."""
        self.refresh.build_counters(add_variable)

    def savedmodel_only_children(self):
        """The count of factors computed anew, which a step traced while counting updates
        and no checkpoint holds."""
        return {"bases_recomputed": self.refresh.bases_recomputed}

    def count_refreshed_bases(self):
        """Has the refreshes traced from now on count the factors they compute anew."""
        self.refresh.counts_bases = True
        # The refreshes traced so far count nothing: the next step must not reuse them.
        self.traced_refresh.forget_traces()
        self.division.traced_part.forget_traces()

    def refreshed_bases(self):
        """``(recomputed, kept)`` factors at the last refresh
        (:meth:`Refresh.refreshed_bases <tf_msopt.thor.refresh.Refresh.refreshed_bases>`)."""
        return self.refresh.refreshed_bases()

    def trace_decisions(self):
        """``{block name: (refreshed, reused, frozen)}`` with the trace rule."""
        return self.refresh.trace_decisions()

    def step(self, layer, gradient, correction):
        """The preconditioner's step on the kernel ``gradient`` of ``layer`` (``correction``:
        Adam's bias correction at this step, for a preconditioner with second moments)."""
        return self.preconditioner.step(layer, gradient, correction, self._assign)

    def refresh_owners(self, replicas):
        """``{block name: replica}``: which of ``replicas`` refreshes each block's state
        when the refresh is divided (:meth:`ReplicaDivision.refresh_owners
        <tf_msopt.thor.replica_division.ReplicaDivision.refresh_owners>`)."""
        return self.division.refresh_owners(replicas)

    def state_held(self, distribution):
        """The report's ``state_bytes`` (:meth:`state_bytes` under ``distribution``) and
        ``state_divided``."""
        return {"state_bytes": self.state_bytes(distribution.num_replicas_in_sync),
                "state_divided": self.division.state_devices is not None}

    def state_bytes(self, replicas):
        """The bytes of curvature state each of ``replicas`` holds: all of it, or where the
        state is divided its own layers'."""
        held = [0] * replicas
        owners = self.refresh_owners(replicas) if self.division.state_devices else None
        for layer in self.layers:
            size = sum(variable.shape.num_elements() * tf.as_dtype(variable.dtype).size
                       for variable in layer.variables())
            for replica in [owners[layer.block.name]] if owners else range(replicas):
                held[replica] += size
        return held

    # --- the update

    def accumulate(self, statistics):
        """Adds this replica's ``statistics`` (``(a, g, rows)`` per layer) to the sums of
        the accumulation cycle (a step that accumulates its gradients, and does not
        update)."""
        return self.averages.accumulate(statistics)

    def with_pending(self, statistics):
        """``statistics`` plus the sums of the earlier steps of the accumulation cycle,
        which start again from zero."""
        return self.averages.with_pending(statistics)

    def update(self, distribution, statistics, root_damping, g_scale, is_statistics_step):
        """Sums this replica's ``statistics`` (``(a, g, rows)`` per layer) over replicas and
        updates the averages and the preconditioner, where ``is_statistics_step`` holds
        (cross-replica context). ``root_damping`` is ``sqrt(lambda)``, ``g_scale`` what ``G``
        is multiplied by."""
        if not statistics:
            return
        if compat.in_xla_context() and not tf.config.list_logical_devices("GPU"):
            warnings.warn(XLA_REFRESH_WARNING, stacklevel=2)
        divided = self.division.divides(distribution)

        def update_buckets():
            for bucket in buckets(len(statistics), self.options.split_indices):
                first = self.anchor
                reduced = sum_over_replicas(
                    distribution, [value for index in bucket for value in statistics[index]],
                    first)
                summed = [reduced[3 * offset:3 * offset + 3] for offset in range(len(bucket))]
                if divided:
                    self.division.update(distribution, first, bucket, summed, root_damping,
                                         g_scale)
                else:
                    on_each_device(distribution, first, self.traced_refresh,
                                   (bucket, summed, root_damping, g_scale))
            return tf.constant(True)

        when(is_statistics_step, update_buckets)
