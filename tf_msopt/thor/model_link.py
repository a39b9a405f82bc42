"""The link from THOR to the model whose layers it watches.

THOR's curvature comes from its model's layers: their inputs and output gradients, captured
by patches on the layers (:class:`~tf_msopt.thor.connection.ModelConnection`).
:class:`ModelLink` is the part of THOR that makes, holds and reports that connection.
"""
import contextlib
import warnings
import weakref

import keras

from tf_msopt import _keras_compat as compat
from tf_msopt._validation import type_name
from tf_msopt.thor.capture import connect_when_built, watch_compile
from tf_msopt.thor.connection import ModelConnection, matching_blocks
from tf_msopt.thor.cost import layer_costs
from tf_msopt.thor.report import (ThorReport, block_rules, describe_schedule, planned_rows,
                                  survey)
from tf_msopt.thor.sampled_fisher import output_distribution

__all__ = ["ModelLink", "check_model", "wrapped_optimizers"]

NOTHING_PRECONDITIONED = (
    "THOR has no rule for any trainable variable of '{model}' (it factors the kernels of "
    "Dense, EinsumDense, convolution, Embedding, SimpleRNN, GRU and LSTM layers), so every "
    "variable trains first order, with no curvature; optimizer.report() says why for each.")


def check_model(model):
    """Refuses anything but a Keras model (a layer, a tensor, arguments in the wrong order)."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"For 'THOR', the 'model' must be a keras.Model (the first argument: "
            f"tf_msopt.thor(model, ...)), but got type '{type_name(model)}'.")


def wrapped_optimizers(optimizer):
    """``optimizer`` and the optimizers it wraps (``inner_optimizer``), outermost first."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


