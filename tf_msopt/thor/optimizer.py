"""THOR: trace-based hardware-driven layer-oriented natural gradient (Chen et al. 2021).

The optimizer holds the lifecycle: its options (:mod:`tf_msopt.thor.options`), the link to
its model (:mod:`tf_msopt.thor.model_link`) and to a loss-scale wrapper
(:mod:`tf_msopt.thor.loss_scale_link`), its state (``build``) and its config. The step is
:class:`~tf_msopt.thor.step.ThorStep`'s, the curvature state
:class:`~tf_msopt.thor.curvature_estimator.CurvatureEstimator`'s, the preconditioners are in
:mod:`tf_msopt.thor.preconditioners`.
"""
import functools
import inspect

import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import entry_point, register
from tf_msopt.optimizers.base import MindSporeOptimizer, make_variable_filter
from tf_msopt.thor import options as thor_options
from tf_msopt.thor.capture import watch_compile
from tf_msopt.thor.curvature_base import CurvatureBlock, from_config
from tf_msopt.thor.curvature_estimator import CurvatureEstimator
from tf_msopt.thor.experimental import split_experimental
from tf_msopt.thor.grafting import AdamGraft
from tf_msopt.thor.loss_scale_link import LossScaleLink
from tf_msopt.thor.model_link import ModelLink, check_model, wrapped_optimizers
from tf_msopt.thor.preconditioners import PRECONDITIONERS
from tf_msopt.thor.readings import RefreshReadings
from tf_msopt.thor.step import StepSchedule, ThorStep, check_accumulation
from tf_msopt.thor.step_modifiers import KLClip

__all__ = ["THOR", "wrapped_thor"]

_OWNER = "THOR"


