"""AdamOffload's state: the moments (and int8 scales) it keeps on the host, in which dtypes,
and each variable's group and weight-decay factor."""
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.ops.adam import COMPACT_MOMENT_DTYPES, scale_shape
from tf_msopt.optimizers.base import make_variable_filter, slot_name, variable_path

__all__ = ["DEFAULT_DECAY_EXCLUDES", "AdamOffloadState"]

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


def _single_copy_variable(next_creator, **kwargs):
    """Creates a plain variable where it is asked for: one copy on the host, even inside a
    ``tf.distribute`` scope (whose creator would put a mirror on every replica's device)."""
    del next_creator
    return compat.resource_variable(**kwargs)


class AdamOffloadState:
    """Mixin of :class:`~tf_msopt.optimizers.adam_offload.AdamOffload`: ``build`` creates the
    host state (one copy, in the host dtypes ``state_dtype`` asks for) and reads each variable's
    group and decay factor (``AdamOffload.moments`` and ``moment_scales`` give the state)."""

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        members = [_group_member(g["params"], i) for i, g in enumerate(self.groups)]
        default_decay = make_variable_filter(None, DEFAULT_DECAY_EXCLUDES, "weight_decay", _OWNER)
        weight_decay = self.weight_decay or 0.0  # None once a wrapper (LARS) takes it over
        self._group_index, self._decay_factors = [], []
        for variable in var_list:
            found = [i for i, member in enumerate(members) if member(variable)]
            if len(found) > 1:
                raise RuntimeError(
                    f"For '{_OWNER}', the variable '{variable_path(variable)}' is in groups "
                    f"{found}; a "
                    f"variable may be in one group only."
                )
            group = found[0] if found else None
            if self.excluded_from_weight_decay(variable):
                decay = 0.0
            elif group is None:
                decay = weight_decay if default_decay(variable) else 0.0
            else:
                decay = self.groups[group].get("weight_decay", weight_decay)
            self._group_index.append(group)
            # MindSpore adds (weight_decay * loss_scale) * w to the still-scaled gradient.
            self._decay_factors.append(decay * self.loss_scale)
        # Half-precision variables get float32 host arithmetic (float16 cannot hold Adam's
        # second moment or eps), as compact state does; the delta is cast on adding it.
        self._host_dtypes = [
            tf.as_dtype(_HOST_DTYPES.get(v.dtype, v.dtype) if self.state_dtype == "float32"
                        else "float32") for v in var_list]
        moment_dtypes = COMPACT_MOMENT_DTYPES.get(self.state_dtype)
        with tf.device(self.host_device), tf.variable_creator_scope(_single_copy_variable):
            self._moment1, self._moment2 = (
                [self.add_variable(v.shape, dtype=moment_dtypes[k] if moment_dtypes else host,
                                   name=slot_name(v, slot))
                 for v, host in zip(var_list, self._host_dtypes)]
                for k, slot in enumerate(("moment1", "moment2")))
            # int8 codes' scales: one per block of each moment (none for other dtypes).
            self._scales = [
                [self.add_variable(scale_shape(v.shape), dtype="float32",
                                   name=slot_name(v, f"{slot}_scale"))
                 for v in var_list] if self.state_dtype == "int8" else [None] * len(var_list)
                for slot in ("moment1", "moment2")]
            # MindSpore's running products beta**t (float32), and the step they are at.
            self._beta1_power, self._beta2_power = (
                self.add_variable((), initializer="ones", dtype="float32", name=name)
                for name in ("beta1_power", "beta2_power"))
            self._powers_step = self.add_variable((), dtype="int64", name="powers_step")
