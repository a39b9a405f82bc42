"""Learning-rate grafting: each variable's step takes its direction from THOR and its size
from Adam.

With ``graft="adam"`` THOR keeps Adam's second moment of every variable's gradient,
``v = beta2*v + (1-beta2)*g^2``, and its step ``a = g / (sqrt(v / (1-beta2^t)) + eps)``.
A Kronecker-factored variable moves along its preconditioned gradient ``P g`` rescaled to
Adam's step length, ``P g * |a| / |P g|``; every other variable (biases, LayerNorm, layers
THOR does not factor) takes Adam's step ``a`` itself. Momentum then averages the steps
(``v = m*v + (1-m)*d``), as Adam's first moment does, so a learning rate means what it
means to Adam, whatever the model's scale or the damping. Grafting is how Distributed
Shampoo carries first-order learning rates over to a preconditioned method.

References:
    Agarwal, Anil, Hazan, Koren and Zhang. Disentangling Adaptive Gradient Methods from
    Learning Rates. arXiv:2002.11803, 2020.
    Anil, Gupta, Koren, Regan and Singer. Scalable Second Order Optimization for Deep
    Learning (Distributed Shampoo). arXiv:2002.09018, 2020.
"""
import tensorflow as tf

__all__ = ["AdamGraft", "adam_step", "bias_correction", "second_moment"]

BETA2 = 0.999
EPSILON = 1e-7     # Keras' Adam's


def bias_correction(step):
    """Adam's ``1 - beta2^t`` at ``step`` (0 for the first, ``t = step + 1``). With the KL
    clip (the default), which plans every update together, THOR computes it once per step:
    the train step's graph size is part of its first epoch. Without it, Keras' per-variable
    updates compute it per variable."""
    return 1.0 - tf.pow(BETA2, tf.cast(step, tf.float32) + 1.0)


def second_moment(moment, gradient, correction, assign):
    """Adam's bias-corrected second moment ``v / correction`` of ``gradient`` (``correction``
    from :func:`bias_correction`), updating ``v = beta2*v + (1-beta2)*g^2`` held in the
    variable ``moment`` (any shape with ``gradient``'s size) with ``assign``."""
    reshaped = moment.shape != gradient.shape     # (the flat moment of a rotated gradient)
    previous = tf.reshape(moment, tf.shape(gradient)) if reshaped else moment
    # A float64 variable's moment (its slot has the variable's dtype), updated in float32.
    previous = tf.cast(previous, gradient.dtype)
    value = BETA2 * previous + (1.0 - BETA2) * tf.square(gradient)
    assign(moment, tf.reshape(value, moment.shape) if reshaped else value)
    return value / correction


def adam_step(moment, gradient, correction, assign):
    """Adam's step without its first moment, ``g / (sqrt(v_hat) + eps)`` (see
    :func:`second_moment`)."""
    return gradient / (tf.sqrt(second_moment(moment, gradient, correction, assign)) + EPSILON)


class AdamGraft:
    """Adam's second moments of the variables THOR updates, and the grafted direction.

    Args:
        add_slot: ``add_slot(variable, name)`` creates an optimizer variable shaped like
            ``variable`` (zeros), saved with the optimizer's state.
        assign: ``assign(variable, value)``, the optimizer's.
        variables: the variables THOR was built for, in order.
    """

    def __init__(self, add_slot, assign, variables):
        self.assign = assign
        self.second_moments = [add_slot(variable, "graft_second_moment")
                               for variable in variables]

    def direction(self, moment, gradient, preconditioned, correction):
        """The grafted direction of a variable whose second moment is ``moment`` (one of
        :attr:`second_moments`; ``correction`` from :func:`bias_correction`):
        ``preconditioned`` rescaled to Adam's step length, or Adam's step where
        ``preconditioned`` is None."""
        adam = adam_step(moment, gradient, correction, self.assign)
        if preconditioned is None:
            return adam
        return preconditioned * tf.math.divide_no_nan(tf.norm(adam), tf.norm(preconditioned))
