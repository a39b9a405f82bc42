"""What THOR's curvature adds to a training step, in floating-point operations.

Per layer with Kronecker factors, a multiply-add counted as two operations, for a factor of
dimension ``n`` kept in ``count`` blocks of ``b``, ``m`` the other factor's dimension:

- statistics: ``2 r n b`` from ``r`` rows (examples times the positions where the kernel is
  applied), on every step that measures them;
- preconditioning: ``2 p n b m`` per preconditioned side, ``p`` the products the
  preconditioner makes with each factor a step (the eigenbasis: into it and back, 2;
  MindSpore's inverses: 1), whatever the batch;
- refresh: the preconditioner's cost per block (``c b^3``) for every block of each
  preconditioned factor, as if every factor were recomputed, on every refresh.

Each part is spread over the training steps between two of its computations (with gradient
accumulation, an update's preconditioning and refresh over its cycle's steps). The kernel's own
forward and backward pass costs ``6 r k`` for a kernel of ``k`` entries applied to ``r``
rows, so the preconditioning costs as much as that pass at ``2 p n b m / (6 k)`` rows a step
(:attr:`LayerCost.break_even_rows`): the wider a kernel's factors and the fewer its rows,
the more THOR adds to its step.
"""
import dataclasses

__all__ = ["LayerCost", "layer_costs"]


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Floating-point operations per step that THOR adds for one layer's kernel.

    ``layer`` and ``kind`` name it; ``rows``: the statistics rows of its last statistics
    step (None before any, and then ``statistics`` is None too); ``statistics``,
    ``preconditioning`` and ``refresh``: each part's operations per step;
    ``break_even_rows``: the rows a step at which the kernel's forward and backward pass
    costs what its preconditioning does (None for a table the layer gathers from, an
    Embedding's).
    """

    layer: str
    kind: str
    rows: object
    statistics: object
    preconditioning: float
    refresh: float
    break_even_rows: object


def layer_costs(blocks, rows, options, preconditioner, steps_per_update=1):
    """The :class:`LayerCost` of each block with factors.

    Args:
        blocks: the curvature blocks, in order; those without factors are skipped.
        rows: per block with factors, the rows of its last statistics step (0 or None:
            not yet measured).
        options: the :class:`~tf_msopt.thor.options.ThorOptions` (block size, how often
            the statistics and the refresh run).
        preconditioner: the preconditioner in use (its ``statistics_shapes``,
            ``preconditioned_sides``, ``step_products`` and ``refresh_flops``).
        steps_per_update: the training steps of one update (gradient accumulation's cycle):
            every step measures statistics, the update preconditions and refreshes once.
    """
    statistics_every = (options.frequency if options.statistics_decay is None
                        else options.statistics_frequency)
    costs = []
    for block, measured in zip((block for block in blocks if block.has_factors), rows):
        layouts = block.a_layout(options.block_size), block.g_layout(options.block_size)
        others = block.g_dim, block.a_dim
        statistics = preconditioning = refresh = 0.0
        for layout, other, shape, preconditioned in zip(
                layouts, others, preconditioner.statistics_shapes(block),
                preconditioner.preconditioned_sides(block)):
            if len(shape) != 3:     # a diagonal factor, or one left unestimated: ~nothing
                continue
            statistics += 2.0 * (measured or 0) * layout.dim * layout.size / statistics_every
            if preconditioned:
                preconditioning += (2.0 * preconditioner.step_products * layout.dim
                                    * layout.size * other / steps_per_update)
                refresh += (layout.count * preconditioner.refresh_flops(layout.size)
                            / (options.frequency * steps_per_update))
        gathered = len(block.factor_shapes(options.block_size)[0]) != 3
        costs.append(LayerCost(
            block.name, block.kind, int(measured) if measured else None,
            statistics if measured else None, preconditioning, refresh,
            None if gathered else preconditioning / (6.0 * block.kernel_elements)))
    return costs
