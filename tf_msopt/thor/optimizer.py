"""THOR: trace-based hardware-driven layer-oriented natural gradient (Chen et al. 2021).

The optimizer runs the step: which steps capture statistics and recompute inverses, the
per-variable preconditioned momentum update, the KL clip and the config. The curvature
state and its updates are :class:`~tf_msopt.thor.curvature_estimator.CurvatureEstimator`'s,
the patched model :class:`~tf_msopt.thor.connection.ModelConnection`'s.
"""
import dataclasses

import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import register, tf_variable
from tf_msopt.optimizers.base import MindSporeOptimizer, make_variable_filter
from tf_msopt.schedules import value_at_step
from tf_msopt.thor import curvature_blocks
from tf_msopt.thor.connection import ModelConnection, matching_blocks
from tf_msopt.thor.curvature_blocks import Preconditioning
from tf_msopt.thor.curvature_estimator import CurvatureEstimator, LayerCurvature
from tf_msopt.thor.execution import on_each_device
from tf_msopt.thor.grafting import AdamGraft
from tf_msopt.thor.loss_scale_link import LossScaleLink
from tf_msopt.thor.options import ThorOptions, check_keras_arguments
from tf_msopt.thor.report import ThorReport, planned_rows, survey
from tf_msopt.thor.sampled_fisher import output_distribution

__all__ = ["THOR"]

_OWNER = "THOR"


def _block_from_config(config):
    if isinstance(config, curvature_blocks.CurvatureBlock):
        return config
    cls = curvature_blocks.REGISTRY[config["kind"]]
    fields = {field.name for field in dataclasses.fields(cls)}
    return curvature_blocks.from_config(
        {key: value for key, value in config.items() if key in fields or key == "kind"})


