"""How THOR updates a variable: :class:`VariableUpdate`, and the pieces of its step after
preconditioning, each in one place and each named (``optimizer.report()`` lists a variable's
pieces by these names):

- :class:`KLClip` (``kl_clip``): one factor ``nu`` for every Kronecker-factored kernel's step;
- :func:`weight_decay`, :func:`unit_norm_clip` (``enable_clip_grad``) and
  :func:`momentum_average` (with ``graft``): :class:`Modifier` objects, ``(direction, variable) ->
  direction``, applied in that order;
- :class:`MomentumStep` and :class:`CautiousMomentumStep` (``cautious``): the momentum
  update of a variable.

The grafted step length is :mod:`tf_msopt.thor.grafting`'s.
"""
import dataclasses

import tensorflow as tf

from tf_msopt._common import tf_variable

__all__ = ["CautiousMomentumStep", "KLClip", "Modifier", "MomentumStep", "Precondition",
           "VariableUpdate", "momentum_average", "unit_norm_clip", "weight_decay"]


@dataclasses.dataclass(frozen=True)
class Modifier:
    """A named piece of the step: ``apply(direction, variable) -> direction``."""

    name: str
    apply: object

    def __call__(self, direction, variable):
        return self.apply(direction, variable)


@dataclasses.dataclass(frozen=True)
class Precondition:
    """A variable's direction from its gradient, named: ``apply(gradient, correction)``
    (``correction``: Adam's bias correction at this step, for a rule with second moments)."""

    name: str
    apply: object

    def __call__(self, gradient, correction):
        return self.apply(gradient, correction)


def weight_decay(rate):
    """``d + rate * w``: MindSpore's decay, added to the preconditioned gradient."""
    return Modifier("weight decay", lambda direction, variable: direction + tf.cast(
        rate, variable.dtype) * variable)


#: ``d / max(|d|, 1)``: MindSpore's ``enable_clip_grad``.
unit_norm_clip = Modifier("unit-norm clip",
                          lambda direction, variable: tf.clip_by_norm(direction, 1.0))


def momentum_average(momentum):
    """``(1 - momentum) * d``: with ``graft``, momentum averages the steps as Adam's first
    moment does, so the learning rate means what it means to Adam."""
    return Modifier("momentum average", lambda direction, variable: direction * tf.cast(
        1.0 - momentum, variable.dtype))


class KLClip:
    """``nu = min(1, sqrt(c / (lr^2 |sum_k <g_k, P g_k>|)))`` over the Kronecker-factored
    kernels (``g`` the gradient, ``P g`` its step), multiplying those kernels' steps
    (kfac-pytorch's clip); ``variable`` keeps the last ``nu`` (the optimizer's
    ``kl_factor``)."""

    def __init__(self, clip, assign, variable):
        self.clip, self.assign, self.variable = clip, assign, variable

    def __call__(self, products, learning_rate, factor):
        """``nu`` from the products ``<g_k, P g_k>``, assigned to the variable ``factor`` (the
        optimizer's ``kl_factor``, this device's component)."""
        size = tf.abs(tf.add_n(products)) * tf.square(tf.cast(learning_rate, tf.float32))
        nu = tf.where(size > 0, tf.minimum(
            1.0, tf.sqrt(tf.math.divide_no_nan(self.clip, size))), 1.0)
        self.assign(factor, nu)
        return nu


class MomentumStep:
    """``v = m * v + d;  w = w - lr * v`` (Nesterov: ``w = w - lr * (d + m * v)``), one fused
    op, as MindSpore's ``ApplyMomentum``."""

    name = "momentum step"

    def __init__(self, momentum, use_nesterov):
        self.momentum, self.use_nesterov = momentum, use_nesterov

    def __call__(self, direction, variable, velocity, learning_rate):
        tf.raw_ops.ResourceApplyMomentum(
            var=tf_variable(variable).handle, accum=tf_variable(velocity).handle,
            lr=tf.cast(learning_rate, variable.dtype), grad=direction,
            momentum=tf.cast(self.momentum, variable.dtype), use_nesterov=self.use_nesterov)


class CautiousMomentumStep(MomentumStep):
    """The momentum step ``u`` along the entries where it agrees in sign with ``d``, ``k = [u *
    d > 0]``, scaled by ``1 / max(mean(k), 1e-3)`` (Liang et al. 2024): masking shortens no
    step on average."""

    name = "cautious momentum step"

    def __init__(self, momentum, use_nesterov, assign, assign_sub):
        super().__init__(momentum, use_nesterov)
        self.assign, self.assign_sub = assign, assign_sub

    def __call__(self, direction, variable, velocity, learning_rate):
        momentum = tf.cast(self.momentum, variable.dtype)
        averaged = momentum * velocity + direction
        self.assign(velocity, averaged)
        step = direction + momentum * averaged if self.use_nesterov else averaged
        agree = tf.cast(step * direction > 0, variable.dtype)
        scale = tf.cast(learning_rate, variable.dtype) / tf.maximum(tf.reduce_mean(agree), 1e-3)
        self.assign_sub(variable, scale * agree * step)


@dataclasses.dataclass(frozen=True)
class VariableUpdate:
    """How THOR updates one trainable variable (planned once, on its first step).

    Attributes:
        precondition: a :class:`Precondition` (the preconditioner's step for a factored
            kernel, the LayerNorm rule), or None for the gradient itself.
        factored: whether it is a Kronecker-factored kernel (the KL clip and the graft read
            its preconditioned direction).
        velocity: its momentum slot.
        graft_moment: Adam's second moment of its gradient, with ``graft``.
        modifiers: :class:`Modifier` objects, in order.
        momentum_step: ``(direction, variable, velocity, learning_rate)``.
        kl_clipped: whether the KL clip scales its direction.
    """

    precondition: object
    factored: bool
    velocity: object
    graft_moment: object
    modifiers: tuple
    momentum_step: object
    kl_clipped: bool = False

    @property
    def parts(self):
        """The names of the pieces of its step, in the order they run."""
        return tuple(name for name in (
            self.precondition.name if self.precondition else None,
            None if self.graft_moment is None else "Adam graft" if self.factored
            else "Adam step",
            "KL clip" if self.kl_clipped else None,
            *(modifier.name for modifier in self.modifiers),
            self.momentum_step.name) if name)

    @classmethod
    def plan(cls, options, precondition, factored, velocity, graft_moment, *, decays,
             cautious, assign, assign_sub):
        """The update ``options`` (:class:`~tf_msopt.thor.options.ThorOptions`) give a
        variable: ``decays`` says whether it gets weight decay, ``cautious`` whether its
        steps are masked."""
        modifiers = [piece for piece, used in (
            (weight_decay(options.weight_decay), decays),
            (unit_norm_clip, options.enable_clip_grad),
            (momentum_average(options.momentum), options.graft is not None)) if used]
        momentum_step = (CautiousMomentumStep(options.momentum, options.use_nesterov, assign,
                                              assign_sub)
                         if cautious else MomentumStep(options.momentum, options.use_nesterov))
        return cls(precondition, factored, velocity, graft_moment, tuple(modifiers),
                   momentum_step, kl_clipped=factored and options.kl_clip is not None)
