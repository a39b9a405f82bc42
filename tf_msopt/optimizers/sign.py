"""Shared state of the sign optimizers (AddSign, PowerSign): ``m``, ``beta``, ``sign_decay``."""
import numbers

import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._validation import check_float, check_number_range, type_name
from tf_msopt.ops.sign import update_sign_variables
from tf_msopt.optimizers.base import MindSporeOptimizer
from tf_msopt.schedules import Schedule, serialize_step_value, value_at_step


def _check_sign_decay(sign_decay, owner):
    if isinstance(sign_decay, Schedule):
        return sign_decay
    if isinstance(sign_decay, bool) or not isinstance(sign_decay, numbers.Real):
        raise TypeError(
            f"For '{owner}', the 'sign_decay' must be a float or a schedule of the step (e.g. "
            f"tf_msopt.schedules.LinearSignDecay), but got type '{type_name(sign_decay)}'."
        )
    return check_float(sign_decay, "sign_decay", owner)


class SignOptimizer(MindSporeOptimizer):
    """Base of AddSign and PowerSign; subclasses name their rule and coefficient."""

    _rule = None          # "add_sign" or "power_sign" (tf_msopt.ops.sign)
    _coefficient = None   # "alpha" or "logbase"

    def __init__(self, learning_rate, coefficient, beta, sign_decay, name, jit_compile, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, jit_compile=jit_compile, **kwargs)
        owner = type(self).__name__
        setattr(self, self._coefficient, check_float(coefficient, self._coefficient, owner))
        self.beta = check_number_range(check_float(beta, "beta", owner), "beta", owner,
                                       low=0.0, high=1.0)
        self.sign_decay = _check_sign_decay(sign_decay, owner)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "m")

    def _update(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        m = self._momentums[compat.variable_index(self, variable)]
        sign_decay = value_at_step(self.sign_decay, self.iterations)
        hyper = [tf.cast(x, dtype) for x in (
            learning_rate, getattr(self, self._coefficient), sign_decay, self.beta)]
        grad = tf.cast(tf.convert_to_tensor(gradient), dtype)   # IndexedSlices: dense semantics
        update_sign_variables(self._rule, variable, m.value, *hyper, grad,
                              fused=getattr(self, "_fused", None))

    def get_config(self):
        config = super().get_config()
        sign_decay = serialize_step_value(self.sign_decay, "the 'sign_decay'",
                                          type(self).__name__)
        config.update({self._coefficient: getattr(self, self._coefficient), "beta": self.beta,
                       "sign_decay": sign_decay})
        return config
