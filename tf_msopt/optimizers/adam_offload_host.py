"""AdamOffload's step: the driver of the host kernel, which batches the variables by group
(learning rate), dtype and kind into one kernel call each and adds each delta back on its
variable's device."""
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import in_xla_context
from tf_msopt.ops.adam import adam_offload_steps
from tf_msopt.optimizers.adam_offload_state import _OWNER
from tf_msopt.schedules import value_at_step

__all__ = ["XLA_MESSAGE", "AdamOffloadHostStep"]

XLA_MESSAGE = (
    "AdamOffload keeps its moments on the host device ({host}) and updates them there, which "
    "an XLA-compiled train step cannot do. Compile the model with "
    "model.compile(..., jit_compile=False); Keras compiles with XLA by default when a GPU is "
    "present (jit_compile='auto'). In a custom loop, use tf.function(jit_compile=False)."
)


def _same_device(a, b):
    a, b = tf.DeviceSpec.from_string(a or ""), tf.DeviceSpec.from_string(b or "")
    return ((a.device_type or "CPU").upper(), a.device_index or 0) == (
        (b.device_type or "CPU").upper(), b.device_index or 0)


class AdamOffloadHostStep:
    """Mixin of :class:`~tf_msopt.optimizers.adam_offload.AdamOffload`: the step, once per
    step on the host whatever the replicas, from the state
    :class:`~tf_msopt.optimizers.adam_offload_state.AdamOffloadState` built."""

    def _add_delta(self, variable, delta):
        with tf.device(variable.device):  # the one part of the step on the variable's device
            self.assign_add(variable, delta)

    def distributed_update(self, distribution, grads_and_vars, learning_rate):
        # Keras calls update_step once per replica's copy of a variable; the host
        # state must be updated once per step, so each delta is computed once here
        # (from the summed gradient) and added to every copy.
        scalars = self._step_scalars(distribution.experimental_local_results(learning_rate)[0])
        deltas = self._host_steps(
            [(distribution.experimental_local_results(grad)[0],
              distribution.experimental_local_results(variable))
             for grad, variable in grads_and_vars], scalars)
        for (_, variable), delta in zip(grads_and_vars, deltas):
            if delta is not None:
                distribution.extended.update(variable, self._add_delta, args=(delta,),
                                             group=False)

    def _update(self, gradient, variable, learning_rate):
        """One variable, for wrappers that call ``update_step`` themselves (e.g. LARS)."""
        if compat.distribution_strategy(self).num_replicas_in_sync > 1:
            raise RuntimeError(
                f"For '{_OWNER}', update_step was called for one replica's copy of a variable, "
                f"which would update the shared host state once per replica. Under a "
                f"multi-replica strategy, use AdamOffload as the outermost optimizer (or inside "
                f"a LossScaleOptimizer)."
            )
        (delta,) = self._host_steps([(gradient, (variable,))], self._step_scalars(learning_rate))
        if delta is not None:
            self._add_delta(variable, delta)

    def _step_scalars(self, learning_rate):
        """``{group: (beta1**t, beta2**t, lr)}`` for this step, on the host."""
        if in_xla_context():
            raise RuntimeError(XLA_MESSAGE.format(host=self.host_device))
        with tf.device(self.host_device):
            # Running products, as MindSpore keeps them (pow(beta, t) rounds differently,
            # enough to move MindSpore's golden weights by 1e-6). Advanced once per
            # step even when a wrapper calls update_step once per variable.
            step = tf.cast(self.iterations, tf.int64) + 1
            advance = self._powers_step < step
            beta1_power, beta2_power = (
                tf.where(advance, power * tf.constant(beta, tf.float32), power.value)
                for power, beta in ((self._beta1_power, self.beta1),
                                    (self._beta2_power, self.beta2)))
            self.assign(self._beta1_power, beta1_power)
            self.assign(self._beta2_power, beta2_power)
            self.assign(self._powers_step, step)
            rates = {None: tf.cast(learning_rate, tf.float32)}
            for index, group in enumerate(self.groups):
                rate = group.get("learning_rate")
                rates[index] = rates[None] if rate is None else tf.cast(
                    value_at_step(rate, self.iterations), tf.float32)
        return {key: (beta1_power, beta2_power, rate) for key, rate in rates.items()}

    def _host_steps(self, updates, scalars):
        """Updates the host state of each ``(gradient, copies of its variable)``; returns each
        variable's delta, or None where the variable lives on the host and was updated in the
        same pass. The variables of one group, dtype and kind go to one kernel call."""
        batches = {}
        for position, (gradient, copies) in enumerate(updates):
            variable = copies[0]
            index = compat.variable_index(self, variable)
            dtype = self._host_dtypes[index]   # float32 for half precision and compact state
            grad = tf.cast(tf.convert_to_tensor(gradient), dtype)  # IndexedSlices: dense
            decay = self._decay_factors[index]
            if decay:
                with tf.device(variable.device):
                    grad = tf.cast(variable, dtype) * tf.cast(decay, dtype) + grad
            in_place = (len(copies) == 1 and tf.as_dtype(variable.dtype) == dtype
                        and _same_device(variable.device, self.host_device))
            batches.setdefault((self._group_index[index], dtype, in_place), []).append(
                (position, index, grad, variable))
        deltas = [None] * len(updates)
        for (group, _, in_place), batch in batches.items():
            positions, indices, grads, variables = zip(*batch)
            beta1_power, beta2_power, lr = scalars[group]
            compact = self.state_dtype != "float32"
            found = adam_offload_steps(
                [self._moment1[i].value for i in indices],
                [self._moment2[i].value for i in indices], grads, beta1_power, beta2_power,
                lr, self.beta1, self.beta2, self.eps, 1.0 / self.loss_scale,
                use_nesterov=self.use_nesterov, use_locking=self.use_locking,
                variables=variables if in_place else None, assign=self.assign,
                assign_add=self.assign_add, state_dtype=self.state_dtype if compact else None,
                scales=[[scales[i].value for i in indices] for scales in self._scales]
                if self.state_dtype == "int8" else None)
            for position, delta in zip(positions, found or ()):
                deltas[position] = delta
        return deltas
