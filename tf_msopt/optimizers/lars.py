"""LARS: layer-wise adaptive rate scaling around any Keras optimizer."""
import keras
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import entry_point, register, tf_variable
from tf_msopt._validation import check_bool, check_float, type_name
from tf_msopt.ops.lars import (apply_lars_momentum, decayed_gradient_and_trust, lars_gradient,
                               lars_momentum_kernel)
from tf_msopt.optimizers.base import (
    MindSporeOptimizer,
    WrapperOfOptimizer,
    check_filter,
    make_variable_filter,
    serialize_filter,
)

__all__ = ["LARS"]

#: MindSpore's default filter (no LARS for 'LayerNorm' or 'bias' names), matched
#: on Keras variable paths such as ``model/layer_normalization/gamma``.
DEFAULT_LARS_EXCLUDES = ("(?i)bias", "(?i)layer_?norm")

# Settings of the wrapped optimizer that Keras applies around its update step
# (in ``apply``, which LARS replaces: it runs the wrapped optimizer's update step
# directly). LARS takes them over and turns them off in the wrapped optimizer:
# the gradient settings act ahead of the trust ratio (as MindSpore's LARS takes
# the inner weight decay and loss scale); the moving average and gradient
# accumulation act as they would in the wrapped optimizer.
_TAKEN_OVER = {"weight_decay": None, "loss_scale_factor": None, "clipnorm": None,
               "clipvalue": None, "global_clipnorm": None, "use_ema": False,
               "ema_momentum": None, "ema_overwrite_frequency": None,
               "gradient_accumulation_steps": None}
# Switched off in the wrapped optimizer; ema_momentum only matters with use_ema.
_KEPT_IN_INNER = ("ema_momentum",)


def _check_wrapper_arguments(kwargs, owner):
    """Refuses the wrapped optimizer's settings given to LARS, as Keras' LossScaleOptimizer
    does: LARS reads them from the wrapped optimizer."""
    for key in kwargs:
        if key in _TAKEN_OVER or key == "learning_rate":
            raise ValueError(
                f"For '{owner}', '{key}' is the wrapped optimizer's setting: set it there "
                f"(e.g. keras.optimizers.SGD(..., {key}=...)), and LARS takes it over."
            )
        raise TypeError(f"For '{owner}', got an unexpected keyword argument '{key}'.")


def _check_optimizer(optimizer, owner):
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"For '{owner}', the 'optimizer' must be a keras.optimizers.Optimizer, "
            f"but got type '{type_name(optimizer)}'."
        )
    has_own_step = type(optimizer).update_step is not keras.optimizers.Optimizer.update_step
    if isinstance(optimizer, LARS) or not has_own_step:
        raise TypeError(
            f"For '{owner}', the 'optimizer' must be an optimizer with its own update step "
            f"(SGD, Adam, AddSign, ...), but got '{type_name(optimizer)}'. To combine LARS "
            f"with loss scaling, wrap it: LossScaleOptimizer(LARS(...))."
        )
    if (isinstance(optimizer, compat.Optimizer)
            and type(optimizer).update_variables is not compat.Optimizer.update_variables):
        raise TypeError(
            f"For '{owner}', the 'optimizer' must update each variable on its own, but "
            f"'{type_name(optimizer)}' computes its step from all of them together (THOR: its "
            f"curvature refresh and KL clip), which LARS, calling the per-variable step, "
            f"would skip. Use it without LARS."
        )
    return optimizer


