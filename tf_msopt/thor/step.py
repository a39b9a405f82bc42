"""THOR's step: when it captures and refreshes, and how it updates each variable.

:class:`StepSchedule` says which steps capture statistics and refresh the preconditioner.
:class:`ThorStep` plans each variable's :class:`~tf_msopt.thor.step_modifiers.VariableUpdate`
on its first step and runs a step: this step's statistics to the curvature estimator, then
each variable's direction (preconditioned, grafted to Adam's length), the KL clip, the
modifiers and the momentum step.
"""
import functools

import tensorflow as tf

from tf_msopt._common import in_xla_context
from tf_msopt.schedules import value_at_step
from tf_msopt.thor.curvature_base import Preconditioning
from tf_msopt.thor.divided_step import DividedStep
from tf_msopt.thor.execution import on_each_device, when
from tf_msopt.thor.grafting import bias_correction
from tf_msopt.thor.step_modifiers import Precondition, VariableUpdate

__all__ = ["StepSchedule", "ThorStep", "check_accumulation"]


def check_accumulation(steps, replicas):
    """Refuses gradient accumulation (``steps``) under a strategy of several ``replicas``."""
    if steps and replicas > 1:
        raise ValueError(
            f"For 'THOR', gradient_accumulation_steps={steps} cannot run under a strategy "
            f"with several replicas: Keras accumulates in a conditional, which cannot hold "
            f"the strategy's synchronisation (Keras' own optimizers fail there too). Use a "
            f"larger global batch instead.")


class StepSchedule:
    """Which steps capture statistics and refresh, from ``options`` and ``step()``, the
    optimizer's ``iterations`` (its count of updates)."""

    def __init__(self, options, step):
        self.options, self.step = options, step

    def _every(self, steps):
        """Whether this step is a multiple of ``steps`` (the Python ``True`` for 1)."""
        return steps == 1 or tf.equal(
            tf.math.floormod(tf.convert_to_tensor(self.step()), steps), 0)

    def is_statistics_step(self):
        return self._every(self.options.statistics_frequency)

    def is_refresh_step(self):
        return self._every(self.options.frequency)

    def refreshes(self, steps):
        """How many of the first ``steps`` updates refreshed: steps 0, F, 2F, ... (every
        statistics step refreshes where there is no moving average, and those steps are
        these)."""
        return (steps + self.options.frequency - 1) // self.options.frequency

    def damping(self, step=None):
        """``lambda`` at ``step``, this step where None."""
        return value_at_step(self.options.damping, self.step() if step is None else step)

    def root_damping(self):
        """``sqrt(lambda)`` at this step."""
        return tf.sqrt(tf.cast(self.damping(), tf.float32))

    def bias_correction(self, graft):
        """Adam's bias correction at this step for the graft's and the eigenbasis's second
        moments; None where THOR keeps neither (MindSpore's form), so its trace has none."""
        if graft is None and self.options.preconditioner != "eigenbasis":
            return None
        return bias_correction(self.step())


