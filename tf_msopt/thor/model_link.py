"""The link from THOR to the model whose layers it watches.

THOR's curvature comes from its model's layers: their inputs and output gradients, captured
by patches on the layers (:class:`~tf_msopt.thor.connection.ModelConnection`).
:class:`ModelLink` is the part of THOR that makes, holds and reports that connection.
"""
from tf_msopt import _keras_compat as compat
from tf_msopt.thor.connection import ModelConnection, matching_blocks
from tf_msopt.thor.report import ThorReport, planned_rows, survey
from tf_msopt.thor.sampled_fisher import output_distribution

__all__ = ["ModelLink"]


class ModelLink:
    """Mixin of THOR: its connection to a model (``_connection``), the curvature blocks of
    the model's layers (``_blocks``) and the report. Reads the optimizer's ``options``,
    ``iterations``, ``built`` and ``_is_statistics_step``."""

    _connection = None
    _fisher_distribution = None

    def connect(self, model):
        """Connects THOR to ``model``: patches its layers to capture statistics.

        :func:`tf_msopt.thor` calls it. Call it yourself after ``keras.models.load_model``
        (or use :func:`tf_msopt.thor.connect`), under the distribution strategy's scope if
        there is one. The model must have the layers THOR was created for (same names,
        kinds and shapes). Returns this optimizer.
        """
        options = self.options
        blocks, layers, rows = survey(model, options.block_size)
        self._blocks = matching_blocks(self._blocks, blocks, self.built)
        self._connection = ModelConnection(
            model, blocks, layers, rows, block_size=options.block_size,
            weight_sharing=options.experimental.weight_sharing,
            statistics_rows=options.statistics_rows,
            statistics_shapes=self.preconditioner.statistics_shapes,
            batch_size=options.batch_size,
            is_statistics_step=self._is_statistics_step,
            strategy=compat.distribution_strategy(self),
            sampled_seed=options.seed if options.fisher == "sampled" else None,
            step=self.iterations, fisher_distribution=self._fisher_distribution)
        return self

    def connected_model(self):
        """The connected model; a ``RuntimeError`` when there is none."""
        if self._connection is None:
            raise RuntimeError(
                "This THOR optimizer is not connected to a model, so it has no curvature "
                "statistics and would silently act as momentum SGD. Create it with "
                "tf_msopt.thor(model, ...), or after keras.models.load_model call "
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