@register
class THOR(LossScaleLink, MindSporeOptimizer):
    """THOR, MindSpore's second-order optimizer, on Keras layers.

    Create it with :func:`tf_msopt.thor` (which finds the layers and connects
    the statistics capture). Each step ``t``, with ``lambda`` the damping and
    ``F`` the frequency::

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
        k = [u * g > 0];  u = u * k / max(mean(k), 1e-3)    # with cautious
        w = w - lr * u

    ``x`` is a layer's input (patches for a convolution), ``delta`` the
    gradient of its pre-activation output times the global batch size and
    divided by the loss scale, ``E`` the mean over rows (batch and every other
    leading axis). ``blockinv`` inverts the diagonal blocks of size
    ``block_size`` (Cholesky based). Stale steps reuse the stored inverses and
    capture nothing. Statistics are summed over replicas before inversion.

    Args:
        learning_rate: a number, a 0-D/1-D tensor or array (entry i at step i),
            an iterable or a ``LearningRateSchedule``.
        damping: ``lambda``, in the same forms.
        momentum: float >= 0 (an int is rejected, as in MindSpore).
        weight_decay: float >= 0, added to the preconditioned gradient.
        loss_scale: float > 0 by which the incoming gradients are scaled (a
            surrounding ``LossScaleOptimizer``'s scale is undone on top of it).
        batch_size: the per-step global batch size for when it cannot be
            observed (the LayerNorm rule before the first step).
        use_nesterov: bool.
        decay_filter: variables that get weight decay: a callable
            ``f(keras.Variable) -> bool`` or a list of regular expressions of
            paths to exclude. Default: all variables (as MindSpore).
        split_indices: indices of preconditioned layers that close an
            all-reduce bucket (default: one bucket).
        enable_clip_grad: bool; clip each gradient to norm 1.
        frequency: int >= 2, steps between THOR steps.
        block_size: int or None (one block per factor); default 128.
        layers: the curvature blocks' configs (set by :func:`tf_msopt.thor`; kept in
            the config).
        damping_mode: ``"sqrt"`` (MindSpore: ``sqrt(lambda)`` on both factors),
            ``"pi"``: ``A + pi*sqrt(lambda) I`` and ``G + sqrt(lambda)/pi I`` with
            ``pi = sqrt((tr A/dim A) / (tr G/dim G))`` (1 when a trace is 0), or
            ``"relative"``: ``A + sqrt(lambda) (tr A/dim A) I`` and the same for ``G``
            (``lambda`` in units of each factor's mean eigenvalue).
        statistics_decay: None (MindSpore: each inversion uses the statistics of
            its own step) or ``beta`` in [0, 1): ``A`` and ``G`` become moving
            averages ``m = beta*m + (1-beta)*stat``, bias-corrected by
            ``1 - beta**n`` (``n`` updates), kept as optimizer variables.
        statistics_frequency: steps between statistics captures (default 1 with a
            decay, else ``frequency``); must divide ``frequency``. Inverses are
            still recomputed every ``frequency`` steps.
        fisher: ``"empirical"`` (MindSpore: ``G`` from the training loss) or
            ``"sampled"``: ``G`` from the gradient of ``-log p(y_hat|x)`` with
            ``y_hat`` drawn from the model's output distribution (its compiled
            softmax/sigmoid cross-entropy loss, or :meth:`set_fisher_loss`).
        kl_clip: None or ``c > 0``: the preconditioned kernels' gradients are scaled
            by ``nu = min(1, sqrt(c / (lr^2 |sum <g, P g>|)))`` before weight decay
            and momentum.
        trace_thresholds: None or ``(omega1, omega2)``: on each inversion a layer's
            ``Delta = |T_k - T_prev| / T_prev`` (``T`` the trace of its damped
            Kronecker curvature) decides: above ``omega1`` new inverses, above
            ``omega2`` keep the previous ones, else keep them from then on (frozen).
            The decisions are counted in ``trace_decisions`` and shown by
            :meth:`report`.
        seed: int in [0, 2**64) seeding the sampled labels (``fisher="sampled"``); None draws one
            (kept in the config, so a resumed run samples as the original would).
        weight_sharing: how ``G`` treats the positions where a kernel is reused within an
            example (a convolution's output positions, a sequence's tokens): ``"mean"``
            (MindSpore: ``E`` over all rows, as ``A``) or ``"expand"``: summed over each
            example's positions, ``G = sum_rows delta delta^T / examples``, so that
            ``A (x) G`` has the Fisher's scale (KFC; K-FAC-expand). Layers without shared
            positions are unchanged.
        graft: None (MindSpore) or ``"adam"``: each step takes its direction from THOR
            and its length from Adam (:mod:`tf_msopt.thor.grafting`); the LayerNorm rule
            and first-order variables take Adam's step, and momentum averages the steps
            (``v = m*v + (1-m)*d``), so the learning rate means what it means to Adam.
        precondition_inputs: True (MindSpore: ``A_inv g G_inv``) or False: kernels are
            preconditioned on their output side only, ``g G_inv`` (``A`` is still
            estimated, as the damping and the trace rule read it, but not inverted).
            Whitening a layer's inputs can fit the training set faster than it generalises,
            as on an MLP over raw pixels.
        preconditioner: ``"inverse"`` (MindSpore: ``A_inv g G_inv``) or ``"eigenbasis"``:
            Adam run in the eigenbases of the factors (SOAP), ``Q_A (r / (sqrt(v_hat) +
            eps)) Q_G^T`` with ``r = Q_A^T g Q_G``, ``Q`` the eigenvectors of ``A`` and ``G``
            (recomputed where the inverses would be; damping does not change them) and
            ``v`` Adam's second moment of ``r`` (``beta2`` 0.999, ``eps`` 1e-7). An
            Embedding's diagonal ``A`` has the identity for eigenvectors.
        eigenbasis_exponent: read with ``preconditioner="eigenbasis"`` only: the power
            ``e`` of ``v`` that divides ``r``. None (Adam's 1/2 for every kernel), a number
            in (0, 1], or a dict of layer kinds (``"dense"``, ``"einsum_dense"``,
            ``"conv"``, ``"depthwise_conv"``, ``"embedding"``) to numbers, 1/2 for the
            kinds it leaves out. Other than 1/2 the step is ``r / (v_hat + 1e-2
            mean(v_hat))^e``, the mean over the layer's entries; 1 is EKFAC's natural
            gradient in the eigenbasis, and between them the step whitens more than Adam's
            and less than the Fisher's.
        cautious: ``True``: each variable steps only along the entries where its momentum
            step ``u`` and this step's direction ``g`` agree in sign, the kept entries scaled
            up by the fraction kept (``mean(k)`` over the variable's entries), so that
            momentum does not carry a weight against its current direction.
            ``"sequence"``: only the kernels of Dense and EinsumDense layers applied at each
            position of a sequence (a transformer's projections and MLPs) are masked.
            ``False``: none.
        jit_compile: run each variable's update as one XLA function.
        name, **kwargs: the usual ``keras.optimizers.Optimizer`` arguments.

    With none of ``damping_mode``, ``statistics_decay``, ``fisher``, ``kl_clip``,
    ``trace_thresholds``, ``weight_sharing``, ``graft``, ``precondition_inputs``,
    ``preconditioner`` and ``cautious`` changed, the update is MindSpore's exactly.

    References:
        Chen, Mingcong et al. THOR, Trace-based Hardware-driven layer-ORiented
        Natural Gradient Descent Computation. AAAI 2021.
        Grosse and Martens. A Kronecker-factored approximate Fisher matrix for
        convolution layers. ICML 2016 (KFC). Eschenhagen et al. Kronecker-Factored
        Approximate Curvature for Modern Neural Network Architectures. NeurIPS 2023
        (K-FAC-expand). Vyas et al. SOAP: Improving and Stabilizing Shampoo using Adam.
        ICLR 2025. George et al. Fast Approximate Natural Gradient Descent in a
        Kronecker-factored Eigenbasis. NeurIPS 2018 (EKFAC). Liang et al. Cautious
        Optimizers: Improving Training with One Line of Code. arXiv:2411.16085, 2024.
    """

    def __init__(self, learning_rate, damping, momentum, weight_decay=0.0, loss_scale=1.0,
                 batch_size=32, use_nesterov=False, decay_filter=None, split_indices=None,
                 enable_clip_grad=False, frequency=100, block_size=128, damping_mode="sqrt",
                 statistics_decay=None, statistics_frequency=None, fisher="empirical",
                 kl_clip=None, trace_thresholds=None, seed=None, weight_sharing="mean",
                 graft=None, precondition_inputs=True, preconditioner="inverse",
                 eigenbasis_exponent=None, cautious=False, layers=None, name=None,
                 jit_compile=None, **kwargs):
        options = ThorOptions(
            damping, momentum, loss_scale=loss_scale, batch_size=batch_size,
            use_nesterov=use_nesterov, decay_filter=decay_filter, split_indices=split_indices,
            enable_clip_grad=enable_clip_grad, frequency=frequency, block_size=block_size,
            damping_mode=damping_mode, statistics_decay=statistics_decay,
            statistics_frequency=statistics_frequency, fisher=fisher, kl_clip=kl_clip,
            trace_thresholds=trace_thresholds, seed=seed, weight_sharing=weight_sharing,
            graft=graft, precondition_inputs=precondition_inputs, preconditioner=preconditioner,
            eigenbasis_exponent=eigenbasis_exponent, cautious=cautious,
            weight_decay=weight_decay)
        check_keras_arguments(kwargs)
        super().__init__(learning_rate, name=name, jit_compile=jit_compile,
                         weight_decay=options.weight_decay, **kwargs)
        self.options = options
        self._decay_filter = make_variable_filter(decay_filter, (), "decay_filter", _OWNER)
        self._fisher_distribution = None
        self._blocks = None if layers is None else tuple(map(_block_from_config, layers))
        self._connection = None
        self._estimator = None
        self._rules = self._masked = None
        self._watch_loss_scale_wrapper()

    @property
    def uses_damping(self):
        """Whether any step reads ``damping`` (see :class:`ThorOptions`)."""
        return self.options.uses_damping

    # --- the model

    def connect(self, model):
        """Connects THOR to ``model``: patches its layers to capture statistics.

        :func:`tf_msopt.thor` calls it. Call it yourself after
        ``keras.models.load_model`` (or use :func:`tf_msopt.thor.connect`),
        under the distribution strategy's scope if there is one. The model must
        have the layers THOR was created for (same names, kinds and shapes).

        Returns:
            this optimizer.
        """
        blocks, layers, rows = survey(model, self.options.block_size)
        self._blocks = matching_blocks(self._blocks, blocks, self.built)
        self._connection = ModelConnection(
            model, blocks, layers, rows, block_size=self.options.block_size,
            weight_sharing=self.options.weight_sharing, batch_size=self.options.batch_size,
            is_statistics_step=self._is_statistics_step,
            strategy=compat.distribution_strategy(self),
            sampled_seed=self.options.seed if self.options.fisher == "sampled" else None,
            step=self.iterations, fisher_distribution=self._fisher_distribution)
        self._rules = None
        return self

    def set_fisher_loss(self, loss):
        """The loss whose output distribution ``fisher="sampled"`` draws labels from, for a
        custom training loop (``fit`` reads it off the compiled loss): a Keras
        cross-entropy loss, e.g. ``keras.losses.SparseCategoricalCrossentropy(
        from_logits=True)`` or ``"binary_crossentropy"``. Returns this optimizer."""
        self._fisher_distribution = output_distribution(loss)
        if self._connection is not None:
            self._connection.fisher_distribution = self._fisher_distribution
        return self

    def report(self):
        """A :class:`tf_msopt.thor.ThorReport`: every trainable variable's rule and why."""
        from tf_msopt.ops.inverse import inverse_backend

        rows = (self._connection.rows if self._connection is not None
                else planned_rows(self._blocks or (), self.options.block_size))
        decisions = self._estimator.trace_decisions() if self.built else {}
        return ThorReport(tuple(rows), self.options.frequency, self.options.block_size,
                          inverse_backend(), self._connection is not None, decisions)

    def savedmodel_only_children(self):
        # A training step traced in a SavedModel captures the capture buffers, so the
        # SavedModel must hold them; they are rewritten on every THOR step, so no
        # checkpoint does.
        if self._connection is None:
            return {}
        return {f"capture_buffer_{i}": buffer
                for i, buffer in enumerate(self._connection.buffers())}

    # --- state

    @property
    def curvature(self):
        """Each factored layer's curvature state by layer name, in layer order: a
        :class:`~tf_msopt.thor.curvature_estimator.LayerCurvature` of optimizer variables
        (its inverses or eigenvectors, moving averages, trace-rule state; None where the
        options keep none). Empty before ``build``."""
        layers = self._estimator.layers if self._estimator is not None else ()
        return {layer.block.layer: layer for layer in layers}

    @property
    def _traced_refresh(self):
        return self._estimator.traced_refresh

    def build(self, var_list):
        if self.built:
            return
        if self._blocks is None:
            raise ValueError(f"For '{_OWNER}', the optimizer has no layers; create it with "
                             f"tf_msopt.thor(model, ...) or call connect(model) first.")
        super().build(var_list)
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in var_list]
        self._estimator = CurvatureEstimator(self._blocks, self.options, self._is_inverse_step,
                                              self.assign, self.assign_add)
        self._estimator.build_layers(self._add_state_variable)
        if self.options.kl_clip is not None:
            self.kl_factor = self.add_variable((), initializer="ones", name="kl_factor")
        self._estimator.build_counters(self._add_state_variable)
        self.damping_retries = self._estimator.damping_retries
        self.failed_inverses = self._estimator.failed_inverses
        self._decay_flags = [self.weight_decay > 0 and bool(self._decay_filter(v))
                             and not self.excluded_from_weight_decay(v) for v in var_list]
        self._graft = (AdamGraft(self.add_variable_from_reference, self.assign, var_list)
                       if self.options.graft else None)

    def _add_state_variable(self, shape, initializer, name, dtype=None):
        return self.add_variable(shape, initializer=initializer, dtype=dtype, name=name)

    # --- the schedule of steps

    def _every(self, steps):
        """Whether this step is a multiple of ``steps``; the Python ``True`` when every step is
        (see :func:`~tf_msopt.thor.execution.when`)."""
        if steps == 1:
            return True
        return tf.equal(tf.math.floormod(tf.convert_to_tensor(self.iterations), steps), 0)

    def _is_statistics_step(self):
        return self._every(self.options.statistics_frequency)

    def _is_inverse_step(self):
        return self._every(self.options.frequency)

    def _damping(self):
        return tf.cast(value_at_step(self.options.damping, self.iterations), tf.float32)

    # --- the step

    def apply(self, grads, trainable_variables=None):
        if self._connection is None:
            raise RuntimeError(
                f"This {_OWNER} optimizer is not connected to a model, so it has no curvature "
                f"statistics and would silently act as momentum SGD. Create it with "
                f"tf_msopt.thor(model, ...), or after keras.models.load_model call "
                f"tf_msopt.thor.connect(model)."
            )
        self.wrapping_loss_scale_optimizer(self._connection.model())
        # Embedding gradients arrive as IndexedSlices; the preconditioned update is dense.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        return super().apply(grads, trainable_variables)

    def decay_weights(self, variables):
        """No decoupled decay: THOR adds ``weight_decay * w`` after preconditioning."""

    def update_variables(self, grads, trainable_variables, learning_rate):
        if self._rules is None:
            # Per variable index: a factored layer's LayerCurvature, another treated layer's
            # block, or None. Matched by object: update_step only sees tf.Variables.
            self._rules = self._connection.variable_rules(
                self._blocks, self._estimator.layers, len(compat.trainable_variables(self)),
                lambda variable: compat.tracked_index(self, variable))
            self._masked = self._cautious_variables()
        # This replica's statistics, read in replica context; summed by the estimator.
        local = [(tf.convert_to_tensor(s.a), tf.convert_to_tensor(s.g),
                  tf.convert_to_tensor(s.rows)) for s in self._connection.statistics]
        compat.merge_call(self._refresh_inverses, compat.distribution_strategy(self), local)
        super().update_variables(grads, trainable_variables, learning_rate)

    def _refresh_inverses(self, distribution, local):
        """Hands the estimator this step's statistics, damping and scale of ``G``
        (cross-replica context)."""
        if not local:
            return
        damping = tf.sqrt(self._damping())
        # Sampled labels come with an unscaled loss; the training loss carries its scale.
        g_scale = (tf.constant(1.0) if self.options.fisher == "sampled"
                   else tf.math.reciprocal(tf.square(self.scale_on_loss(self._connection.model()))))
        self._estimator.update(distribution, local, damping, g_scale, self._is_statistics_step())

    def distributed_update(self, distribution, grads_and_vars, learning_rate):
        if self.options.kl_clip is None:
            return super().distributed_update(distribution, grads_and_vars, learning_rate)
        # The KL factor needs every preconditioned gradient before any is applied.
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        return on_each_device(distribution, self.kl_factor, self._clipped_update_step,
                              (grads_and_vars, learning_rate))

    def _clipped_update_step(self, kl_factor, grads_and_vars, learning_rate):
        """The update with ``kl_clip`` on one device: one XLA function with ``jit_compile``."""
        if not self.jit_compile or compat.in_xla_context():
            return self._clipped_update(kl_factor, grads_and_vars, learning_rate)
        variables = [v for _, v in grads_and_vars]
        compiled = self._compiled(
            (id(kl_factor), *map(id, variables)),
            lambda gradients, learning_rate: self._clipped_update(
                kl_factor, zip(gradients, variables), learning_rate))
        return compiled([g for g, _ in grads_and_vars], tf.convert_to_tensor(learning_rate))

    def _clipped_update(self, kl_factor, grads_and_vars, learning_rate):
        """Preconditions each gradient once, scales the Kronecker-factored ones by
        ``nu = min(1, sqrt(kl_clip / (lr^2 |sum <g, P g>|)))``, then applies them all."""
        steps, products = [], []
        for gradient, variable in grads_and_vars:
            index = compat.variable_index(self, variable)
            gradient = self._unscaled(gradient)
            direction = self._step_direction(gradient, index)
            factored = isinstance(self._rules[index], LayerCurvature)
            if factored:
                products.append(tf.reduce_sum(gradient * direction))
            steps.append((direction, variable, index, factored))
        nu = None
        if products:
            size = tf.abs(tf.add_n(products)) * tf.square(tf.cast(learning_rate, tf.float32))
            nu = tf.where(size > 0, tf.minimum(
                1.0, tf.sqrt(tf.math.divide_no_nan(self.options.kl_clip, size))), 1.0)
            self.assign(kl_factor, nu)
        for direction, variable, index, factored in steps:
            self._apply(direction * nu if factored else direction, variable, index,
                        learning_rate)

    def _unscaled(self, gradient):
        gradient = tf.cast(gradient, tf.float32)
        return gradient / self.options.loss_scale if self.options.loss_scale != 1.0 else gradient

    def _update(self, gradient, variable, learning_rate):
        index = compat.variable_index(self, variable)
        direction = self._step_direction(self._unscaled(gradient), index)
        self._apply(direction, variable, index, learning_rate)

    def _step_direction(self, gradient, index):
        """The preconditioned gradient, grafted to Adam's step length with ``graft``."""
        if self._graft is None:
            return self._direction(gradient, index)
        # Grafted, only Kronecker-factored kernels keep THOR's direction: the LayerNorm
        # rule would be computed for nothing.
        preconditioned = (self._direction(gradient, index)
                          if isinstance(self._rules[index], LayerCurvature) else None)
        return self._graft.direction(index, gradient, preconditioned, self.iterations)

    def _direction(self, gradient, index):
        """The preconditioned gradient of the variable at ``index``."""
        rule = self._rules[index]
        if rule is None:
            return gradient
        if isinstance(rule, LayerCurvature):
            if self.options.preconditioner == "eigenbasis":
                return rule.eigenbasis_step(gradient, self.options.block_size, self.iterations,
                                            self.assign,
                                            self.options.exponent_of(rule.block.kind))
            return rule.precondition(gradient, self.options.block_size,
                                     self.options.precondition_inputs)
        state = Preconditioning(batch=tf.convert_to_tensor(self._connection.batch),
                                root_damping=tf.sqrt(self._damping()))
        return rule.precondition(gradient, state, self.options.block_size)

    def _cautious_variables(self):
        """Per variable index, whether ``cautious`` masks its steps."""
        if self.options.cautious != "sequence":
            return [self.options.cautious] * len(self._rules)
        projections = self._connection.position_projections(self._blocks)
        return [isinstance(rule, LayerCurvature) and rule.block.layer in projections
                for rule in self._rules]

    def _apply(self, direction, variable, index, learning_rate):
        """Weight decay, the optional norm clip and the momentum step (masked with
        ``cautious``)."""
        direction = tf.cast(direction, variable.dtype)
        if self._decay_flags[index]:
            direction += tf.cast(self.weight_decay, variable.dtype) * variable
        if self.options.enable_clip_grad:
            direction = tf.clip_by_norm(direction, 1.0)
        if self._graft is not None:     # momentum averages the steps, as Adam's first moment
            direction *= tf.cast(1.0 - self.options.momentum, variable.dtype)
        momentum = self.momentums[index]
        if self._masked[index]:
            self._cautious_step(direction, variable, momentum, learning_rate)
        else:
            tf.raw_ops.ResourceApplyMomentum(
                var=tf_variable(variable).handle, accum=tf_variable(momentum).handle,
                lr=tf.cast(learning_rate, variable.dtype), grad=direction,
                momentum=tf.cast(self.options.momentum, variable.dtype),
                use_nesterov=self.options.use_nesterov)

    def _cautious_step(self, direction, variable, velocity, learning_rate):
        """The momentum step along the entries where it agrees with ``direction``."""
        momentum = tf.cast(self.options.momentum, variable.dtype)
        averaged = momentum * velocity + direction
        self.assign(velocity, averaged)
        step = direction + momentum * averaged if self.options.use_nesterov else averaged
        agree = tf.cast(step * direction > 0, variable.dtype)
        # Rescaled by the fraction kept, so that masking shortens no step on average.
        scale = tf.cast(learning_rate, variable.dtype) / tf.maximum(tf.reduce_mean(agree), 1e-3)
        self.assign_sub(variable, scale * agree * step)

    # --- serialization

    def get_config(self):
        config = super().get_config()
        config.update(self.options.get_config())
        config["layers"] = None if self._blocks is None else [b.get_config() for b in self._blocks]
        return config