class ThorStep:
    """The step of a built THOR.

    Args:
        options: the optimizer's :class:`~tf_msopt.thor.options.ThorOptions`.
        schedule: its :class:`StepSchedule`.
        estimator: its :class:`~tf_msopt.thor.curvature_estimator.CurvatureEstimator`.
        link: its :class:`~tf_msopt.thor.model_link.ModelLink` (the captured statistics,
            the model's blocks).
        momentums: each variable's momentum slot, in order.
        graft: the :class:`~tf_msopt.thor.grafting.AdamGraft`, or None.
        kl_clip: the :class:`~tf_msopt.thor.step_modifiers.KLClip`, or None.
        decays: ``variable -> bool``, whether weight decay applies to it.
        assign, assign_sub: ``(variable, value)``, the optimizer's.
        steps_per_update: the steps of a gradient accumulation cycle (1 without).
        scale_on_loss: ``() -> tensor``, every scale on the training loss this step.
        compile_update: ``(key, function) -> function`` compiled with XLA once per key, with
            ``jit_compile``; None without.
    """

    def __init__(self, options, schedule, estimator, link, momentums, graft, kl_clip, *,
                 decays, assign, assign_sub, steps_per_update, scale_on_loss, compile_update):
        self.options, self.schedule, self.estimator, self.link = (options, schedule,
                                                                  estimator, link)
        self.momentums, self.graft, self.kl_clip = momentums, graft, kl_clip
        self.decays, self.assign, self.assign_sub = decays, assign, assign_sub
        self.steps_per_update, self.scale_on_loss = steps_per_update, scale_on_loss
        self.compile_update = compile_update
        #: Each variable's :class:`VariableUpdate`, planned on the first step.
        self.updates = None
        #: ``{index: LayerCurvature}`` of the factored kernels, planned with them.
        self.curvature_of = {}
        self.divided = DividedStep(self, estimator)

    # --- the plan of each variable's update

    def plan(self, variables, index_of):
        """One :class:`VariableUpdate` per trainable variable (``index_of(variable)``: its
        index among them, None for one the optimizer does not track). Treated layers'
        variables are matched by object: paths change when a model is loaded."""
        model = self.link.connection.model()
        if model is not None and all(index_of(v) is None for v in model.variables):
            raise RuntimeError(
                f"For 'THOR', none of the variables it updates belongs to the model "
                f"'{model.name}' it is connected to, so it would train them with no "
                f"curvature: it was compiled with, or applied to, another model (a "
                f"keras.models.clone_model copy is another model). Create it for the model "
                f"it trains: tf_msopt.thor(model).")
        blocks = self.link.connection.variable_blocks(self.link.blocks, len(variables), index_of)
        projections = self.link.connection.position_projections(self.link.blocks)
        curvature = {layer.block.name: layer for layer in self.estimator.layers}
        self.updates = [self._plan(index, variable, block, projections, curvature)
                        for index, (variable, block) in enumerate(zip(variables, blocks))]
        return self.updates

    def parts(self, variables, index_of):
        """``{variable path: the names of the pieces of its step}``, planned if need be."""
        updates = self.updates or self.plan(variables, index_of)
        return {variable.path: update.parts for variable, update in zip(variables, updates)}

    def _plan(self, index, variable, block, projections, curvature):
        options = self.options
        factored = block is not None and block.has_factors
        if factored:
            self.curvature_of[index] = curvature[block.name]
            precondition = Precondition(f"{options.preconditioner} preconditioner",
                                        functools.partial(self.estimator.step,
                                                          curvature[block.name]))
        elif block is not None and self.graft is None:   # Adam's step replaces the rule
            precondition = Precondition(block.rule, functools.partial(self._layer_rule, block))
        else:
            precondition = None
        return VariableUpdate.plan(
            options, precondition, factored, self.momentums[index],
            self.graft.second_moments[index] if self.graft else None,
            decays=self.decays(variable),
            cautious=(options.cautious is True or options.cautious == "sequence" and factored
                      and block.name in projections),
            assign=self.assign, assign_sub=self.assign_sub)

    def _layer_rule(self, block, gradient, correction):
        del correction  # MindSpore's rule keeps no second moment
        # An accumulated update's batch is its cycle's steps together.
        batch = tf.convert_to_tensor(self.link.connection.batch) * self.steps_per_update
        state = Preconditioning(batch=batch, root_damping=self.schedule.root_damping())
        return block.precondition(gradient, state, self.options.block_size)

    # --- the statistics

    def _captured(self):
        """This replica's statistics of this step, read in replica context."""
        return [(tf.convert_to_tensor(s.a), tf.convert_to_tensor(s.g),
                 tf.convert_to_tensor(s.rows)) for s in self.link.connection.statistics]

    def accumulate(self):
        """A step that only accumulates: its statistics join those of its cycle's update."""
        when(self.schedule.is_statistics_step(),
             lambda: self.estimator.accumulate(self._captured()))

    def statistics(self):
        """This replica's statistics of this update (summed over replicas by the
        estimator), with the earlier steps of an accumulation cycle."""
        local = self._captured()
        if self.steps_per_update > 1:
            local = self.estimator.with_pending(local)
        return local

    def refresh(self, distribution, local):
        """Hands the estimator this step's statistics, damping and scale of ``G``
        (cross-replica context)."""
        if not local:
            return
        # Sampled labels come with an unscaled loss; the training loss carries its scale.
        g_scale = (tf.constant(1.0) if self.options.fisher == "sampled"
                   else tf.math.reciprocal(tf.square(self.scale_on_loss())))
        root_damping = self.schedule.root_damping() if self.options.damps_factors else None
        self.estimator.update(distribution, local, root_damping, g_scale,
                              self.schedule.is_statistics_step())

    # --- the update

    def unscaled(self, gradient):
        """``gradient`` in float32, divided by the ``loss_scale`` option."""
        gradient = tf.cast(gradient, tf.float32)
        return gradient / self.options.loss_scale if self.options.loss_scale != 1.0 else gradient

    def direction(self, gradient, update, correction, preconditioned=None):
        """``(gradient, direction)``: the variable's direction before the modifiers,
        preconditioned (``preconditioned`` where its owner has computed it: the divided
        step), grafted to Adam's length with ``graft`` (``correction``: Adam's bias
        correction at this step)."""
        gradient = self.unscaled(gradient)
        if preconditioned is not None:
            direction = preconditioned
        else:
            direction = (gradient if update.precondition is None
                         else update.precondition(gradient, correction))
        if self.graft is None:
            return gradient, direction
        return gradient, self.graft.direction(update.graft_moment, gradient,
                                              direction if update.factored else None,
                                              correction)

    def _apply(self, direction, variable, update, learning_rate):
        direction = tf.cast(direction, variable.dtype)
        for modify in update.modifiers:
            direction = modify(direction, variable)
        update.momentum_step(direction, variable, update.velocity, learning_rate)

    def update(self, index, gradient, variable, learning_rate):
        """The update of the variable at ``index``, alone (no KL clip)."""
        update = self.updates[index]
        direction = self.direction(gradient, update,
                                   self.schedule.bias_correction(self.graft))[1]
        self._apply(direction, variable, update, learning_rate)

    def updates_together(self, distribution):
        """Whether every variable's update is planned together (:meth:`update_together`):
        with the KL clip, and where the step is divided among replicas."""
        return self.kl_clip is not None or self.divided.divides(distribution)

    def update_together(self, distribution, indexed, learning_rate):
        """Every variable's update (``indexed``: ``(index, gradient, variable)``) on every
        device: divided among the replicas or not (cross-replica context)."""
        if self.divided.divides(distribution):
            return self.divided(distribution, indexed, learning_rate)
        return on_each_device(distribution, self.kl_clip.variable, self.clipped_update,
                              (indexed, learning_rate))

    def clipped_update(self, kl_factor, indexed, learning_rate, preconditioned=None):
        """:meth:`_clipped_update` on one device (``kl_factor``: this device's component of
        the KL clip's variable; ``preconditioned``: ``{index: direction}`` of the kernels
        whose owners computed them), one XLA function with ``jit_compile``."""
        preconditioned = preconditioned or {}
        if self.compile_update is None or in_xla_context():
            return self._clipped_update(kl_factor, indexed, learning_rate, preconditioned)
        indices, variables = [i for i, _, _ in indexed], [v for _, _, v in indexed]
        given = sorted(preconditioned)
        compiled = self.compile_update(
            (id(kl_factor), *map(id, variables)),
            lambda gradients, learning_rate, directions: self._clipped_update(
                kl_factor, zip(indices, gradients, variables), learning_rate,
                dict(zip(given, directions))))
        return compiled([g for _, g, _ in indexed], tf.convert_to_tensor(learning_rate),
                        [preconditioned[index] for index in given])

    def _clipped_update(self, kl_factor, indexed, learning_rate, preconditioned):
        """Every variable's direction (``indexed``: ``(index, gradient, variable)``), the
        factored ones scaled by the KL clip's ``nu`` (assigned to ``kl_factor``), then every
        update."""
        planned, correction = [], self.schedule.bias_correction(self.graft)
        for index, gradient, variable in indexed:
            update = self.updates[index]
            planned.append((variable, update, *self.direction(
                gradient, update, correction, preconditioned.get(index))))
        products = [tf.reduce_sum(gradient * direction)
                    for _, update, gradient, direction in planned if update.factored]
        nu = (self.kl_clip(products, learning_rate, kl_factor)
              if products and self.kl_clip is not None else None)
        for variable, update, _, direction in planned:
            self._apply(direction * nu if nu is not None and update.factored else direction,
                        variable, update, learning_rate)
