"""THOR's work divided among replicas: which replica owns each factored layer, where its
state lives, and the refresh each owner computes.

One job: under a strategy of several replicas, dealing the factored layers out to owner
replicas (balanced by the cost of their factorisations, the same for a restarted worker)
and running one bucket's refresh divided: each layer's on its owner, the refreshed state
handed to every replica by one all-gather. Where the replicas are this process's devices
and the whole step is divided, the state is divided too: each layer's state (its
preconditioner's, its averages) exists on its owner's device alone, which alone updates
and refreshes it, and nothing is handed around.
"""
import contextlib
import math
import os

import tensorflow as tf

from tf_msopt._common import single_copy_variables
from tf_msopt.thor.block_diagonal import count_true
from tf_msopt.thor.execution import (TracedOnce, balanced_owners, device_of,
                                     gather_device_values, on_each_device, replica_ids,
                                     sum_device_values, when)

__all__ = ["ReplicaDivision", "UNDIVIDED_REFRESH"]

#: The environment variable that, set to 1, has every replica do all of THOR's work (for
#: comparisons).
UNDIVIDED_REFRESH = "TF_MSOPT_THOR_UNDIVIDED_REFRESH"


class ReplicaDivision:
    """The division of ``layers``' refresh (and state) among replicas.

    Args:
        blocks: the curvature blocks of the factored layers, in order.
        layers: the estimator's :class:`~tf_msopt.thor.curvature_estimator.LayerCurvature`
            list (filled as the state is built).
        preconditioner: the optimizer's preconditioner, whose state is refreshed.
        averages: the :class:`~tf_msopt.thor.curvature_averages.CurvatureAverages` of the
            layers' statistics.
        refresh: the :class:`~tf_msopt.thor.refresh.Refresh` whose schedule, damping and
            counts the divided refresh follows.
        assign: ``(variable, value)``, the optimizer's.
        mode: the ``replica_division`` option: ``"step"``, ``"refresh"`` or None.

    Attributes:
        state_devices: with the state divided, ``{block name: device}``, where each layer's
            state lives (:meth:`divide_state`); None where every replica holds all of it.
    """

    def __init__(self, blocks, layers, preconditioner, averages, refresh, assign,
                 mode="refresh"):
        self.blocks, self.layers = blocks, layers
        self.preconditioner, self.mode = preconditioner, mode
        self.averages, self.refresh = averages, refresh
        self._assign = assign
        self.traced_averages = TracedOnce(averages.update_bucket)
        self.traced_part = TracedOnce(self._refresh_part)
        self.state_devices = None

    def divide_state(self, distribution):
        """Decides, before the state is built, whether each layer's state lives on its owner
        alone: where ``distribution``'s replicas are all this process's devices and the whole
        step is divided (:meth:`divides`). Workers in other processes each keep all of it, so
        that each one's checkpoint holds the whole state."""
        extended = distribution.extended
        replicas = distribution.num_replicas_in_sync
        if (self.mode == "step" and replicas > 1 and self.refresh.trace_thresholds is None
                and len(extended.worker_devices) == replicas and not _undivided()):
            self.state_devices = {name: extended.worker_devices[owner] for name, owner in
                                  self.refresh_owners(replicas).items()}

    def placement(self, block):
        """The context to create ``block``'s state in: one copy on its owner's device where
        the state is divided, the strategy's mirrors otherwise."""
        if self.state_devices is None:
            return contextlib.nullcontext()
        return single_copy_variables(self.state_devices[block.name])

    def divides(self, distribution, work="refresh"):
        """Whether ``work`` (``"refresh"`` or ``"step"``) is divided among the replicas: under a
        strategy of several, where ``replica_division`` divides it, unless
        ``TF_MSOPT_THOR_UNDIVIDED_REFRESH=1``; the refresh only without the trace rule (whose
        decisions each replica keeps for every layer). Always where the state is divided:
        only its owner holds a layer's state."""
        if self.state_devices is not None:
            return True
        return (self.mode in (work, "step") and tf.distribute.in_cross_replica_context()
                and distribution.num_replicas_in_sync > 1
                and (work == "step" or self.refresh.trace_thresholds is None)
                and not _undivided())

    def refresh_owners(self, replicas):
        """``{block name: replica}``: which of ``replicas`` refreshes each block's state
        when the refresh is divided, balanced by the cost of its factorisations (``count *
        size^3`` a factor of ``count`` blocks). A function of the model and the number of
        replicas alone: a restarted worker takes the same layers."""
        def cost(shape):
            return math.prod(shape[:-2]) * shape[-1] ** 3 if len(shape) >= 2 else shape[0]

        costs = [sum(cost(tuple(shape)) for shape in self.preconditioner.refreshed_shapes(block))
                 for block in self.blocks]
        return {block.name: owner for block, owner in zip(
            self.blocks, balanced_owners(costs, replicas))}

    def update(self, distribution, first, bucket, summed, root_damping, g_scale):
        """One bucket's layers (indices ``bucket``, statistics ``summed`` over replicas,
        ``first`` a variable of its first layer) with the refresh divided: the averages on
        every device, each layer's refresh on the replica that owns it, one all-reduce of
        whether the replicas' refreshes computed anything (how many factors, where the
        bases are counted) and of their counts, and, where any did, one all-gather that
        hands every replica all of the refreshed state."""
        ids, replicas = replica_ids(distribution), distribution.num_replicas_in_sync
        if self.averages.statistics_decay is not None:
            on_each_device(distribution, first, self._update_averages,
                           (ids, replicas, bucket, summed, g_scale))

        def share():
            parts, summaries = {}, {}

            def part(component, *args):
                replica = ids[device_of(component)]
                parts[replica], summaries[replica] = self.traced_part(replica, *args)
                return summaries[replica]

            distribution.extended.update(first.value, part, group=False, args=(
                replicas, bucket, summed, root_damping, g_scale))
            changed, retried, kept = tf.unstack(sum_device_values(distribution, summaries))
            recomputed = changed if self.refresh.counts_bases else None
            on_each_device(distribution, first, self.refresh.count,
                           (retried, kept, recomputed, bucket[0] == 0))

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

            # A refresh that kept every basis computed nothing: nothing to hand around; nor
            # where each layer's state is on its owner alone.
            if self.state_devices is None:
                when(changed > 0, hand_around)
            return tf.constant(True)

        when(self.refresh.due(), share)

    def _update_averages(self, component, ids, replicas, bucket, summed, g_scale):
        """The averages of ``bucket``'s layers (statistics ``summed``) that one device holds:
        all of them, or its own where the state is divided."""
        if self.state_devices is not None:
            owned = self._owned(ids[device_of(component)], replicas, bucket)
            bucket, summed = owned, [summed[bucket.index(index)] for index in owned]
        return self.traced_averages(component, bucket, summed, g_scale)

    def _owned(self, replica, replicas, bucket):
        """The layers of ``bucket`` that ``replica`` (of ``replicas``) refreshes."""
        owners = self.refresh_owners(replicas)
        return [index for index in bucket if owners[self.layers[index].block.name] == replica]

    def _refresh_part(self, replica, replicas, bucket, statistics, root_damping, g_scale):
        """This replica's share of one bucket's refresh: the refreshed state of the layers
        it owns, in layer order, and ``(changed, retried, kept)``: whether any of it was
        computed anew (how many factors, where the bases are counted), and the counts of
        blocks retried and kept. Where the state is divided, the owner assigns its own state
        and returns none of it."""
        owned = self._owned(replica, replicas, bucket)
        keeps_state = self.state_devices is not None
        refreshes = self.averages.refreshes(
            owned, [statistics[bucket.index(index)] for index in owned], g_scale)
        values, retried, kept, changed = {}, 0, 0, False
        if refreshes:
            retried, kept, recomputed = self.preconditioner.refresh(
                self.refresh.with_damping(refreshes, root_damping),
                self._assign if keeps_state else
                lambda variable, value: values.__setitem__(id(variable), value))
            # Either fills the same slot of the all-reduce: its size and order do not change.
            changed = (count_true(recomputed) if self.refresh.counts_bases
                       else tf.reduce_any(recomputed))
        state = [] if keeps_state else [
            values[id(variable)] for index in owned
            for variable in self.preconditioner.refreshed_state(self.layers[index])]
        return state, tf.stack([tf.cast(count, tf.float32) for count in (
            changed, 0 if retried is None else retried, kept)])

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


def _undivided():
    """Whether ``TF_MSOPT_THOR_UNDIVIDED_REFRESH=1`` has every replica do all the work."""
    return os.environ.get(UNDIVIDED_REFRESH, "0") not in ("", "0")
