"""THOR: trace-based hardware-driven layer-oriented natural gradient (Chen et al. 2021).

The optimizer runs the step: which steps capture statistics and refresh the preconditioner,
each variable's :class:`~tf_msopt.thor.step_modifiers.VariableUpdate`, and the config. The
curvature state is :class:`~tf_msopt.thor.curvature_estimator.CurvatureEstimator`'s, the
preconditioners are in :mod:`tf_msopt.thor.preconditioners`, the link to the model in
:mod:`tf_msopt.thor.model_link`.
"""
import functools

import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import entry_point, register
from tf_msopt.optimizers.base import MindSporeOptimizer, make_variable_filter
from tf_msopt.schedules import value_at_step
from tf_msopt.thor.curvature_base import CurvatureBlock, Preconditioning, from_config
from tf_msopt.thor.curvature_estimator import CurvatureEstimator
from tf_msopt.thor.execution import on_each_device, when
from tf_msopt.thor.experimental import split_experimental
from tf_msopt.thor.grafting import AdamGraft, bias_correction
from tf_msopt.thor.loss_scale_link import LossScaleLink
from tf_msopt.thor.model_link import ModelLink
from tf_msopt.thor.options import ThorOptions
from tf_msopt.thor.preconditioners import PRECONDITIONERS
from tf_msopt.thor.step_modifiers import KLClip, VariableUpdate

__all__ = ["THOR"]

_OWNER = "THOR"


