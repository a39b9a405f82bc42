"""What THOR does with each trainable variable, and why.

:func:`survey` walks a model (into nested models and wrapper layers such as
``MultiHeadAttention``, ``TimeDistributed`` and ``Bidirectional``) and gives
each trainable variable a rule: a curvature block
(:mod:`tf_msopt.thor.curvature_blocks`) or first order, with the reason, as a
:class:`ReportRow` (:func:`block_rules` says how the configuration runs each block);
:class:`ThorReport` is the readable account, under a line of when THOR renews what
(:func:`describe_schedule`) and over a table of what its curvature costs a step
(:mod:`tf_msopt.thor.cost`).
"""
import dataclasses

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.curvature_blocks import blocks_for

__all__ = ["ReportRow", "ThorReport", "block_rules", "describe_schedule", "planned_rows",
           "survey"]


#: The rule of a variable THOR has no rule for.
FIRST_ORDER = "first order"


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """What THOR does with one trainable variable, and why."""

    layer: str
    layer_type: str
    variable: str
    rule: str
    reason: str

    @property
    def first_order(self):
        """Whether THOR has no rule for the variable."""
        return self.rule == FIRST_ORDER


def survey(model, rule_of):
    """Gives every trainable variable of ``model`` (built: its layers' shapes are known) a
    rule: ``rule_of(block)`` (:func:`block_rules`) for the variables a block treats.

    Returns:
        ``(blocks, layers, rows)``: the curvature block of each layer THOR treats,
        those layers (same order), and a :class:`ReportRow` for every trainable
        variable of the model.
    """
    blocks, layers, rows, surveyed = [], [], [], set()
    for layer in compat.flatten_layers(model):
        if id(layer) in surveyed:     # a recurrent layer's cell, surveyed with its layer
            continue
        found, reason, owner = blocks_for(layer)
        surveyed.add(id(owner))
        variables = compat.own_trainable_variables(owner)
        if not variables:
            continue
        layer_type = type(layer).__name__
        rules = {}
        for block in found:
            blocks.append(block)
            layers.append(layer)
            rules.update({id(v): rule_of(block) for v in block.treated_variables(layer)})
        for variable in variables:
            if id(variable) in rules:
                rows.append(ReportRow(layer.name, layer_type, variable.path,
                                      *rules[id(variable)]))
            else:
                why = reason or f"THOR preconditions the {layer_type} kernel only"
                rows.append(ReportRow(layer.name, layer_type, variable.path, FIRST_ORDER, why))
    return blocks, layers, rows


def describe_schedule(options):
    """When THOR measures its statistics and refreshes its preconditioner, in words."""
    refreshed = "eigenvectors" if options.preconditioner == "eigenbasis" else "inverses"
    kept = (", each basis kept while it still holds"
            if refreshed == "eigenvectors" and options.eigenbasis_tolerance is not None else "")
    if options.statistics_decay is None:
        return f"statistics and {refreshed} every {options.frequency} steps{kept}"
    every = options.statistics_frequency
    statistics = "every step" if every == 1 else f"every {every} steps"
    return (f"statistics {statistics} into moving averages (decay {options.statistics_decay:g}), "
            f"{refreshed} every {options.frequency} steps{kept}")


def block_rules(block_size, graft, preconditioned_sides):
    """``rule_of(block)``: the ``(rule, reason)`` of the variables ``block`` treats, as THOR
    runs them. A graft gives Adam's step to a block without factors (the LayerNorm rule),
    which then counts as first order; a factor the preconditioner leaves unused
    (``preconditioned_sides(block)``: whether the kernel's input and output sides are
    preconditioned) is named."""
    unused = {(True, True): None, (False, True): "A unused: preconditioned on the output side",
              (True, False): "G unused: preconditioned on the input side",
              (False, False): "A and G unused: preconditioned on neither side"}

    def rule_of(block):
        if not block.has_factors:
            if graft is not None:
                return FIRST_ORDER, (f"graft={graft!r} gives it Adam's step instead of the "
                                     f"{block.rule}")
            return block.describe(block_size), ""
        note = unused[tuple(preconditioned_sides(block))]
        return "; ".join(filter(None, [block.describe(block_size), note])), ""
    return rule_of


def planned_rows(blocks, rule_of):
    """The rows of an optimizer not connected to a model: the variables its blocks treat."""
    return [ReportRow(block.layer, block.kind, f"{block.layer}/{name}", *rule_of(block))
            for block in blocks for name in block.variables]


