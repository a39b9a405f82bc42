"""AdamOffload's host-kernel driver: turns a step's gradients into host-kernel calls, one per
group (learning rate), dtype and kind of variable, and returns the deltas to add on each
variable's device."""
import tensorflow as tf

from tf_msopt._common import in_xla_context
from tf_msopt.ops.adam import adam_offload_steps
from tf_msopt.schedules import value_at_step

__all__ = ["XLA_MESSAGE", "HostKernelDriver"]

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


class HostKernelDriver:
    """One step of AdamOffload on its host state, once per step whatever the replicas.

    Args:
        state: the optimizer's :class:`~tf_msopt.optimizers.adam_offload_state.OffloadState`.
        host_device, state_dtype: where the state lives and how the moments are stored.
        beta1, beta2, eps, loss_scale, use_nesterov, use_locking: the optimizer's settings.
        group_rates: each group's own learning rate (any form ``value_at_step`` reads), or
            None for the step's.
        variable_index: ``variable -> int``, its position among the optimizer's variables.
        assign, assign_add: ``(variable, value)``, the optimizer's.
    """

    def __init__(self, state, *, host_device, state_dtype, beta1, beta2, eps, loss_scale,
                 use_nesterov, use_locking, group_rates, variable_index, assign, assign_add):
        self.state, self.host_device, self.state_dtype = state, host_device, state_dtype
        self.beta1, self.beta2, self.eps, self.loss_scale = beta1, beta2, eps, loss_scale
        self.use_nesterov, self.use_locking = use_nesterov, use_locking
        self.group_rates, self.variable_index = group_rates, variable_index
        self.assign, self.assign_add = assign, assign_add

    def step_scalars(self, learning_rate, iterations):
        """``{group: (beta1**t, beta2**t, lr)}`` for the step after ``iterations``, on the
        host; None keys the variables in no group."""
        if in_xla_context():
            raise RuntimeError(XLA_MESSAGE.format(host=self.host_device))
        with tf.device(self.host_device):
            step = tf.cast(iterations, tf.int64) + 1
            powers = self.state.advance_powers(step, self.beta1, self.beta2, self.assign)
            rates = {None: tf.cast(learning_rate, tf.float32)}
            for index, rate in enumerate(self.group_rates):
                rates[index] = rates[None] if rate is None else tf.cast(
                    value_at_step(rate, iterations), tf.float32)
        return {key: (*powers, rate) for key, rate in rates.items()}

    def deltas(self, updates, scalars):
        """Updates the host state of each ``(gradient, copies of its variable)``; returns each
        variable's delta, or None where the variable lives on the host and was updated in the
        same pass. The variables of one group, dtype and kind go to one kernel call."""
        state = self.state
        batches = {}
        for position, (gradient, copies) in enumerate(updates):
            variable = copies[0]
            index = self.variable_index(variable)
            dtype = state.host_dtypes[index]   # float32 for half precision and compact state
            grad = tf.cast(tf.convert_to_tensor(gradient), dtype)  # IndexedSlices: dense
            decay = state.decay_factors[index]
            if decay:
                with tf.device(variable.device):
                    grad = tf.cast(variable, dtype) * tf.cast(decay, dtype) + grad
            in_place = (len(copies) == 1 and tf.as_dtype(variable.dtype) == dtype
                        and _same_device(variable.device, self.host_device))
            batches.setdefault((state.group_index[index], dtype, in_place), []).append(
                (position, index, grad, variable))
        deltas = [None] * len(updates)
        for (group, _, in_place), batch in batches.items():
            positions, indices, grads, variables = zip(*batch)
            beta1_power, beta2_power, lr = scalars[group]
            compact = self.state_dtype != "float32"
            found = adam_offload_steps(
                [state.moment1[i].value for i in indices],
                [state.moment2[i].value for i in indices], grads, beta1_power, beta2_power,
                lr, self.beta1, self.beta2, self.eps, 1.0 / self.loss_scale,
                use_nesterov=self.use_nesterov, use_locking=self.use_locking,
                variables=variables if in_place else None, assign=self.assign,
                assign_add=self.assign_add, state_dtype=self.state_dtype if compact else None,
                scales=[[scales[i].value for i in indices] for scales in state.scales]
                if self.state_dtype == "int8" else None)
            for position, delta in zip(positions, found or ()):
                deltas[position] = delta
        return deltas