@register
class THOR(ModelLink, LossScaleLink, MindSporeOptimizer):
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
    are summed over replicas.

    Args:
        learning_rate: a number, a 0-D/1-D tensor or array (entry i at step i), an iterable
            or a ``LearningRateSchedule``.
        damping: ``lambda``, in the same forms; None where no step reads it (an eigenbasis
            grafted to Adam).
        momentum: float >= 0 (an int is rejected, as in MindSpore).
        weight_decay: float >= 0, added to the preconditioned gradient.
        loss_scale: float > 0 by which the incoming gradients are scaled (a surrounding
            ``LossScaleOptimizer``'s scale is undone on top of it).
        batch_size: the global batch size until one is observed (the LayerNorm rule).
        use_nesterov: bool.
        decay_filter: a callable ``f(keras.Variable) -> bool`` (True: decay) or a list of
            regular expressions of paths to exclude. Default: all.
        split_indices: indices of preconditioned layers that close an all-reduce bucket.
        enable_clip_grad: bool; clip each gradient to norm 1.
        frequency: int >= 2, steps between THOR steps.
        block_size: int or None (one block per factor); default 128.
        damping_mode: ``"sqrt"`` (MindSpore: ``sqrt(lambda)`` on both factors) or
            ``"relative"``: ``sqrt(lambda)`` times each factor's mean eigenvalue.
        statistics_decay: None (MindSpore: each refresh uses its own step's statistics) or
            ``beta`` in [0, 1): bias-corrected moving averages of ``A`` and ``G``, updated
            every step.
        fisher: ``"empirical"`` (MindSpore: ``G`` from the training loss) or ``"sampled"``:
            from labels drawn from the model's output distribution (its compiled
            cross-entropy loss, or :meth:`set_fisher_loss`).
        kl_clip: None or ``c > 0``: the factored kernels' steps scaled by
            :class:`~tf_msopt.thor.step_modifiers.KLClip`'s ``nu`` (``kl_factor``).
        seed: int in [0, 2**64) seeding the sampled labels; None draws one (kept).
        graft: None (MindSpore) or ``"adam"``: each step's direction from THOR, its length
            from Adam (:mod:`tf_msopt.thor.grafting`); other variables take Adam's step and
            momentum averages the steps.
        preconditioner: ``"inverse"`` (MindSpore's ``A_inv g G_inv``) or ``"eigenbasis"``
            (Adam in the eigenbases of the factors, SOAP), :mod:`tf_msopt.thor.preconditioners`.
        eigenbasis_exponent: with ``"eigenbasis"``: None (1/2), a number in (0, 1] or a dict
            of layer kinds with factors (``"dense"``, ``"conv"``, ...) to numbers.
        eigenbasis_tolerance: with ``"eigenbasis"``: None (every refresh decomposes every
            factor) or ``tol`` in (0, 1): a refresh decomposes only the factors whose current
            eigenvectors have drifted by more than ``tol`` in some block
            (:func:`~tf_msopt.thor.block_diagonal.basis_drift`); with ``statistics_decay``,
            only once the averages have had ``2 / (1 - statistics_decay)`` updates.
        max_rotated_dim: with ``"eigenbasis"``: None, or a kernel's factor wider than this
            and than its other factor is not rotated (nor estimated): the kernel is rotated on
            its narrower side only.
        statistics_rows: None (every row) or ``n >= 1``: each layer's statistics from a
            strided subsample of a call's examples, at least ``n`` rows (an example has one
            row per position where the kernel is applied).
        cautious: ``True``: each variable's momentum step only where it agrees in sign with
            this step's direction; ``"sequence"``: only the Dense and EinsumDense kernels
            applied at each position of a sequence; ``False``: none.
        experimental: None, a :class:`tf_msopt.thor.Experimental` or its config dict.
        layers: the curvature blocks' configs (set by :func:`tf_msopt.thor`).
        jit_compile: run each variable's update as one XLA function.
        name, **kwargs: the usual ``keras.optimizers.Optimizer`` arguments.

    With none of ``damping_mode``, ``statistics_decay``, ``fisher``, ``kl_clip``, ``graft``,
    ``preconditioner``, ``cautious`` and ``experimental`` changed, the update is MindSpore's
    exactly.

    References:
        Chen, Mingcong et al. THOR, Trace-based Hardware-driven layer-ORiented Natural
        Gradient Descent Computation. AAAI 2021. Vyas et al. SOAP: Improving and Stabilizing
        Shampoo using Adam. ICLR 2025. Liang et al. Cautious Optimizers: Improving Training
        with One Line of Code. arXiv:2411.16085, 2024.
    """

    def __init__(self, learning_rate, damping, momentum, weight_decay=0.0, loss_scale=1.0,
                 batch_size=32, use_nesterov=False, decay_filter=None, split_indices=None,
                 enable_clip_grad=False, frequency=100, block_size=128, damping_mode="sqrt",
                 statistics_decay=None, fisher="empirical", kl_clip=None, seed=None,
                 graft=None, preconditioner="inverse", eigenbasis_exponent=None,
                 eigenbasis_tolerance=None, max_rotated_dim=None, statistics_rows=None,
                 cautious=False, experimental=None, layers=None, name=None, jit_compile=None,
                 **kwargs):
        options = ThorOptions(
            damping, momentum, loss_scale=loss_scale, batch_size=batch_size,
            use_nesterov=use_nesterov, decay_filter=decay_filter, split_indices=split_indices,
            enable_clip_grad=enable_clip_grad, frequency=frequency, block_size=block_size,
            damping_mode=damping_mode, statistics_decay=statistics_decay, fisher=fisher,
            kl_clip=kl_clip, seed=seed, graft=graft, preconditioner=preconditioner,
            eigenbasis_exponent=eigenbasis_exponent, eigenbasis_tolerance=eigenbasis_tolerance,
            max_rotated_dim=max_rotated_dim, statistics_rows=statistics_rows,
            cautious=cautious, experimental=experimental, weight_decay=weight_decay)
        super().__init__(learning_rate, name=name, jit_compile=jit_compile,
                         weight_decay=options.weight_decay, **kwargs)
        self.options = options
        #: The preconditioner of the factored kernels (:mod:`tf_msopt.thor.preconditioners`).
        self.preconditioner = PRECONDITIONERS[options.preconditioner].from_options(options)
        self._decay_filter = make_variable_filter(decay_filter, (), "decay_filter", _OWNER)
        self._blocks = None if layers is None else tuple(
            b if isinstance(b, CurvatureBlock) else from_config(b) for b in layers)
        self._estimator = None
        self._updates = None
        self._watch_loss_scale_wrapper()

    @property
    def uses_damping(self):
        """Whether any step reads ``damping``."""
        return self.options.uses_damping

    def connect(self, model):
        self._updates = None    # planned for the previous model's variables
        return super().connect(model)

    # --- state

    @property
    def curvature(self):
        """Each factored block's curvature state by block name (its layer's name; a recurrent
        layer's ``<layer>_kernel`` and ``<layer>_recurrent_kernel``), in layer order: a
        :class:`~tf_msopt.thor.curvature_estimator.LayerCurvature` of optimizer variables.
        Empty before ``build``."""
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
        if self._blocks is None:
            raise ValueError(f"For '{_OWNER}', the optimizer has no layers; create it with "
                             f"tf_msopt.thor(model, ...) or call connect(model) first.")
        super().build(var_list)
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in var_list]
        self._estimator = CurvatureEstimator(self._blocks, self.options, self.preconditioner,
                                              self._is_refresh_step, self.assign,
                                              self.assign_add)
        if self.gradient_accumulation_steps and (
                compat.distribution_strategy(self).num_replicas_in_sync > 1):
            raise ValueError(
                f"For '{_OWNER}', gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} cannot run under a strategy with "
                f"several replicas: Keras accumulates in a conditional, which cannot hold "
                f"the strategy's synchronisation (Keras' own optimizers fail there too). "
                f"Use a larger global batch instead.")
        self._estimator.build_layers(self._add_state_variable,
                                     accumulates=bool(self.gradient_accumulation_steps))
        self._kl_clip = None
        if self.options.kl_clip is not None:
            self.kl_factor = self._add_state_variable((), "ones", "kl_factor")
            self._kl_clip = KLClip(self.options.kl_clip, self.assign)
        self._estimator.build_counters(self._add_state_variable)
        self.damping_retries = self._estimator.damping_retries
        self.failed_inverses = self._estimator.failed_inverses
        self._graft = (AdamGraft(self.add_variable_from_reference, self.assign, var_list)
                       if self.options.graft else None)

    def _add_state_variable(self, shape, initializer, name, dtype="float32"):
        # The curvature is computed in float32 whatever the model's dtype (``floatx``).
        return self.add_variable(shape, initializer=initializer, dtype=dtype, name=name)

    # --- the schedule of steps

    def _every(self, steps):
        """Whether this step is a multiple of ``steps`` (the Python ``True`` for 1)."""
        return steps == 1 or tf.equal(
            tf.math.floormod(tf.convert_to_tensor(self.iterations), steps), 0)

    def _is_statistics_step(self):
        return self._every(self.options.statistics_frequency)

    def _is_refresh_step(self):
        return self._every(self.options.frequency)

    def _root_damping(self):
        return tf.sqrt(tf.cast(value_at_step(self.options.damping, self.iterations),
                               tf.float32))

    # --- the plan of each variable's update

    def _plan_updates(self):
        """One :class:`VariableUpdate` per trainable variable. Treated layers' variables are
        matched by object: paths change when a model is loaded."""
        variables = compat.trainable_variables(self)
        model = self._connection.model()
        if model is not None and all(compat.tracked_index(self, v) is None
                                     for v in model.variables):
            raise RuntimeError(
                f"For 'THOR', none of the variables it updates belongs to the model "
                f"'{model.name}' it is connected to, so it would train them with no "
                f"curvature: it was compiled with, or applied to, another model (a "
                f"keras.models.clone_model copy is another model). Create it for the model "
                f"it trains: tf_msopt.thor(model).")
        blocks = self._connection.variable_blocks(
            self._blocks, len(variables), lambda variable: compat.tracked_index(self, variable))
        projections = self._connection.position_projections(self._blocks)
        return [self._plan(index, variable, block, projections)
                for index, (variable, block) in enumerate(zip(variables, blocks))]

    def _plan(self, index, variable, block, projections):
        options = self.options
        factored = block is not None and block.has_factors
        if factored:
            precondition = functools.partial(self._estimator.step, self.curvature[block.name])
        elif block is not None and self._graft is None:   # Adam's step replaces the rule
            precondition = functools.partial(self._layer_rule, block)
        else:
            precondition = None
        return VariableUpdate.plan(
            options, precondition, factored, self.momentums[index],
            self._graft.second_moments[index] if self._graft else None,
            decays=(self.weight_decay > 0 and bool(self._decay_filter(variable))
                    and not self.excluded_from_weight_decay(variable)),
            cautious=(options.cautious is True or options.cautious == "sequence" and factored
                      and block.name in projections),
            assign=self.assign, assign_sub=self.assign_sub)

    def _layer_rule(self, block, gradient, correction):
        del correction  # MindSpore's rule keeps no second moment
        # An accumulated update's batch is its cycle's steps together.
        batch = tf.convert_to_tensor(self._connection.batch) * (
            self.gradient_accumulation_steps or 1)
        state = Preconditioning(batch=batch, root_damping=self._root_damping())
        return block.precondition(gradient, state, self.options.block_size)

    # --- the step

    @entry_point
    def apply(self, grads, trainable_variables=None):
        self.wrapping_loss_scale_optimizer(self.connected_model())
        # Embedding gradients arrive as IndexedSlices; the preconditioned update is dense.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        return super().apply(grads, trainable_variables)

    def decay_weights(self, variables):
        """No decoupled decay: THOR adds ``weight_decay * w`` after preconditioning."""

    def _captured(self):
        """This replica's statistics of this step, read in replica context."""
        return [(tf.convert_to_tensor(s.a), tf.convert_to_tensor(s.g),
                 tf.convert_to_tensor(s.rows)) for s in self._connection.statistics]

    def accumulate_gradients(self, grads, acc_grads):
        # The statistics of a step that only accumulates join those of its cycle's update.
        super().accumulate_gradients(grads, acc_grads)
        when(self._is_statistics_step(), lambda: self._estimator.accumulate(self._captured()))

    def update_variables(self, grads, trainable_variables, learning_rate):
        if self._updates is None:
            self._updates = self._plan_updates()
        local = self._captured()       # summed over replicas by the estimator
        if self.gradient_accumulation_steps:
            local = self._estimator.with_pending(local)
        compat.merge_call(self._refresh, compat.distribution_strategy(self), local)
        super().update_variables(grads, trainable_variables, learning_rate)

    def _refresh(self, distribution, local):
        """Hands the estimator this step's statistics, damping and scale of ``G``."""
        if not local:
            return
        # Sampled labels come with an unscaled loss; the training loss carries its scale.
        g_scale = (tf.constant(1.0) if self.options.fisher == "sampled"
                   else tf.math.reciprocal(tf.square(self.scale_on_loss(self._connection.model()))))
        root_damping = self._root_damping() if self.options.damps_factors else None
        self._estimator.update(distribution, local, root_damping, g_scale,
                               self._is_statistics_step())

    def _direction(self, gradient, update, correction):
        """The variable's direction before the modifiers: preconditioned, grafted to Adam's
        length with ``graft`` (``correction``: Adam's bias correction at this step)."""
        gradient = tf.cast(gradient, tf.float32)
        if self.options.loss_scale != 1.0:
            gradient = gradient / self.options.loss_scale
        direction = (gradient if update.precondition is None
                     else update.precondition(gradient, correction))
        if self._graft is None:
            return gradient, direction
        return gradient, self._graft.direction(update.graft_moment, gradient,
                                               direction if update.factored else None,
                                               correction)

    def _bias_correction(self):
        """Adam's bias correction at this step for the graft's and the eigenbasis's second
        moments; None where THOR keeps neither (MindSpore's form), so its trace has none."""
        if self._graft is None and self.options.preconditioner != "eigenbasis":
            return None
        return bias_correction(self.iterations)

    def _apply(self, direction, variable, update, learning_rate):
        direction = tf.cast(direction, variable.dtype)
        for modify in update.modifiers:
            direction = modify(direction, variable)
        update.momentum_step(direction, variable, update.velocity, learning_rate)

    def _update(self, gradient, variable, learning_rate):
        update = self._updates[compat.variable_index(self, variable)]
        direction = self._direction(gradient, update, self._bias_correction())[1]
        self._apply(direction, variable, update, learning_rate)

    def distributed_update(self, distribution, grads_and_vars, learning_rate):
        if self._kl_clip is None:
            return super().distributed_update(distribution, grads_and_vars, learning_rate)
        # The KL factor needs every factored direction before any variable is updated.
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
        """Every variable's direction, the factored ones scaled by the KL clip's ``nu``,
        then every update."""
        planned, correction = [], self._bias_correction()
        for gradient, variable in grads_and_vars:
            update = self._updates[compat.variable_index(self, variable)]
            planned.append((variable, update, *self._direction(gradient, update, correction)))
        products = [tf.reduce_sum(gradient * direction)
                    for _, update, gradient, direction in planned if update.factored]
        nu = self._kl_clip(products, learning_rate, kl_factor) if products else None
        for variable, update, _, direction in planned:
            self._apply(direction * nu if update.factored else direction, variable, update,
                        learning_rate)

    # --- serialization

    def get_config(self):
        config = super().get_config()
        config.update(self.options.get_config())
        config["layers"] = None if self._blocks is None else [b.get_config() for b in self._blocks]
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # Configs written before the experimental namespace name its options at the top.
        config, experimental = split_experimental(config)
        return super().from_config(dict(config, experimental=experimental),
                                   custom_objects=custom_objects)