@dataclasses.dataclass(frozen=True)
class ThorReport:
    """Which variables THOR preconditions, which fall back to first order, and why.

    ``str(report)`` is a table; ``rows`` holds one
    :class:`ReportRow` per trainable variable of the
    model (``layer``, ``layer_type``, ``variable``, ``rule``, ``reason``).
    ``graft``: ``"adam"`` where first-order variables take Adam's step, None where they take
    their plain gradient. ``schedule`` says when the statistics and the preconditioner are
    renewed; ``inverse_backend`` names the inverse op in use, None where the preconditioner
    inverts nothing (the eigenbasis).
    ``costs``: a :class:`~tf_msopt.thor.cost.LayerCost` per factored layer of the connected
    model, the floating-point operations its curvature adds to a step.
    With ``trace_thresholds``, ``trace_decisions`` maps each factored layer to its
    counts of inversions ``(refreshed, reused, frozen)``. ``awaiting_build``: THOR was
    created for a model not built yet, and connects when ``fit`` builds it. ``steps``: once
    THOR is built, each variable's path mapped to the names of the pieces of its step, in
    the order they run (:attr:`~tf_msopt.thor.step_modifiers.VariableUpdate.parts`).
    ``state_bytes``: once built, the bytes of curvature state (the factors' averages,
    eigenvectors or inverses, rotated second moments) each replica holds;
    ``state_divided``: whether each layer's is on the replica that refreshes it alone.
    """

    rows: tuple
    frequency: int
    block_size: object
    inverse_backend: object
    connected: bool
    trace_decisions: dict = dataclasses.field(default_factory=dict)
    awaiting_build: bool = False
    schedule: str = ""
    graft: object = None
    costs: tuple = ()
    steps: dict = dataclasses.field(default_factory=dict)
    state_bytes: tuple = ()
    state_divided: bool = False

    @property
    def preconditioned(self):
        """Paths of the variables with a THOR rule (Kronecker factors or LayerNorm)."""
        return [row.variable for row in self.rows if not row.first_order]

    @property
    def first_order(self):
        """``{path: reason}`` for the variables updated with their plain gradient."""
        return {row.variable: row.reason for row in self.rows if row.first_order}

    def __str__(self):
        first_order = "plain gradient" if self.graft is None else "Adam's step"
        header = (f"THOR: {len(self.preconditioned)} variable(s) with a THOR rule, "
                  f"{len(self.first_order)} first order ({first_order}); {self.schedule}; "
                  f"blocks of {self.block_size or 'full size'}")
        if self.inverse_backend is not None:
            header += f"; inverse back-end: {self.inverse_backend}"
        if self.state_bytes:
            header += "\n" + _state_line(self.state_bytes, self.state_divided)
        if self.awaiting_build:
            header += ("\nNOT CONNECTED yet: the model is not built; fit, evaluate or "
                       "train_on_batch connect THOR when they build it")
        elif not self.connected:
            header += ("\nNOT CONNECTED to a model: training raises an error until "
                       "connect(model) is called")
        table = [("variable", "layer", "rule / reason")]
        for row in self.rows:
            rule = row.rule if not row.reason else f"{row.rule}: {row.reason}"
            table.append((row.variable, f"{row.layer} ({row.layer_type})", rule))
        lines = _aligned(table)
        if self.costs:
            lines += _cost_lines(self.costs, self.frequency)
        if self.steps:
            lines.append("step of each variable, in order:")
            lines += _aligned([(f"  {path}", " > ".join(parts))
                               for path, parts in self.steps.items()])
        if self.trace_decisions:
            lines.append("trace rule (inversions refreshed / reused / frozen):")
            lines += [f"  {layer}: {r} / {u} / {f}"
                      for layer, (r, u, f) in self.trace_decisions.items()]
        return "\n".join([header, *lines])


def _state_line(held, divided):
    """The line of :attr:`ThorReport.state_bytes`."""
    if divided:
        return (f"curvature state per replica: {', '.join(map(_mebibytes, held))} (each "
                f"layer's on the replica that refreshes it; {_mebibytes(sum(held))} in all)")
    where = f" on each of {len(held)} replicas" if len(held) > 1 else ""
    return f"curvature state: {_mebibytes(held[0])}{where}"


def _mebibytes(count):
    return f"{count / 2**20:.3g} MiB"


def _aligned(table, indent=""):
    """The rows of ``table`` (tuples of strings) as lines, every column but the last padded
    to its widest cell."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return [indent + "  ".join([*(f"{cell:<{width}}" for cell, width in zip(row, widths)),
                                row[-1]]).rstrip() for row in table]


def _operations(count):
    """``count`` floating-point operations in a few digits: ``834.9M``, ``1.56G``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.4g}{unit}"
    return f"{count:.4g}"


def _cost_lines(costs, frequency):
    """The table of :attr:`ThorReport.costs`, with a line for all layers together."""
    lines = [f"cost a step in floating-point operations (a multiply-add is 2): statistics from "
             f"the rows of the last statistics step, the refresh as if every factor were "
             f"recomputed, spread over the {frequency} updates between refreshes"]
    table = [("layer", "statistics (rows)", "preconditioning", "refresh", "break-even rows")]
    for cost in costs:
        statistics = ("not measured yet" if cost.statistics is None
                      else f"{_operations(cost.statistics)} ({cost.rows})")
        rows = "-" if cost.break_even_rows is None else f"{cost.break_even_rows:.0f}"
        table.append((cost.layer, statistics, _operations(cost.preconditioning),
                      _operations(cost.refresh), rows))
    measured = all(cost.statistics is not None for cost in costs)
    table.append(("all", _operations(sum(c.statistics for c in costs)) if measured else "-",
                  _operations(sum(c.preconditioning for c in costs)),
                  _operations(sum(c.refresh for c in costs)), ""))
    lines += _aligned(table, indent="  ")
    lines.append("break-even rows: the rows a step (examples times the positions where the "
                 "kernel is applied) at which the kernel's own forward and backward pass costs "
                 "what its preconditioning does")
    return lines
