"""THOR's experimental options: ideas from the K-FAC literature and the THOR paper that no
default and no documented recommendation uses.

They are passed as one object, ``THOR(..., experimental=Experimental(trace_thresholds=(0.01,
0)))``; :func:`tf_msopt.thor` also takes them by name. What each did on the benchmark tasks
is in docs/thor_measurements.md.
"""
import dataclasses

from tf_msopt._validation import check_bool, check_choice, check_int

__all__ = ["Experimental", "split_experimental"]

_OWNER = "THOR"
_WEIGHT_SHARINGS = ("mean", "expand")


@dataclasses.dataclass(frozen=True)
class Experimental:
    """THOR's experimental options (none set: no change to the step).

    Attributes:
        trace_thresholds: None or ``(omega1, omega2)``, the THOR paper's per-layer rule: on
            each refresh ``Delta = |T - T_prev| / T_prev`` (``T`` the trace of the layer's
            damped Kronecker curvature) decides: above ``omega1`` (or the first time) new
            inverses, above ``omega2`` keep the previous ones, else keep them from then on
            (frozen). The decisions are counted per layer and shown by ``report()``.
        statistics_frequency: None or steps between statistics captures into the moving
            averages (needs ``statistics_decay``; must divide ``frequency``). None: every
            step with a decay, else every ``frequency`` steps.
        weight_sharing: ``"mean"`` (MindSpore: ``G`` is the mean over all rows, as ``A``) or
            ``"expand"``: ``G`` summed over the positions where a kernel is reused within an
            example (KFC, K-FAC-expand), so that ``A (x) G`` has the Fisher's scale.
        precondition_inputs: True (``A_inv g G_inv``) or False: kernels are preconditioned
            on their output side only (``g G_inv``; no eigenbasis of ``A``).
        pi_damping: with ``damping_mode="sqrt"``, factored Tikhonov damping: ``A +
            pi sqrt(lambda) I`` and ``G + sqrt(lambda)/pi I`` with ``pi = sqrt((tr A/dim A) /
            (tr G/dim G))`` (1 when a trace is 0).
    """

    trace_thresholds: object = None
    statistics_frequency: object = None
    weight_sharing: str = "mean"
    precondition_inputs: bool = True
    pi_damping: bool = False

    def __post_init__(self):
        object.__setattr__(self, "trace_thresholds", _check_trace_thresholds(
            self.trace_thresholds))
        if self.statistics_frequency is not None:
            object.__setattr__(self, "statistics_frequency", check_int(
                self.statistics_frequency, "statistics_frequency", _OWNER, min_value=1))
        check_choice(self.weight_sharing, "weight_sharing", _OWNER, _WEIGHT_SHARINGS)
        for name in ("precondition_inputs", "pi_damping"):
            object.__setattr__(self, name, check_bool(getattr(self, name), name, _OWNER))

    @classmethod
    def of(cls, value):
        """``value`` (None, an :class:`Experimental` or its config dict) as an
        :class:`Experimental`."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"For '{_OWNER}', the 'experimental' must be None, a dict or a "
                            f"tf_msopt.thor.Experimental, but got {value!r}.")
        return cls(**value)

    def get_config(self):
        """The options that differ from their defaults (None when none does)."""
        config = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                  if getattr(self, field.name) != field.default}
        if "trace_thresholds" in config:
            config["trace_thresholds"] = list(self.trace_thresholds)
        return config or None


def split_experimental(kwargs):
    """``(kwargs, experimental)``: THOR's keyword arguments with the experimental options
    given by name (and ``damping_mode="pi"``) taken out into one :class:`Experimental`
    merged with ``kwargs["experimental"]``, as configs written before the namespace hold
    them and as :func:`tf_msopt.thor` takes them."""
    kwargs = dict(kwargs)
    named = {field.name: kwargs.pop(field.name) for field in dataclasses.fields(Experimental)
             if field.name in kwargs}
    if kwargs.get("damping_mode") == "pi":
        kwargs["damping_mode"], named["pi_damping"] = "sqrt", True
    experimental = kwargs.pop("experimental", None)
    if named:
        experimental = dataclasses.replace(Experimental.of(experimental), **named)
    return kwargs, experimental


def _check_trace_thresholds(thresholds):
    if thresholds is None:
        return None
    if (not isinstance(thresholds, (list, tuple)) or len(thresholds) != 2
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                       for t in thresholds)):
        raise TypeError(f"For '{_OWNER}', the 'trace_thresholds' must be None or a pair of "
                        f"floats (omega1, omega2), but got {thresholds!r}.")
    omega1, omega2 = map(float, thresholds)
    if not 0.0 <= omega2 <= omega1:
        raise ValueError(f"For '{_OWNER}', the 'trace_thresholds' (omega1, omega2) must satisfy "
                         f"0 <= omega2 <= omega1, but got {thresholds!r}.")
    return omega1, omega2
