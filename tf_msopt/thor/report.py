"""The readable account of what THOR does with each trainable variable."""
import dataclasses

__all__ = ["ThorReport"]


@dataclasses.dataclass(frozen=True)
class ThorReport:
    """Which variables THOR preconditions, which fall back to first order, and why.

    ``str(report)`` is a table; ``rows`` holds one
    :class:`tf_msopt.thor.capture.ReportRow` per trainable variable of the
    model (``layer``, ``layer_type``, ``variable``, ``rule``, ``reason``).
    With ``trace_thresholds``, ``trace_decisions`` maps each factored layer to its
    counts of inversions ``(refreshed, reused, frozen)``.
    """

    rows: tuple
    frequency: int
    block_size: object
    inverse_backend: str
    connected: bool
    trace_decisions: dict = dataclasses.field(default_factory=dict)

    @property
    def preconditioned(self):
        """Paths of the variables with a THOR rule (Kronecker factors or LayerNorm)."""
        return [row.variable for row in self.rows if row.rule != "first order"]

    @property
    def first_order(self):
        """``{path: reason}`` for the variables updated with their plain gradient."""
        return {row.variable: row.reason for row in self.rows if row.rule == "first order"}

    def __str__(self):
        header = (f"THOR: {len(self.preconditioned)} variable(s) with a THOR rule, "
                  f"{len(self.first_order)} first order; statistics and inverses every "
                  f"{self.frequency} steps; blocks of {self.block_size or 'full size'}; "
                  f"inverse back-end: {self.inverse_backend}")
        if not self.connected:
            header += ("\nNOT CONNECTED to a model: training raises an error until "
                       "connect(model) is called")
        table = [("variable", "layer", "rule / reason")]
        for row in self.rows:
            rule = row.rule if not row.reason else f"{row.rule}: {row.reason}"
            table.append((row.variable, f"{row.layer} ({row.layer_type})", rule))
        widths = [max(len(line[i]) for line in table) for i in range(2)]
        lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in table]
        if self.trace_decisions:
            lines.append("trace rule (inversions refreshed / reused / frozen):")
            lines += [f"  {layer}: {r} / {u} / {f}"
                      for layer, (r, u, f) in self.trace_decisions.items()]
        return "\n".join([header, *lines])
