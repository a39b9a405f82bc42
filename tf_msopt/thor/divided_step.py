"""THOR's step divided among replicas (``replica_division="step"``).

Under a strategy of several replicas each factored kernel's preconditioned direction ``P g``
(the rotation into the eigenbases and back, or the product with the inverses: the part of a
step that grows with the layer's width) is computed on one replica, the owner that refreshes
its layer, with the state that computation updates (the rotated second moment). One
all-gather through the strategy's collectives hands both to every replica, which then
finishes every variable's step as the undivided step does: the graft, the KL clip over every
kernel in layer order, the modifiers and the momentum step. Every replica computes the same
bits, and the same bits as a step that is not divided: the owner's direction is the one every
replica would have computed. Where the state is divided as well (each layer's on its owner
alone, :meth:`~tf_msopt.thor.replica_division.ReplicaDivision.divide_state`), the owner keeps
the state it updated and only the directions are gathered.
"""
import tensorflow as tf

from tf_msopt._common import in_xla_context
from tf_msopt.thor.execution import (device_of, gather_device_values, on_each_device,
                                     replica_ids)

__all__ = ["DividedStep"]


class DividedStep:
    """The divided step of a :class:`~tf_msopt.thor.step.ThorStep` ``step`` whose curvature
    estimator is ``estimator`` (its division says which replica owns each layer)."""

    def __init__(self, step, estimator):
        self.step, self.estimator = step, estimator

    def divides(self, distribution):
        """Whether the step is divided under ``distribution`` (cross-replica context): there
        are factored layers, and the options divide it."""
        return bool(self.estimator.layers) and self.estimator.division.divides(distribution,
                                                                               "step")

    def __call__(self, distribution, indexed, learning_rate):
        """Every variable's update (``indexed``: ``(index, gradient, variable)``), the
        factored kernels' directions computed each by its owner."""
        ids, replicas = replica_ids(distribution), distribution.num_replicas_in_sync
        owners = self.estimator.refresh_owners(replicas)
        shares = [[] for _ in range(replicas)]
        for index, gradient, _ in indexed:
            layer = self.step.curvature_of.get(index)
            if layer is not None:
                shares[owners[layer.block.name]].append((index, gradient, layer))
        # A variable on every device to run the per-device functions on.
        anchor = (self.step.kl_clip.variable if self.step.kl_clip is not None
                  else self.estimator.anchor)
        parts = {}

        def part(component, shares):   # (shares: each gradient as it is on this device)
            replica = ids[device_of(component)]
            indices = [index for index, _, _ in shares[replica]]

            def owned(gradients):
                return self._owned_part(list(zip(indices, gradients)))
            if self.step.compile_update is not None and not in_xla_context():
                owned = self.step.compile_update(("divided step", id(component), *indices),
                                                 owned)
            parts[replica] = owned([gradient for _, gradient, _ in shares[replica]])
            return tf.constant(True)

        distribution.extended.update(anchor.value, part, args=(shares,), group=False)
        gathered = gather_device_values(distribution, parts)
        return on_each_device(distribution, anchor, self._finish,
                              (ids, gathered, shares, indexed, learning_rate))

    def _owned_part(self, share):
        """One replica's share: each of its kernels' preconditioned direction and the state
        that computed it updated, flat, in the order of ``share`` (``(index, gradient)``)."""
        correction = self.step.schedule.bias_correction(self.step.graft)
        values = []
        for index, gradient in share:
            update = self.step.updates[index]
            values.append(update.precondition(self.step.unscaled(gradient), correction))
            values += self._handed_state(self.step.curvature_of[index])
        # (The empty tensor: a replica may own nothing.)
        return tf.concat([tf.reshape(value, [-1]) for value in values] + [tf.zeros([0])], 0)

    def _finish(self, component, ids, gathered, shares, indexed, learning_rate):
        """On one device (``component``, the anchor's there): the other replicas' state
        assigned from ``gathered``, then every variable's update."""
        here, offset = ids[device_of(component)], 0
        preconditioned = {}

        def take(shape):
            nonlocal offset
            size = shape.num_elements()
            offset += size
            return tf.reshape(gathered[offset - size:offset], shape)

        for replica, share in enumerate(shares):
            for index, gradient, layer in share:
                preconditioned[index] = take(gradient.shape)
                for variable in self._handed_state(layer):
                    value = take(variable.shape)
                    if replica != here:
                        self.step.assign(variable, value)
        kl_factor = component if self.step.kl_clip is not None else None
        return self.step.clipped_update(kl_factor, indexed, learning_rate, preconditioned)

    def _handed_state(self, layer):
        """The state of ``layer`` its owner's step updates and hands to the other replicas:
        none where only the owner holds it."""
        if self.estimator.division.state_devices is not None:
            return []
        return self.estimator.preconditioner.stepped_state(layer)
