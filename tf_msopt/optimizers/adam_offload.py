"""AdamOffload: Adam whose state and arithmetic live on the host.

This module is the public class: its arguments, checked here, its config, and the Keras hooks,
which hand the work to two objects: the host state
(:class:`~tf_msopt.optimizers.adam_offload_state.OffloadState`, made by ``build``) and, each
step, the host kernel's driver
(:class:`~tf_msopt.optimizers.adam_offload_host.HostKernelDriver`).
"""
import keras
import numpy as np
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import register
from tf_msopt._validation import (
    check_bool,
    check_choice,
    check_float,
    check_number_range,
    type_name,
)
from tf_msopt.ops.adam import STATE_DTYPES
# DEFAULT_DECAY_EXCLUDES and XLA_MESSAGE stay importable from here, where they were defined.
from tf_msopt.optimizers.adam_offload_host import XLA_MESSAGE, HostKernelDriver  # noqa: F401
from tf_msopt.optimizers.adam_offload_state import (  # noqa: F401
    _OWNER,
    DEFAULT_DECAY_EXCLUDES,
    OffloadState,
)
from tf_msopt.optimizers.base import (
    MindSporeOptimizer,
    check_filter,
    resolve_learning_rate,
    serialize_filter,
)
from tf_msopt.schedules import serialize_step_value

__all__ = ["AdamOffload"]

_GROUP_KEYS = ("params", "learning_rate", "weight_decay")


def _check_beta(value, arg):
    value = check_float(value, arg, _OWNER, allow_int=False)
    check_number_range(value, arg, _OWNER, low=0.0, high=1.0, low_inclusive=False,
                       high_inclusive=False)
    if np.float32(value) == 1.0:
        raise ValueError(
            f"For '{_OWNER}', the '{arg}' must be below 1.0 in float32 (the precision of the "
            f"update), but got {value!r}, which rounds to 1.0."
        )
    return value


def _check_eps(eps):
    eps = check_float(eps, "eps", _OWNER, allow_int=False)
    if not eps > 0:
        raise ValueError(f"For '{_OWNER}', the 'eps' must be float and must > 0, but got {eps}.")
    return eps


def _check_weight_decay(value, arg):
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        raise TypeError(
            f"For '{_OWNER}', the '{arg}' should be int or float, but got type "
            f"'{type_name(value)}'."
        )
    return check_number_range(float(value), arg, _OWNER, low=0.0)


def _check_loss_scale(loss_scale):
    loss_scale = check_float(loss_scale, "loss_scale", _OWNER)
    return check_number_range(loss_scale, "loss_scale", _OWNER, low=0.0, low_inclusive=False)


def _check_host_device(host_device):
    if not isinstance(host_device, str):
        raise TypeError(
            f"For '{_OWNER}', the type of 'host_device' should be 'str' (e.g. '/CPU:0'), but got "
            f"type '{type_name(host_device)}'."
        )
    try:
        tf.DeviceSpec.from_string(host_device)
    except ValueError as err:
        raise ValueError(
            f"For '{_OWNER}', the 'host_device' must be a device name such as '/CPU:0', but got "
            f"{host_device!r} ({err})."
        )
    return host_device


def _check_state_dtype(state_dtype):
    if not isinstance(state_dtype, str):   # (a tf.DType would compare equal to its name)
        raise TypeError(
            f"For '{_OWNER}', the type of 'state_dtype' should be 'str' (one of "
            f"{list(STATE_DTYPES)}), but got type '{type_name(state_dtype)}'."
        )
    return check_choice(state_dtype, "state_dtype", _OWNER, STATE_DTYPES)


def _check_groups(groups):
    """Validates ``groups`` and returns them with MindSpore's ``lr`` key renamed."""
    if groups is None:
        return []
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"For '{_OWNER}', the 'groups' must be a list of dicts, but got type "
            f"'{type_name(groups)}'."
        )
    checked = []
    for index, group in enumerate(groups):
        arg = f"groups[{index}]"
        if not isinstance(group, dict):
            raise TypeError(
                f"For '{_OWNER}', each entry of 'groups' must be a dict, but {arg} has type "
                f"'{type_name(group)}'."
            )
        group = dict(group)
        if "lr" in group:  # MindSpore's spelling
            if "learning_rate" in group:
                raise KeyError(f"For '{_OWNER}', {arg} gives both 'lr' and 'learning_rate'.")
            group["learning_rate"] = group.pop("lr")
        unknown = sorted(set(group) - set(_GROUP_KEYS))
        if unknown or "params" not in group:
            raise KeyError(
                f"For '{_OWNER}', {arg} must have the key 'params' and may have "
                f"'learning_rate' (or 'lr') and 'weight_decay', but got keys {sorted(group)}."
            )
        params = group["params"]
        check_filter(params, f"{arg}['params']", _OWNER)
        if params is None or (not callable(params) and not params):
            raise ValueError(
                f"For '{_OWNER}', {arg}['params'] must name the group's variables (a non-empty "
                f"list of regular expressions or a callable), but got {params!r}."
            )
        if "learning_rate" in group:
            group["learning_rate"] = resolve_learning_rate(group["learning_rate"], _OWNER,
                                                           arg=f"{arg}['learning_rate']")
        if "weight_decay" in group:
            group["weight_decay"] = _check_weight_decay(group["weight_decay"],
                                                        f"{arg}['weight_decay']")
        checked.append(group)
    return checked