@register
class LARS(WrapperOfOptimizer, MindSporeOptimizer):
    """Layer-wise adaptive rate scaling (You et al. 2017) around any Keras optimizer.

    MindSpore's ``nn.LARS``: for each variable ``w`` that passes ``lars_filter``,
    with ``g`` its gradient (summed over replicas) and ``wd`` the wrapped
    optimizer's weight decay::

        trust = coefficient * |w| / (wd * |w| + |g| + epsilon)
        trust = clip(trust / lr, 0, 1)          # only with use_clip (LARC's "clip")
        g'    = trust * (g + wd * w)

    where ``|.|`` is the L2 norm of the whole variable and ``lr`` the wrapped
    optimizer's current learning rate. ``g'`` then goes through the wrapped
    optimizer's own update step (for ``keras.optimizers.SGD``, the same
    arithmetic in one fused kernel, with ``trust`` folded into its learning
    rate). A variable that fails ``lars_filter`` gets its
    plain gradient and no weight decay. When ``|w| = 0`` or ``|g| = 0``, trust is
    1 (MindSpore gives 0 for ``|w| = 0``, which freezes zero-initialised weights).

    LARS takes over the wrapped optimizer's ``weight_decay`` (and the variables
    it excludes with ``exclude_from_weight_decay``), ``loss_scale_factor`` and
    gradient clipping (``clipnorm``, ``clipvalue``, ``global_clipnorm``): they
    are applied by LARS, before the trust ratio, and switched off in the wrapped
    optimizer. Its ``use_ema`` (with ``ema_momentum``,
    ``ema_overwrite_frequency``) and ``gradient_accumulation_steps`` are taken
    over the same way and act as in the wrapped optimizer: the moving average
    of the weights, and one update (of the averaged gradient) every
    ``gradient_accumulation_steps`` calls. Its ``learning_rate`` and ``iterations`` are the wrapped
    optimizer's, so schedules and callbacks such as ``ReduceLROnPlateau`` work
    unchanged. Given to LARS itself, any of these settings raises a ``ValueError``
    that says to set it on the wrapped optimizer (as Keras' ``LossScaleOptimizer``
    does).

    The norms are taken in the update step, on the gradient that
    ``tf.distribute`` has already summed over replicas: two replicas give the
    same result as one device on the global batch, with no host synchronisation.

    Args:
        optimizer: the ``keras.optimizers.Optimizer`` to wrap (not a
            ``LossScaleOptimizer``: wrap LARS in it instead).
        epsilon: float added to the denominator of the trust ratio.
        coefficient: float, the trust coefficient.
        use_clip: bool; clip ``trust / lr`` to [0, 1] (LARC's clip mode).
        lars_filter: which variables get LARS: a callable
            ``f(keras.Variable) -> bool`` (True: apply LARS), or a list of
            regular expressions of variable paths to exclude. The default
            excludes paths matching ``bias`` or ``layer_?norm``, ignoring case.
            Only the list form and registered functions can be saved.
        jit_compile: run each variable's LARS and inner update as one
            XLA-compiled function (default False).
        name: the optimizer's name.

    Reference:
        You, Gitman, Ginsburg. Large Batch Training of Convolutional Networks.
        arXiv:1708.03888, 2017.
    """

    default_name_stem = "lars"
    #: XLA's CPU reductions (the two norms) are several times slower than
    #: TensorFlow's kernels (``benchmarks/update_step.py``).
    default_jit_compile = False

    def __init__(self, optimizer, epsilon=1e-05, coefficient=0.001, use_clip=False,
                 lars_filter=None, name=None, jit_compile=None, **kwargs):
        owner = type(self).__name__
        _check_wrapper_arguments(kwargs, owner)
        _check_optimizer(optimizer, owner)
        epsilon = check_float(epsilon, "epsilon", owner, allow_int=False)
        coefficient = check_float(coefficient, "coefficient", owner, allow_int=False)
        use_clip = check_bool(use_clip, "use_clip", owner)
        check_filter(lars_filter, "lars_filter", owner)
        taken_over = {key: getattr(optimizer, key) for key in _TAKEN_OVER}
        super().__init__(learning_rate=0.0, name=name, jit_compile=jit_compile, **taken_over)
        for key, off in _TAKEN_OVER.items():
            if key not in _KEPT_IN_INNER:
                setattr(optimizer, key, off)
        self.inner_optimizer = optimizer
        self.epsilon = epsilon
        self.coefficient = coefficient
        self.use_clip = use_clip
        self.lars_filter = lars_filter
        self._lars_filter = make_variable_filter(lars_filter, DEFAULT_LARS_EXCLUDES,
                                                 "lars_filter", owner)
        # Exactly Keras' SGD (a subclass may change its step): see _fused_sgd_step.
        self._fused_sgd = type(optimizer) is keras.optimizers.SGD

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def variables(self):
        return compat.optimizer_own_variables(self) + self.inner_optimizer.variables

    def build(self, var_list):
        if self.built:
            return
        self._check_strategy()   # before the wrapped optimizer's build meets the mismatch
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        # Filters see keras.Variable paths, which update_step cannot: decide here.
        self._lars_flags = [bool(self._lars_filter(v)) for v in var_list]
        # Keras matches exclude_from_weight_decay names on the tf.Variable's full name.
        self._decay_flags = [bool(self.weight_decay)
                             and compat.uses_weight_decay(self.inner_optimizer, tf_variable(v))
                             for v in var_list]

    @entry_point
    def apply(self, grads, trainable_variables=None):
        if not len(grads):  # Keras counts no step for an empty gradient list either
            return super().apply(grads, trainable_variables)
        steps = self.gradient_accumulation_steps
        if steps:  # the wrapped optimizer steps on the calls that update, as in Keras
            applied = tf.cast(tf.equal(tf.math.floormod(
                tf.convert_to_tensor(compat.own_iterations(self)) + 1, steps), 0), tf.int64)
        super().apply(grads, trainable_variables)
        # The wrapped optimizer's step count drives its schedule and bias corrections.
        self.inner_optimizer.iterations.assign_add(applied if steps else 1)

    def update_variables(self, grads, trainable_variables, learning_rate):
        # LARS calls the wrapped optimizer's update_step for each variable; what that
        # optimizer updates once a step besides (Nadam's u_product) runs first, as it would.
        compat.run_once_a_step_state(self.inner_optimizer, learning_rate)
        return super().update_variables(grads, trainable_variables, learning_rate)

    def decay_weights(self, variables):
        """No decoupled decay: LARS adds ``weight_decay * w`` to the gradient instead."""

    def _update(self, gradient, variable, learning_rate):
        index = compat.variable_index(self, variable)
        if not self._lars_flags[index]:
            self.inner_optimizer.update_step(gradient, variable, learning_rate)
            return
        inner = self.inner_optimizer
        if self._fused_sgd and inner.momentum != 0 and lars_momentum_kernel(variable, gradient):
            # Norms and update in one compiled two-pass kernel (tf_msopt/ops/lars.py); the
            # TensorFlow ops below remain the path under XLA or with the custom ops off.
            apply_lars_momentum(variable, inner.momentums[index], gradient, learning_rate,
                                inner.momentum,
                                self.weight_decay if self._decay_flags[index] else 0.0,
                                self.coefficient, self.epsilon, self.use_clip, inner.nesterov)
            return
        if not self._fused_sgd:   # trust * (g + wd * w), compiled where it can run
            self.inner_optimizer.update_step(
                lars_gradient(variable, gradient, learning_rate,
                              self.weight_decay if self._decay_flags[index] else 0.0,
                              self.coefficient, self.epsilon, self.use_clip),
                variable, learning_rate)
            return
        gradient, trust = self._trust_ratio(gradient, variable, learning_rate,
                                            self._decay_flags[index])
        self._fused_sgd_step(gradient, variable, trust * tf.cast(learning_rate, trust.dtype))

    def _trust_ratio(self, gradient, variable, learning_rate, decay):
        """Returns ``(g + wd * w, trust)`` for one variable."""
        dtype = variable.dtype
        return decayed_gradient_and_trust(
            tf.convert_to_tensor(variable),
            tf.cast(tf.convert_to_tensor(gradient), dtype),   # IndexedSlices: dense
            tf.cast(learning_rate, dtype) if self.use_clip else None,
            tf.cast(self.weight_decay, dtype) if decay else None,
            tf.cast(self.coefficient, dtype), tf.cast(self.epsilon, dtype), self.use_clip)

    def _fused_sgd_step(self, gradient, variable, learning_rate):
        """``keras.optimizers.SGD``'s update step as one fused kernel.

        SGD sees the gradient only through ``lr * g``, so the trust ratio joins
        the learning rate instead of costing a pass over the gradient, and
        TensorFlow's kernel replaces SGD's five element-wise ops. The arithmetic
        is SGD's: ``m = momentum * m - lr * g; w += m`` (Nesterov:
        ``w += momentum * m - lr * g``).
        """
        inner = self.inner_optimizer
        handle = tf_variable(variable).handle
        if inner.momentum == 0:
            tf.raw_ops.ResourceApplyGradientDescent(var=handle, alpha=learning_rate,
                                                    delta=gradient)
            return
        momentum = inner.momentums[compat.variable_index(inner, variable)]
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=handle, accum=tf_variable(momentum).handle, lr=learning_rate, grad=gradient,
            momentum=tf.cast(inner.momentum, variable.dtype), use_nesterov=inner.nesterov)

    def get_config(self):
        optimizer = keras.saving.serialize_keras_object(self.inner_optimizer)
        # Saved as the user configured it; LARS takes these over again on loading.
        optimizer["config"].update({key: getattr(self, key) for key in _TAKEN_OVER})
        return {
            "name": self.name,
            "optimizer": optimizer,
            "epsilon": self.epsilon,
            "coefficient": self.coefficient,
            "use_clip": self.use_clip,
            "lars_filter": serialize_filter(self.lars_filter, "lars_filter", type(self).__name__),
            "jit_compile": self.jit_compile,
            "weight_decay_exclusions": self._weight_decay_exclusions(),
        }

    def _weight_decay_exclusions(self):
        """The wrapped optimizer's ``exclude_from_weight_decay(var_names=...)``, if any."""
        inner = self.inner_optimizer
        if getattr(inner, "_exclude_from_weight_decay", None):
            raise ValueError(
                f"For '{type(self).__name__}', variables excluded from weight decay by object "
                f"(exclude_from_weight_decay(var_list=...)) cannot be saved. Exclude them by "
                f"name instead: exclude_from_weight_decay(var_names=[...])."
            )
        pattern = getattr(inner, "_exclude_from_weight_decay_pattern", None)
        return None if pattern is None else [pattern.pattern]

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        exclusions = config.pop("weight_decay_exclusions", None)
        lars = super().from_config(config, custom_objects=custom_objects)
        if exclusions:
            lars.exclude_from_weight_decay(var_names=exclusions)
        return lars
