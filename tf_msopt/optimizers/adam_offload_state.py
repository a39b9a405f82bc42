"""AdamOffload's host state: the moments (and int8 scales) it keeps on the host, in which dtypes,
each variable's group and weight-decay factor, and MindSpore's running products beta**t."""
import tensorflow as tf

from tf_msopt._common import single_copy_variables
from tf_msopt.ops.adam import COMPACT_MOMENT_DTYPES, scale_shape
from tf_msopt.optimizers.base import make_variable_filter, slot_name, variable_path

__all__ = ["DEFAULT_DECAY_EXCLUDES", "OffloadState"]

#: MindSpore's default decay filter: no weight decay for parameters whose name
#: has 'beta' or 'gamma' (normalization offsets and scales), on Keras paths.
DEFAULT_DECAY_EXCLUDES = ("beta", "gamma")

_OWNER = "AdamOffload"
_HOST_DTYPES = {"float16": "float32", "bfloat16": "float32", tf.float16: tf.float32,
                tf.bfloat16: tf.float32}


def _group_member(spec, index):
    """``predicate(keras.Variable)``: True for the variables of group ``index``."""
    keep = make_variable_filter(spec, (), f"groups[{index}]['params']", _OWNER)
    # The shared filter excludes what a regex list matches; a group is what it matches.
    return keep if callable(spec) else (lambda variable: not keep(variable))


class OffloadState:
    """The host state of a built AdamOffload: one copy on ``host_device``, whatever the
    replicas, created through the optimizer's ``add_variable`` (so the variables are the
    optimizer's, in the order they always had).

    Args:
        variables: the variables the optimizer is built for, in order.
        host_device: where the state lives.
        state_dtype: how the moments are stored (``"float32"``, ``"bfloat16"``, ``"int8"``).
        groups: the optimizer's checked groups (``params``, optionally ``weight_decay``).
        weight_decay: the default L2 coefficient (None once a wrapper, LARS, takes it over).
        loss_scale: the static loss scale, by which the decay factors are multiplied.
        excluded_from_weight_decay: ``variable -> bool``, the optimizer's exclusions.
        add_variable: the optimizer's ``add_variable``.

    Attributes:
        group_index: each variable's group (None for the defaults).
        decay_factors: each variable's factor of ``w`` added to the still-scaled gradient.
        host_dtypes: each variable's dtype of the host arithmetic.
        moment1, moment2: each variable's moments, as stored.
        scales: ``(moment1's, moment2's)`` int8 block scales per variable (Nones otherwise).
        beta1_power, beta2_power, powers_step: the running products and the step they are at.
    """

    def __init__(self, variables, *, host_device, state_dtype, groups, weight_decay,
                 loss_scale, excluded_from_weight_decay, add_variable):
        self.group_index, self.decay_factors = [], []
        self._read_groups(variables, groups, weight_decay or 0.0, loss_scale,
                          excluded_from_weight_decay)
        # Half-precision variables get float32 host arithmetic (float16 cannot hold Adam's
        # second moment or eps), as compact state does; the delta is cast on adding it.
        self.host_dtypes = [
            tf.as_dtype(_HOST_DTYPES.get(v.dtype, v.dtype) if state_dtype == "float32"
                        else "float32") for v in variables]
        moment_dtypes = COMPACT_MOMENT_DTYPES.get(state_dtype)
        with single_copy_variables(host_device):
            self.moment1, self.moment2 = (
                [add_variable(v.shape, dtype=moment_dtypes[k] if moment_dtypes else host,
                              name=slot_name(v, slot))
                 for v, host in zip(variables, self.host_dtypes)]
                for k, slot in enumerate(("moment1", "moment2")))
            # int8 codes' scales: one per block of each moment (none for other dtypes).
            self.scales = [
                [add_variable(scale_shape(v.shape), dtype="float32",
                              name=slot_name(v, f"{slot}_scale"))
                 for v in variables] if state_dtype == "int8" else [None] * len(variables)
                for slot in ("moment1", "moment2")]
            # MindSpore's running products beta**t (float32), and the step they are at.
            self.beta1_power, self.beta2_power = (
                add_variable((), initializer="ones", dtype="float32", name=name)
                for name in ("beta1_power", "beta2_power"))
            self.powers_step = add_variable((), dtype="int64", name="powers_step")

    def _read_groups(self, variables, groups, weight_decay, loss_scale, excluded):
        """Appends each variable's group and decay factor; a variable in two groups raises."""
        members = [_group_member(g["params"], i) for i, g in enumerate(groups)]
        default_decay = make_variable_filter(None, DEFAULT_DECAY_EXCLUDES, "weight_decay", _OWNER)
        for variable in variables:
            found = [i for i, member in enumerate(members) if member(variable)]
            if len(found) > 1:
                raise RuntimeError(
                    f"For '{_OWNER}', the variable '{variable_path(variable)}' is in groups "
                    f"{found}; a variable may be in one group only."
                )
            group = found[0] if found else None
            if excluded(variable):
                decay = 0.0
            elif group is None:
                decay = weight_decay if default_decay(variable) else 0.0
            else:
                decay = groups[group].get("weight_decay", weight_decay)
            self.group_index.append(group)
            # MindSpore adds (weight_decay * loss_scale) * w to the still-scaled gradient.
            self.decay_factors.append(decay * loss_scale)

    def checkpoint_children(self):
        """``{name: value}``: the names under which the optimizer's checkpoint (its object
        graph) holds the state, in the order the optimizer first held them."""
        return {"_group_index": self.group_index, "_decay_factors": self.decay_factors,
                "_host_dtypes": self.host_dtypes, "_moment1": self.moment1,
                "_moment2": self.moment2, "_scales": self.scales,
                "_beta1_power": self.beta1_power, "_beta2_power": self.beta2_power,
                "_powers_step": self.powers_step}

    def advance_powers(self, step, beta1, beta2, assign):
        """``(beta1**t, beta2**t)`` at ``step`` (an int64 tensor), through ``assign``.

        Running products, as MindSpore keeps them (pow(beta, t) rounds differently, enough
        to move MindSpore's golden weights by 1e-6), advanced once per step even when a
        wrapper calls update_step once per variable."""
        advance = self.powers_step < step
        beta1_power, beta2_power = (
            tf.where(advance, power * tf.constant(beta, tf.float32), power.value)
            for power, beta in ((self.beta1_power, beta1), (self.beta2_power, beta2)))
        assign(self.beta1_power, beta1_power)
        assign(self.beta2_power, beta2_power)
        assign(self.powers_step, step)
        return beta1_power, beta2_power