@register
class AdamOffload(MindSporeOptimizer):
    """Adam with its moments and arithmetic on the host, MindSpore's ``nn.AdamOffload``.

    For a variable ``w`` with gradient ``g`` at step ``t`` (1, 2, ...)::

        g     = g / loss_scale + weight_decay * w     # L2 decay (not decoupled)
        lr_t  = lr * sqrt(1 - beta2**t) / (1 - beta1**t)
        m     = beta1 * m + (1 - beta1) * g
        v     = beta2 * v + (1 - beta2) * g * g
        delta = -lr_t * m / (sqrt(v) + eps)             # eps is not bias-corrected
        delta = -lr_t * (beta1 * m + (1 - beta1) * g) / (sqrt(v) + eps)   # use_nesterov
        w    += delta

    ``m`` and ``v`` live on ``host_device``, which also computes ``delta``, in
    one multi-threaded pass over g, m and v (a compiled CPU kernel, or the same
    arithmetic in TensorFlow ops without it). Only the decay term and
    ``w += delta`` run on the variable's device, so the optimizer keeps no
    state in accelerator memory. For ``float16`` / ``bfloat16`` variables the
    moments and the host arithmetic are ``float32`` (half precision cannot hold
    the second moment or ``eps``), and ``delta`` is rounded on adding it. A variable that
    lives on the host itself is updated in the same pass.

    ``state_dtype`` stores the moments in fewer bytes, the arithmetic staying
    float32: ``"bfloat16"`` (the new moments rounded to nearest even: 20 bytes
    of memory traffic a parameter per step instead of 28, 4 bytes of state
    instead of 8) or ``"int8"`` (8-bit codes of blocks of 2048 elements, each
    with a float32 scale, Dettmers et al.'s block-wise quantization: about 16
    bytes of traffic and 2 of state)::

        m, v  = decode(stored m, v)                 # before the step
        ...   = the step above, in float32          # delta from the new m and v
        stored m, v = encode(m, v)                  # after it

    For int8, ``encode`` divides each block by its largest ``|m|`` (largest
    ``v``) and rounds the quotient to the nearest 8-bit float with 3 fraction
    bits (m: a sign and 4 exponent bits, stored as int8; v: 5 exponent bits,
    uint8); ``tf_msopt.ops.adam`` defines it exactly. Under ``tf.distribute`` one copy of the state is
    kept and ``delta`` is computed once, then added on every replica.

    Weight decay (L2, added to the gradient, as in MindSpore) applies to
    variables whose path has neither ``beta`` nor ``gamma``; ``groups`` change
    that. The update cannot run inside an XLA-compiled train step: compile
    with ``model.compile(..., jit_compile=False)``.

    Args:
        learning_rate: a float, a 0-D/1-D tensor or array (entry i at step i), an
            iterable, or a ``keras.optimizers.schedules.LearningRateSchedule``.
        beta1, beta2: float decay rates of the moments, in (0, 1).
        eps: float > 0 added to ``sqrt(v)``.
        use_locking: bool; the kernel holds the moments' locks while it writes
            them either way (as TensorFlow's dense training ops do).
        use_nesterov: bool; use the Nesterov form of ``delta``.
        weight_decay: float >= 0, the L2 coefficient.
        loss_scale: float > 0; gradients are divided by it (MindSpore's static
            loss scale: the loss was multiplied by it).
        host_device: where the moments live and the update is computed.
        state_dtype: how the moments are stored: ``"float32"`` (the variable's
            dtype for float64 variables), ``"bfloat16"`` or ``"int8"``.
        groups: per-group settings, MindSpore's grouped parameters: a list of
            dicts with ``params`` (a list of regular expressions searched in
            ``variable.path``, or a callable ``f(keras.Variable) -> bool``) and
            optionally ``learning_rate`` (or ``lr``) and ``weight_decay``. A
            group's weight decay (its own, else ``weight_decay``) applies to all
            its variables, ``beta``/``gamma`` included; variables in no group
            use the defaults. A variable may be in one group only.
        name, **kwargs: the usual ``keras.optimizers.Optimizer`` arguments
            (``clipnorm``, ``global_clipnorm``, ``loss_scale_factor``, ...).
            ``jit_compile`` may only be False.

    References:
        Kingma, Ba. Adam: A Method for Stochastic Optimization. ICLR 2015.
        Ren et al. ZeRO-Offload: Democratizing Billion-Scale Model Training.
        USENIX ATC 2021.
        Dettmers et al. 8-bit Optimizers via Block-wise Quantization. ICLR 2022.
    """

    default_name_stem = "adam_offload"

    def __init__(self, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, use_locking=False,
                 use_nesterov=False, weight_decay=0.0, loss_scale=1.0, host_device="/CPU:0",
                 groups=None, state_dtype="float32", name=None, jit_compile=None, **kwargs):
        if jit_compile is not None and check_bool(jit_compile, "jit_compile", _OWNER):
            raise ValueError(
                f"For '{_OWNER}', the 'jit_compile' must be False: the update runs on the host "
                f"device, outside XLA, but got True."
            )
        loss_scale = _check_loss_scale(loss_scale)
        weight_decay = _check_weight_decay(weight_decay, "weight_decay")
        super().__init__(learning_rate=learning_rate, name=name, jit_compile=False, **kwargs)
        self.beta1 = _check_beta(beta1, "beta1")
        self.beta2 = _check_beta(beta2, "beta2")
        self.eps = _check_eps(eps)
        self.use_locking = check_bool(use_locking, "use_locking", _OWNER)
        self.use_nesterov = check_bool(use_nesterov, "use_nesterov", _OWNER)
        # MindSpore's L2 decay, added to the gradient (not Keras' decoupled decay,
        # which decay_weights below turns off).
        self.weight_decay = weight_decay
        self.loss_scale = loss_scale
        self.host_device = _check_host_device(host_device)
        self.groups = _check_groups(groups)
        self.state_dtype = _check_state_dtype(state_dtype)

    @property
    def moments(self):
        """The ``(moment1, moment2)`` lists, one entry per variable, on ``host_device``, as
        stored (``state_dtype``): ``tf_msopt.ops.adam.decode_moments`` gives their values."""
        return self._host_state.moment1, self._host_state.moment2

    @property
    def moment_scales(self):
        """The ``(moment1, moment2)`` lists of the int8 codes' scales (Nones for other
        ``state_dtype``)."""
        return tuple(self._host_state.scales)

    def build(self, var_list):
        """Creates the host state of ``var_list`` (once)."""
        if self.built:
            return
        super().build(var_list)
        state = OffloadState(
            var_list, host_device=self.host_device, state_dtype=self.state_dtype,
            groups=self.groups, weight_decay=self.weight_decay, loss_scale=self.loss_scale,
            excluded_from_weight_decay=self.excluded_from_weight_decay,
            add_variable=self.add_variable)
        # The checkpoint's object graph holds the state under the optimizer's own names, in
        # the order it always had, so checkpoints keep their layout.
        for name, value in state.checkpoint_children().items():
            setattr(self, name, value)
        self._host_state = state

    def decay_weights(self, variables):
        """No decoupled decay: ``weight_decay`` is MindSpore's L2 term, in the host step."""

    # -- the step ----------------------------------------------------------------------------

    def distributed_update(self, distribution, grads_and_vars, learning_rate):
        # Keras calls update_step once per replica's copy of a variable; the host
        # state must be updated once per step, so each delta is computed once here
        # (from the summed gradient) and added to every copy.
        driver = self._host_kernel_driver()
        scalars = driver.step_scalars(
            distribution.experimental_local_results(learning_rate)[0], self.iterations)
        deltas = driver.deltas(
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
        driver = self._host_kernel_driver()
        (delta,) = driver.deltas([(gradient, (variable,))],
                                 driver.step_scalars(learning_rate, self.iterations))
        if delta is not None:
            self._add_delta(variable, delta)

    def _host_kernel_driver(self):
        """The step's :class:`HostKernelDriver`, with the settings as they are now."""
        return HostKernelDriver(
            self._host_state, host_device=self.host_device, state_dtype=self.state_dtype,
            beta1=self.beta1, beta2=self.beta2, eps=self.eps, loss_scale=self.loss_scale,
            use_nesterov=self.use_nesterov, use_locking=self.use_locking,
            group_rates=[group.get("learning_rate") for group in self.groups],
            variable_index=lambda variable: compat.variable_index(self, variable),
            assign=self.assign, assign_add=self.assign_add)

    def _add_delta(self, variable, delta):
        with tf.device(variable.device):  # the one part of the step on the variable's device
            self.assign_add(variable, delta)

    # -- saving ------------------------------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config.update({
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "use_locking": self.use_locking,
            "use_nesterov": self.use_nesterov,
            "weight_decay": self.weight_decay,
            "loss_scale": self.loss_scale,
            "host_device": self.host_device,
            "state_dtype": self.state_dtype,
            "groups": [self._group_config(index, group) for index, group in
                       enumerate(self.groups)],
        })
        return config

    @staticmethod
    def _group_config(index, group):
        config = dict(group)
        config["params"] = serialize_filter(group["params"], f"groups[{index}]['params']", _OWNER)
        if "learning_rate" in group:
            config["learning_rate"] = serialize_step_value(
                group["learning_rate"], f"groups[{index}]['learning_rate']", _OWNER)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)

        def restore(value):
            if isinstance(value, dict) and "class_name" in value:
                return keras.saving.deserialize_keras_object(value, custom_objects=custom_objects)
            return value

        config["groups"] = [{key: restore(value) for key, value in group.items()}
                            for group in config.get("groups") or []]
        return super().from_config(config, custom_objects=custom_objects)