@register
class THOR(MindSporeOptimizer):
    """THOR, MindSpore's second-order optimizer, on Keras layers.

    Create it with :func:`tf_msopt.thor` (which finds the layers and connects the statistics
    capture). Each step ``t``, with ``lambda`` the damping and ``F`` the frequency::

        if t % F == 0:                       # THOR step: fresh statistics, new inverses
            A = E[x x^T],  G = E[delta delta^T]        per preconditioned layer
            A_inv = blockinv(A + sqrt(lambda) I),  G_inv = blockinv(G + sqrt(lambda) I)
        g = g / loss_scale
        g = A_inv g G_inv                    # Dense / Conv kernels (in, out)
        g = diag(a_inv) g G_inv              # Embedding tables
        g = g / (g*g/batch + sqrt(lambda))   # LayerNormalization gamma and beta
        g = g + weight_decay * w             # variables passing decay_filter
        g = g / max(|g|, 1)                  # with enable_clip_grad
        v = momentum * v + g;  u = v         (Nesterov: u = g + momentum * v)
        w = w - lr * u

    ``x`` is a layer's input (patches for a convolution), ``delta`` the gradient of its
    pre-activation output times the global batch size over the loss scale, ``E`` the mean over
    rows, ``blockinv`` the inverse of the diagonal blocks of size ``block_size``. Statistics
    are summed over replicas. With none of the options beyond MindSpore's changed, the update
    is MindSpore's exactly; the default configuration (``tf_msopt.thor(model)``) runs Adam in
    the factors' eigenbases (SOAP), grafted to Adam's step length, with the KL clip.

    Args:
        learning_rate, damping, momentum: as MindSpore's ``nn.thor``; ``damping`` may be None
            where no step reads it.
        **options: THOR's other options by name, each an entry of
            :data:`tf_msopt.thor.options.OPTIONS` (default, check, meaning: docs/thor.md's
            table), checked into :attr:`options`; and Keras' optimizer arguments.
        layers: the curvature blocks' configs (set by :func:`tf_msopt.thor`).
        jit_compile: run each variable's update as one XLA function.

    References:
        Chen, Mingcong et al. THOR, Trace-based Hardware-driven layer-ORiented Natural Gradient
        Descent Computation. AAAI 2021. Vyas et al. SOAP: Improving and Stabilizing Shampoo
        using Adam. ICLR 2025. Liang et al. Cautious Optimizers. arXiv:2411.16085, 2024.
    """

    def __init__(self, learning_rate, damping, momentum, *, layers=None, name=None,
                 jit_compile=None, **kwargs):
        names = thor_options.ThorOptions.names()
        given = {name: kwargs.pop(name) for name in names if name in kwargs}
        options = thor_options.ThorOptions(damping=damping, momentum=momentum, **given)
        super().__init__(learning_rate, name=name, jit_compile=jit_compile,
                         weight_decay=options.weight_decay, **kwargs)
        #: The checked options (:class:`~tf_msopt.thor.options.ThorOptions`).
        self.options = options
        #: The preconditioner of the factored kernels (:mod:`tf_msopt.thor.preconditioners`).
        self.preconditioner = PRECONDITIONERS[options.preconditioner].from_options(options)
        self._decay_filter = make_variable_filter(options.decay_filter, (), "decay_filter",
                                                  _OWNER)
        self._schedule = StepSchedule(options, lambda: self.iterations)
        self.readings = RefreshReadings(self._schedule, options.uses_damping)
        self._model_link = ModelLink(options, self.preconditioner, None if layers is None else
                                     tuple(b if isinstance(b, CurvatureBlock) else from_config(b)
                                           for b in layers))
        self._loss_scale_link = LossScaleLink()
        self._estimator = self._step = None

    def wrapped_by_loss_scale_optimizer(self):
        self._loss_scale_link.wrapped()

    @property
    def uses_damping(self):
        """Whether any step reads ``damping``."""
        return self.options.uses_damping

    # --- the model

    def connect(self, model):
        """Connects THOR to ``model`` (patches its layers to capture statistics); returns
        this optimizer. :func:`tf_msopt.thor` calls it; call it after
        ``keras.models.load_model`` (or :func:`tf_msopt.thor.connect`), under the strategy's
        scope if any, on a model with the layers THOR was created for. A model not built yet
        is connected when ``fit``, ``evaluate`` or ``train_on_batch`` builds it. Compiling
        the model with another optimizer stops the capture, with another THOR connects that
        one, and with this one again resumes it."""
        check_model(model)
        self._model_link.in_use = True
        watch_compile(model, functools.partial(self._model_link.compiled_with, owner=self))
        if not model.built:
            self._model_link.connect_when_built(model)
            return self
        if self._step is not None:
            self._step.updates = None    # planned for the previous model's variables
        self._model_link.connect(
            model, built=self.built, is_statistics_step=self._schedule.is_statistics_step,
            strategy=compat.distribution_strategy(self), step=compat.own_iterations(self),
            steps_per_update=self.gradient_accumulation_steps or 1)
        return self

    def _connect_built_model(self):
        """Connects the model THOR was created for unbuilt, where fit has just built it."""
        model = self._model_link.model_to_connect()
        if model is not None:
            self.connect(model)

    def connected_model(self):
        """The connected model; a ``RuntimeError`` when there is none."""
        if self._model_link.connection is None:
            self._connect_built_model()
        return self._model_link.connected_model()

    def set_fisher_loss(self, loss):
        """The Keras cross-entropy loss whose output distribution ``fisher="sampled"`` draws
        labels from in a custom loop (``fit`` reads the compiled loss); returns this one."""
        self._model_link.set_fisher_loss(loss)
        return self

    def link_loss_scale_optimizer(self, optimizer):
        """Tells THOR which ``keras.optimizers.LossScaleOptimizer`` applies it (``G`` is divided
        by its squared scale): needed for Keras' class in a custom loop whose model is not
        compiled with it (``tf_msopt.LossScaleOptimizer`` links itself)."""
        self._loss_scale_link.link(optimizer, self)

    def report(self):
        """A :class:`tf_msopt.thor.ThorReport`: every trainable variable's rule and why, and,
        once built, the pieces of its step."""
        steps = (self._step.parts(compat.trainable_variables(self),
                                  functools.partial(compat.tracked_index, self))
                 if self.built and self._model_link.connection is not None else {})
        state = self._estimator.state_held(compat.distribution_strategy(self)) if self.built else {}
        return self._model_link.report(
            self._estimator.trace_decisions() if self.built else {}, steps,
            self.gradient_accumulation_steps or 1, **state)

    def step_costs(self):
        """The floating-point operations THOR's curvature adds to a step, a
        :class:`~tf_msopt.thor.cost.LayerCost` per layer with factors."""
        return self._model_link.step_costs(self.gradient_accumulation_steps or 1)

    def savedmodel_only_children(self):
        counters = {} if self._estimator is None else self._estimator.savedmodel_only_children()
        return {**self._model_link.savedmodel_only_children(), **counters}

    # --- state

    @property
    def curvature(self):
        """``{block name: LayerCurvature}`` (a layer's name; a recurrent layer's
        ``<layer>_kernel`` and ``<layer>_recurrent_kernel``), in layer order; empty before
        ``build``."""
        layers = self._estimator.layers if self._estimator is not None else ()
        return {layer.block.name: layer for layer in layers}

    def refresh_owners(self, replicas):
        """``{block name: replica}``: which of ``replicas`` refreshes each factored block
        when a strategy divides the refresh (after ``build``)."""
        return self._estimator.refresh_owners(replicas) if self._estimator is not None else {}

    def build(self, var_list):
        if self.built:
            return
        self._connect_built_model()
        if self._model_link.blocks is None:
            raise ValueError(f"For '{_OWNER}', the optimizer has no layers; create it with "
                             f"tf_msopt.thor(model, ...) or call connect(model) first.")
        super().build(var_list)
        options = self.options
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in var_list]
        self._estimator = CurvatureEstimator(self._model_link.blocks, options,
                                             self.preconditioner,
                                             self._schedule.is_refresh_step, self.assign,
                                             self.assign_add)
        check_accumulation(self.gradient_accumulation_steps,
                           compat.distribution_strategy(self).num_replicas_in_sync)
        self._estimator.build_layers(self._add_state_variable, compat.distribution_strategy(self),
                                     accumulates=bool(self.gradient_accumulation_steps))
        kl_clip = None
        if options.kl_clip is not None:
            self.kl_factor = self._add_state_variable((), "ones", "kl_factor")
            kl_clip = KLClip(options.kl_clip, self.assign, self.kl_factor)
        self._estimator.build_counters(self._add_state_variable)
        self.damping_retries = self._estimator.damping_retries
        self.failed_inverses = self._estimator.failed_inverses
        self.readings.attach(self._estimator)
        graft = (AdamGraft(self.add_variable_from_reference, self.assign, var_list)
                 if options.graft else None)
        self._step = ThorStep(
            options, self._schedule, self._estimator, self._model_link, self.momentums, graft,
            kl_clip, decays=self._decays, assign=self.assign, assign_sub=self.assign_sub,
            steps_per_update=self.gradient_accumulation_steps or 1,
            scale_on_loss=lambda: self._loss_scale_link.scale_on_loss(
                self._model_link.connection.model(), self,
                options.loss_scale * (self.loss_scale_factor or 1.0)),
            compile_update=self._compiled if self.jit_compile else None)

    def _add_state_variable(self, shape, initializer, name, dtype="float32"):
        # The curvature is computed in float32 whatever the model's dtype (``floatx``).
        return self.add_variable(shape, initializer=initializer, dtype=dtype, name=name)

    def _decays(self, variable):
        return (self.weight_decay > 0 and bool(self._decay_filter(variable))
                and not self.excluded_from_weight_decay(variable))

    # --- Keras' hooks of the step, run by ThorStep

    @entry_point
    def apply(self, grads, trainable_variables=None):
        self._loss_scale_link.wrapper(self.connected_model(), self)
        # Embedding gradients arrive as IndexedSlices; the preconditioned update is dense.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        return super().apply(grads, trainable_variables)

    def decay_weights(self, variables):
        """No decoupled decay: THOR adds ``weight_decay * w`` after preconditioning."""

    def accumulate_gradients(self, grads, acc_grads):
        super().accumulate_gradients(grads, acc_grads)
        self._step.accumulate()

    def update_variables(self, grads, trainable_variables, learning_rate):
        if self._step.updates is None:
            self._step.plan(compat.trainable_variables(self),
                            functools.partial(compat.tracked_index, self))
        compat.merge_call(self._step.refresh, compat.distribution_strategy(self),
                          self._step.statistics())
        super().update_variables(grads, trainable_variables, learning_rate)

    def _update(self, gradient, variable, learning_rate):
        self._step.update(compat.variable_index(self, variable), gradient, variable,
                          learning_rate)

    def distributed_update(self, distribution, grads_and_vars, learning_rate):
        if not self._step.updates_together(distribution):
            return super().distributed_update(distribution, grads_and_vars, learning_rate)
        # The KL factor (and a divided step) needs every factored direction first.
        indexed = [(compat.variable_index(self, v), g, v) for g, v in grads_and_vars
                   if g is not None]
        return self._step.update_together(distribution, indexed, learning_rate)

    # --- serialization

    def get_config(self):
        config = super().get_config()
        config.update(self.options.get_config())
        blocks = self._model_link.blocks
        config["layers"] = None if blocks is None else [b.get_config() for b in blocks]
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # Configs written before the experimental namespace name its options at the top.
        config, experimental = split_experimental(config)
        return super().from_config(dict(config, experimental=experimental),
                                   custom_objects=custom_objects)



def wrapped_thor(optimizer):
    """The THOR that ``optimizer`` is or wraps (a LossScaleOptimizer's ``inner_optimizer``);
    None where there is none."""
    return next((o for o in wrapped_optimizers(optimizer) if isinstance(o, THOR)), None)

THOR.__init__.__signature__ = thor_options.signature(
    inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), trailing=[
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
        for name in ("layers", "name", "jit_compile")] + [
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
