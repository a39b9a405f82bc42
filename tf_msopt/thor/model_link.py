"""The link from THOR to the model whose layers it watches.

THOR's curvature comes from its model's layers: their inputs and output gradients, captured
by patches on the layers (:class:`~tf_msopt.thor.connection.ModelConnection`).
:class:`ModelLink` is the object THOR holds that makes, keeps and reports that connection.
"""
import contextlib
import warnings
import weakref

import keras

from tf_msopt._validation import type_name
from tf_msopt.thor.capture import connect_when_built
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
    """THOR's link to its model: the connection that captures the layers' statistics
    (:attr:`connection`), the curvature blocks of the model's layers (:attr:`blocks`) and the
    report. THOR passes in what it reads: its options, its preconditioner and, when it
    connects, its schedule and strategy.

    Args:
        options: THOR's :class:`~tf_msopt.thor.options.ThorOptions`.
        preconditioner: THOR's preconditioner (the statistics shapes it needs, the report).
        blocks: the blocks THOR was created with (its config's), or None.
    """

    def __init__(self, options, preconditioner, blocks):
        self.options, self.preconditioner, self.blocks = options, preconditioner, blocks
        #: The :class:`~tf_msopt.thor.connection.ModelConnection`, None until connected.
        self.connection = None
        self.fisher_distribution = None
        self.unbuilt_model = None     # a weak reference to a model to connect once it is built
        self.model_building = False   # whether fit (evaluate, train_on_batch) is building it
        #: False once the model is compiled with another optimizer.
        self.in_use = True

    def connect(self, model, *, built, is_statistics_step, strategy, step, steps_per_update):
        """Patches the layers of ``model`` (built) to capture their statistics (see
        :meth:`tf_msopt.THOR.connect`); ``built``: whether THOR's state exists, which then
        fixes the blocks."""
        self.unbuilt_model = None
        options = self.options
        blocks, layers, rows = survey(model, self._block_rules())
        self.blocks = matching_blocks(self.blocks, blocks, built)
        self.connection = ModelConnection(
            model, blocks, layers, rows, block_size=options.block_size,
            weight_sharing=options.experimental.weight_sharing,
            statistics_rows=options.statistics_rows,
            statistics_shapes=self.preconditioner.statistics_shapes,
            batch_size=options.batch_size,
            is_statistics_step=is_statistics_step, in_use=lambda: self.in_use,
            strategy=strategy, sampled_seed=options.seed if options.fisher == "sampled" else None,
            step=step, fisher_distribution=self.fisher_distribution,
            steps_per_update=steps_per_update)
        if all(row.first_order for row in rows):
            warnings.warn(NOTHING_PRECONDITIONED.format(model=model.name), stacklevel=4)

    def compiled_with(self, model, optimizer, owner):
        """The model, connected to THOR (``owner``), was compiled with ``optimizer``; a THOR
        other than ``owner`` in it is connected to the model in its place."""
        found = [o for o in wrapped_optimizers(optimizer) if isinstance(o, type(owner))]
        self.in_use = any(o is owner for o in found)
        if found and not self.in_use:
            found[0].connect(model)

    def connect_when_built(self, model):
        """Remembers ``model``, not built yet, to connect when ``fit`` (``evaluate``,
        ``train_on_batch``) builds it."""
        self.unbuilt_model = weakref.ref(model)
        connect_when_built(model, self._building_model)

    @contextlib.contextmanager
    def _building_model(self):
        self.model_building = True
        try:
            yield
        finally:
            self.model_building = False

    def model_to_connect(self):
        """The model THOR was created for before it was built, where ``fit`` (or
        ``evaluate``, ``train_on_batch``) has just built it; None where there is none.
        Elsewhere (a custom training loop) the layers' first calls were not captured: a
        ``ValueError`` says to connect the model once built."""
        model = self.unbuilt_model() if self.unbuilt_model is not None else None
        if model is None:
            return None
        if not (self.model_building and model.built):
            raise ValueError(
                f"For 'THOR', it was created for the model '{model.name}' before the model "
                f"was built, and fit, evaluate or train_on_batch, which connect THOR when "
                f"they build the model, did not build it. In a custom training loop, build "
                f"the model first (call it once on a batch), then call "
                f"optimizer.connect(model).")
        return model

    def connected_model(self):
        """The connected model; a ``RuntimeError`` when there is none."""
        if self.connection is None:
            raise RuntimeError(
                "This THOR optimizer is not connected to a model, so it has no curvature "
                "statistics and would silently train as a first-order optimizer. Create it "
                "with tf_msopt.thor(model, ...), or after keras.models.load_model call "
                "tf_msopt.thor.connect(model).")
        return self.connection.model()

    def set_fisher_loss(self, loss):
        """The loss whose output distribution ``fisher="sampled"`` draws labels from."""
        self.fisher_distribution = output_distribution(loss)
        if self.connection is not None:
            self.connection.fisher_distribution = self.fisher_distribution

    def report(self, decisions, steps, steps_per_update, state_bytes=(), state_divided=False):
        """A :class:`tf_msopt.thor.ThorReport`; ``decisions``: the trace rule's, ``steps``:
        the names of each variable's step pieces by path, ``state_bytes`` and
        ``state_divided``: the curvature state each replica holds, and whether divided."""
        from tf_msopt.ops.inverse import inverse_backend

        options = self.options
        rows = (self.connection.rows if self.connection is not None
                else planned_rows(self.blocks or (), self._block_rules()))
        backend = inverse_backend() if options.preconditioner == "inverse" else None
        return ThorReport(tuple(rows), options.frequency, options.block_size, backend,
                          self.connection is not None, decisions,
                          awaiting_build=self.unbuilt_model is not None,
                          schedule=describe_schedule(options), graft=options.graft,
                          costs=tuple(self.step_costs(steps_per_update)), steps=steps,
                          state_bytes=tuple(state_bytes), state_divided=state_divided)

    def step_costs(self, steps_per_update):
        """The floating-point operations THOR's curvature adds to a step, a
        :class:`~tf_msopt.thor.cost.LayerCost` per layer with factors (none before THOR is
        connected); the statistics are counted from the rows of the last statistics step."""
        if self.connection is None:
            return []
        rows = [float(statistics.rows.numpy()) for statistics in self.connection.statistics]
        return layer_costs(self.blocks, rows, self.options, self.preconditioner,
                           steps_per_update)

    def _block_rules(self):
        return block_rules(self.options.block_size, self.options.graft,
                           self.preconditioner.preconditioned_sides)

    def savedmodel_only_children(self):
        """The capture buffers, which a training step traced in a SavedModel captures, so
        the SavedModel must hold them; they are rewritten on every THOR step, so no
        checkpoint does."""
        if self.connection is None:
            return {}
        return {f"capture_buffer_{i}": buffer
                for i, buffer in enumerate(self.connection.buffers())}