class ModelLink:
    """Mixin of THOR: its connection to a model (``_connection``), the curvature blocks of
    the model's layers (``_blocks``) and the report. Reads the optimizer's ``options``,
    ``iterations``, ``built`` and ``_is_statistics_step``."""

    _connection = None
    _fisher_distribution = None
    _unbuilt_model = None       # a weak reference to a model to connect once it is built
    _model_building = False     # whether fit (evaluate, train_on_batch) is building it
    _in_use = True              # False once the model is compiled with another optimizer

    def connect(self, model):
        """Connects THOR to ``model``: patches its layers to capture statistics.

        :func:`tf_msopt.thor` calls it. Call it yourself after ``keras.models.load_model``
        (or use :func:`tf_msopt.thor.connect`), under the distribution strategy's scope if
        there is one. The model must have the layers THOR was created for (same names,
        kinds and shapes). A model not built yet (a ``Sequential`` without an ``Input``, a
        subclassed model) is connected when ``fit``, ``evaluate`` or ``train_on_batch``
        builds it, before they trace a step.

        Compiling the model with another optimizer stops the capture (the model's steps
        then cost what they cost without THOR), and with another THOR connects that one;
        compiling it with this one again resumes it. Returns this optimizer.
        """
        check_model(model)
        self._in_use = True
        watch_compile(model, self._compiled_with)
        if not model.built:
            self._unbuilt_model = weakref.ref(model)
            connect_when_built(model, self._building_model)
            return self
        self._unbuilt_model = None
        options = self.options
        blocks, layers, rows = survey(model, self._block_rules())
        self._blocks = matching_blocks(self._blocks, blocks, self.built)
        self._connection = ModelConnection(
            model, blocks, layers, rows, block_size=options.block_size,
            weight_sharing=options.experimental.weight_sharing,
            statistics_rows=options.statistics_rows,
            statistics_shapes=self.preconditioner.statistics_shapes,
            batch_size=options.batch_size,
            is_statistics_step=self._is_statistics_step, in_use=lambda: self._in_use,
            strategy=compat.distribution_strategy(self),
            sampled_seed=options.seed if options.fisher == "sampled" else None,
            step=compat.own_iterations(self), fisher_distribution=self._fisher_distribution,
            steps_per_update=self.gradient_accumulation_steps or 1)
        if all(row.first_order for row in rows):
            warnings.warn(NOTHING_PRECONDITIONED.format(model=model.name), stacklevel=3)
        return self

    def _compiled_with(self, model, optimizer):
        """The model, connected to this THOR, was compiled with ``optimizer``; a THOR other
        than this one in it is connected to the model in this one's place."""
        found = [o for o in wrapped_optimizers(optimizer) if isinstance(o, ModelLink)]
        self._in_use = any(o is self for o in found)
        if found and not self._in_use:
            found[0].connect(model)

    @contextlib.contextmanager
    def _building_model(self):
        self._model_building = True
        try:
            yield
        finally:
            self._model_building = False

    def _connect_built_model(self):
        """Connects the model THOR was created for before it was built, where ``fit`` (or
        ``evaluate``, ``train_on_batch``) has just built it; ``build`` calls it. Elsewhere
        (a custom training loop) the layers' first calls were not captured: a
        ``ValueError`` says to connect the model once built."""
        model = self._unbuilt_model() if self._unbuilt_model is not None else None
        if model is None:
            return
        if not (self._model_building and model.built):
            raise ValueError(
                f"For 'THOR', it was created for the model '{model.name}' before the model "
                f"was built, and fit, evaluate or train_on_batch, which connect THOR when "
                f"they build the model, did not build it. In a custom training loop, build "
                f"the model first (call it once on a batch), then call "
                f"optimizer.connect(model).")
        self.connect(model)

    def connected_model(self):
        """The connected model; a ``RuntimeError`` when there is none."""
        if self._connection is None:
            self._connect_built_model()
        if self._connection is None:
            raise RuntimeError(
                "This THOR optimizer is not connected to a model, so it has no curvature "
                "statistics and would silently train as a first-order optimizer. Create it "
                "with tf_msopt.thor(model, ...), or after keras.models.load_model call "
                "tf_msopt.thor.connect(model).")
        return self._connection.model()

    def set_fisher_loss(self, loss):
        """The loss whose output distribution ``fisher="sampled"`` draws labels from, for a
        custom training loop (``fit`` reads it off the compiled loss): a Keras cross-entropy
        loss, e.g. ``keras.losses.SparseCategoricalCrossentropy(from_logits=True)`` or
        ``"binary_crossentropy"``. Returns this optimizer."""
        self._fisher_distribution = output_distribution(loss)
        if self._connection is not None:
            self._connection.fisher_distribution = self._fisher_distribution
        return self

    def report(self):
        """A :class:`tf_msopt.thor.ThorReport`: every trainable variable's rule and why."""
        from tf_msopt.ops.inverse import inverse_backend

        options = self.options
        rows = (self._connection.rows if self._connection is not None
                else planned_rows(self._blocks or (), self._block_rules()))
        decisions = self._estimator.trace_decisions() if self.built else {}
        backend = inverse_backend() if options.preconditioner == "inverse" else None
        return ThorReport(tuple(rows), options.frequency, options.block_size, backend,
                          self._connection is not None, decisions,
                          awaiting_build=self._unbuilt_model is not None,
                          schedule=describe_schedule(options), graft=options.graft,
                          costs=tuple(self.step_costs()))

    def step_costs(self):
        """The floating-point operations THOR's curvature adds to a step, a
        :class:`~tf_msopt.thor.cost.LayerCost` per layer with factors (none before THOR is
        connected); the statistics are counted from the rows of the last statistics step."""
        if self._connection is None:
            return []
        rows = [float(statistics.rows.numpy()) for statistics in self._connection.statistics]
        return layer_costs(self._blocks, rows, self.options, self.preconditioner,
                           self.gradient_accumulation_steps or 1)

    def _block_rules(self):
        return block_rules(self.options.block_size, self.options.graft,
                           self.preconditioner.preconditioned_sides)

    def savedmodel_only_children(self):
        # A training step traced in a SavedModel captures the capture buffers, so the
        # SavedModel must hold them; they are rewritten on every THOR step, so no
        # checkpoint does.
        if self._connection is None:
            return {}
        return {f"capture_buffer_{i}": buffer
                for i, buffer in enumerate(self._connection.buffers())}
