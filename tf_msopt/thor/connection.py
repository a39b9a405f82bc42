"""THOR's connection to a model: the patched layers, their statistics buffers, the sampled
Fisher's model-level capture and the report rows, as one object.

It is built from values (the surveyed layers, how statistics are measured, the step
predicate, the sampled Fisher's seed and step counter), so the optimizer hands it
what it needs and reads the statistics back from :attr:`ModelConnection.statistics`.
"""
import weakref

import keras

from tf_msopt.thor.capture import LayerStatistics, install, install_model
from tf_msopt.thor.sampled_fisher import SampledFisher, output_distribution

__all__ = ["ModelConnection", "matching_blocks"]


def matching_blocks(expected, found, built):
    """The curvature blocks of a connection: ``found`` (surveyed on the model) where the
    optimizer has none yet (``expected`` None), else ``expected``, which they must equal."""
    if expected is None:
        if built:
            raise ValueError("For 'THOR', the optimizer was built without layer specs; "
                             "create it with tf_msopt.thor(model, ...) instead.")
        return tuple(found)
    if list(found) != list(expected):
        raise ValueError(
            f"For 'THOR', the model's layers do not match the layers this optimizer was "
            f"created for.\n  optimizer: {[b.get_config() for b in expected]}\n"
            f"  model:     {[b.get_config() for b in found]}"
        )
    return expected


class ModelConnection:
    """Patches ``model``'s treated ``layers`` to capture their curvature statistics.

    Args:
        model: the model (held weakly); its ``train_function`` is reset so that the next
            step is traced with the capture.
        blocks, layers, rows: what :func:`tf_msopt.thor.report.survey` found.
        block_size, weight_sharing, statistics_rows: how the statistics are measured.
        steps_per_update: the steps whose statistics one update sums (gradient
            accumulation's), among which ``statistics_rows`` are shared.
        statistics_shapes: ``block -> (a_shape, g_shape)``, the statistics the optimizer
            reads (its preconditioner's).
        batch_size: the global batch size until one is observed.
        is_statistics_step: returns whether this step records statistics.
        in_use: returns whether the model trains with this THOR (nothing is recorded
            while it does not).
        strategy: the distribution strategy the buffers are created under.
        sampled_seed: the seed of the sampled Fisher's labels; None for the empirical
            Fisher.
        step: the step counter the sampled labels follow.
        fisher_distribution: the :class:`~tf_msopt.thor.sampled_fisher.OutputDistribution`
            the sampled Fisher draws from; None reads it off the model's compiled loss.
    """

    def __init__(self, model, blocks, layers, rows, *, block_size, weight_sharing, batch_size,
                 is_statistics_step, in_use, statistics_rows=None, statistics_shapes=None, strategy,
                 sampled_seed=None, step=None, fisher_distribution=None, steps_per_update=1):
        self.model = weakref.ref(model)
        self.layers, self.rows = layers, rows
        self.fisher_distribution = fisher_distribution
        with strategy.scope():
            self.statistics = [LayerStatistics(
                block, block_size, weight_sharing, statistics_rows,
                statistics_shapes(block) if statistics_shapes else None, steps_per_update)
                               for block in blocks if block.has_factors]
            self.batch = keras.Variable(float(batch_size), dtype="float32", trainable=False,
                                        autocast=False, name="global_batch")
        sampled = (None if sampled_seed is None else SampledFisher(
            sampled_seed, step, self.output_distribution, is_statistics_step))
        by_layer = {}     # a layer's blocks (several for a recurrent layer) are consecutive
        for block, layer in zip(blocks, layers):
            by_layer.setdefault(id(layer), (layer, []))[1].append(block)
        buffers = iter(self.statistics)
        for layer, layer_blocks in by_layer.values():
            statistics = [next(buffers) for block in layer_blocks if block.has_factors]
            install(layer, model, layer_blocks, statistics or None, self.batch,
                    is_statistics_step, in_use, sampled)
        install_model(model, sampled, in_use)
        if getattr(model, "train_function", None) is not None:
            model.train_function = None    # traced without the capture: trace again

    def buffers(self):
        """Every capture buffer: the global batch, then each layer's A, G and row count."""
        return [self.batch] + [buffer for layer in self.statistics
                               for buffer in (layer.a, layer.g, layer.rows)]

    def variable_blocks(self, blocks, count, index_of):
        """Per index of the ``count`` trainable variables: the curvature block of the treated
        layer it belongs to, or None. ``index_of(variable)`` gives a variable's index, or
        None."""
        found = [None] * count
        for block, layer in zip(blocks, self.layers):
            for variable in block.treated_variables(layer):
                index = index_of(variable)
                if index is not None:
                    found[index] = block
        return found

    def position_projections(self, blocks):
        """The names of the layers that apply their kernel at each position of a sequence
        (:meth:`~tf_msopt.thor.curvature_base.CurvatureBlock.projects_positions`)."""
        return {block.name for block, layer in zip(blocks, self.layers)
                if block.projects_positions(layer)}

    def output_distribution(self):
        """The output distribution of the sampled Fisher: ``fisher_distribution``, or the
        one the model's compiled loss implies."""
        if self.fisher_distribution is not None:
            return self.fisher_distribution
        loss = getattr(self.model(), "loss", None)
        if loss is None:
            raise ValueError(
                "For 'THOR', fisher='sampled' needs the model's loss to know its output "
                "distribution: compile the model with it, or call "
                "optimizer.set_fisher_loss(loss) before a custom training loop.")
        return output_distribution(loss)
