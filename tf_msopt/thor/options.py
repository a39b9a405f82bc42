"""THOR's options: checked once when the optimizer is created, written once to its config."""
import dataclasses
import random

from tf_msopt._validation import (check_bool, check_choice, check_float, check_int,
                                  check_number_range, type_name)
from tf_msopt.optimizers.base import check_filter, resolve_learning_rate, serialize_filter
from tf_msopt.schedules import serialize_step_value
from tf_msopt.thor.curvature_blocks import REGISTRY
from tf_msopt.thor.experimental import Experimental
from tf_msopt.thor.preconditioners import PRECONDITIONERS

__all__ = ["ThorOptions"]

_OWNER = "THOR"
_DAMPING_MODES = ("sqrt", "relative")
_GRAFTS = (None, "adam")
_FISHERS = ("empirical", "sampled")
_CAUTIOUS = (False, True, "sequence")


def _non_negative(value, arg, allow_int=True):
    return check_number_range(check_float(value, arg, _OWNER, allow_int=allow_int), arg, _OWNER,
                              low=0.0)


def _positive(value, arg):
    return check_number_range(check_float(value, arg, _OWNER), arg, _OWNER, low=0.0,
                              low_inclusive=False)


def _check_cautious(cautious):
    if not isinstance(cautious, (bool, str)):
        raise TypeError(f"For '{_OWNER}', the 'cautious' must be a bool or 'sequence', but got "
                        f"type '{type_name(cautious)}'.")
    return check_choice(cautious, "cautious", _OWNER, _CAUTIOUS)


def _check_split_indices(split_indices):
    if split_indices is None:
        return None
    if not isinstance(split_indices, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in split_indices):
        raise TypeError(
            f"For '{_OWNER}', the 'split_indices' must be None or a list of int, "
            f"but got {split_indices!r}."
        )
    if any(i < 0 for i in split_indices) or list(split_indices) != sorted(set(split_indices)):
        raise ValueError(
            f"For '{_OWNER}', the 'split_indices' must be increasing indices >= 0 of the "
            f"preconditioned layers, but got {list(split_indices)}."
        )
    return list(split_indices)


def _check_statistics_frequency(statistics_frequency, decay, frequency):
    """The experimental ``statistics_frequency`` needs a decay and must divide ``frequency``."""
    if statistics_frequency is None:
        return
    if decay is None and statistics_frequency != frequency:
        raise ValueError(
            f"For '{_OWNER}', 'statistics_frequency' needs 'statistics_decay' (without a moving "
            f"average, statistics are only used every 'frequency' steps), but got "
            f"statistics_frequency={statistics_frequency} and statistics_decay=None.")
    if frequency % statistics_frequency:
        raise ValueError(
            f"For '{_OWNER}', the 'statistics_frequency' must divide 'frequency' "
            f"({frequency}), but got {statistics_frequency}.")


def _check_exponent(exponent):
    """None, a number in (0, 1], or a dict of layer kinds to such numbers."""
    arg = "eigenbasis_exponent"
    if exponent is None:
        return None

    def check(value, name):
        return check_number_range(check_float(value, name, _OWNER), name, _OWNER, low=0.0,
                                  high=1.0, low_inclusive=False)

    if not isinstance(exponent, dict):
        return check(exponent, arg)
    kinds = sorted(kind for kind, block in REGISTRY.items() if block.has_factors)
    for kind in exponent:
        if not isinstance(kind, str):
            raise TypeError(f"For '{_OWNER}', the keys of '{arg}' must be layer kinds (str, "
                            f"e.g. 'conv'), but got {kind!r}.")
        if kind not in kinds:
            raise ValueError(f"For '{_OWNER}', the keys of '{arg}' must be layer kinds with "
                             f"Kronecker factors, one of {kinds}, but got {kind!r}.")
    return {kind: check(value, f"{arg}[{kind!r}]") for kind, value in exponent.items()}


def _check_seed(seed, fisher):
    if seed is None and fisher == "sampled":
        seed = random.SystemRandom().randrange(2**31)   # leaves Python's global state alone
    if seed is not None:
        seed = check_int(seed, "seed", _OWNER, min_value=0, max_value=2**64 - 1)
    return seed


@dataclasses.dataclass(frozen=True)
class ThorOptions:
    """THOR's arguments other than the learning rate (see :class:`tf_msopt.THOR`, whose
    signature holds their defaults), checked and normalised on creation: a bad argument raises MindSpore's error type naming it.
    ``damping`` takes the forms of a learning rate and becomes a float or a schedule (or
    stays None where no step reads it)."""

    damping: object
    momentum: float
    loss_scale: float
    batch_size: int
    use_nesterov: bool
    decay_filter: object
    split_indices: object
    enable_clip_grad: bool
    frequency: int
    block_size: object
    damping_mode: str
    statistics_decay: object
    fisher: str
    kl_clip: object
    seed: object
    graft: object
    preconditioner: str
    eigenbasis_exponent: object
    eigenbasis_tolerance: object
    max_rotated_dim: object
    statistics_rows: object
    cautious: object
    experimental: Experimental
    weight_decay: float

    def __post_init__(self):
        def normalise(name, value):
            object.__setattr__(self, name, value)

        normalise("loss_scale", _positive(self.loss_scale, "loss_scale"))
        normalise("weight_decay", _non_negative(self.weight_decay, "weight_decay"))
        normalise("momentum", _non_negative(self.momentum, "momentum", allow_int=False))
        normalise("frequency", check_int(self.frequency, "frequency", _OWNER, min_value=2))
        normalise("use_nesterov", check_bool(self.use_nesterov, "use_nesterov", _OWNER))
        normalise("enable_clip_grad", check_bool(self.enable_clip_grad, "enable_clip_grad",
                                                 _OWNER))
        _check_cautious(self.cautious)
        normalise("batch_size", check_int(self.batch_size, "batch_size", _OWNER, min_value=1))
        normalise("split_indices", _check_split_indices(self.split_indices))
        if self.block_size is not None:
            normalise("block_size", check_int(self.block_size, "block_size", _OWNER,
                                              min_value=1))
        check_filter(self.decay_filter, "decay_filter", _OWNER)
        check_choice(self.damping_mode, "damping_mode", _OWNER, _DAMPING_MODES)
        if self.statistics_decay is not None:
            normalise("statistics_decay", check_number_range(
                check_float(self.statistics_decay, "statistics_decay", _OWNER),
                "statistics_decay", _OWNER, low=0.0, high=1.0, high_inclusive=False))
        check_choice(self.fisher, "fisher", _OWNER, _FISHERS)
        check_choice(self.graft, "graft", _OWNER, _GRAFTS)
        if self.graft is not None and self.momentum >= 1.0:
            raise ValueError(
                f"For '{_OWNER}', with graft={self.graft!r} the 'momentum' must be below 1: it "
                f"averages the steps as Adam's beta_1 does, v = m*v + (1 - m)*d: at 1 no step "
                f"moves anything and above 1 the steps grow without bound; but got "
                f"{self.momentum}.")
        check_choice(self.preconditioner, "preconditioner", _OWNER, tuple(PRECONDITIONERS))
        normalise("eigenbasis_exponent", _check_exponent(self.eigenbasis_exponent))
        if self.eigenbasis_tolerance is not None:
            normalise("eigenbasis_tolerance", check_number_range(
                check_float(self.eigenbasis_tolerance, "eigenbasis_tolerance", _OWNER),
                "eigenbasis_tolerance", _OWNER, low=0.0, high=1.0, low_inclusive=False,
                high_inclusive=False))
        if self.max_rotated_dim is not None:
            normalise("max_rotated_dim", check_int(self.max_rotated_dim, "max_rotated_dim",
                                                   _OWNER, min_value=1))
        if self.statistics_rows is not None:
            normalise("statistics_rows", check_int(self.statistics_rows, "statistics_rows",
                                                   _OWNER, min_value=1))
        if self.kl_clip is not None:
            normalise("kl_clip", _positive(self.kl_clip, "kl_clip"))
        normalise("seed", _check_seed(self.seed, self.fisher))
        experimental = Experimental.of(self.experimental)
        normalise("experimental", experimental)
        _check_statistics_frequency(experimental.statistics_frequency, self.statistics_decay,
                                    self.frequency)
        if self.max_rotated_dim is not None and experimental.trace_thresholds is not None:
            raise ValueError(
                f"For '{_OWNER}', 'max_rotated_dim' leaves the factors it does not rotate "
                f"unestimated, but the trace rule (trace_thresholds) reads every factor's "
                f"trace; got max_rotated_dim={self.max_rotated_dim}.")
        if experimental.pi_damping and self.damping_mode != "sqrt":
            raise ValueError(f"For '{_OWNER}', 'pi_damping' splits damping_mode='sqrt' by the "
                             f"factors' traces, but got damping_mode={self.damping_mode!r}.")
        if self.damping is not None:
            normalise("damping", resolve_learning_rate(self.damping, _OWNER, arg="damping"))
        elif self.uses_damping:
            raise ValueError(
                f"For '{_OWNER}', the 'damping' is needed: {self._damping_reader()} reads it; "
                f"give it, e.g. damping=0.1, damping_mode='relative'.")

    @property
    def statistics_frequency(self):
        """Steps between statistics captures: the experimental option where given, else 1
        with a decay and ``frequency`` without."""
        given = self.experimental.statistics_frequency
        if given is not None:
            return given
        return 1 if self.statistics_decay is not None else self.frequency

    @property
    def damps_factors(self):
        """Whether the factors' damping is read: by the inverses, or by the trace rule's
        damped trace (eigenvectors do not depend on it)."""
        return (PRECONDITIONERS[self.preconditioner].damps_factors
                or self.experimental.trace_thresholds is not None)

    @property
    def uses_damping(self):
        """Whether any step reads ``damping``: the factors' damping, or the LayerNorm rule
        (which Adam's step replaces with ``graft``)."""
        return self.damps_factors or self.graft is None

    def _damping_reader(self):
        if PRECONDITIONERS[self.preconditioner].damps_factors:
            return f"preconditioner={self.preconditioner!r}"
        if self.graft is None:
            return "the LayerNorm rule (graft=None)"
        return "the trace rule (trace_thresholds)"

    def get_config(self):
        """The options as the optimizer's config writes them (``weight_decay`` is Keras')."""
        config = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                  if field.name != "weight_decay"}
        config.update(
            damping=(None if self.damping is None
                     else serialize_step_value(self.damping, "the 'damping'", _OWNER)),
            decay_filter=serialize_filter(self.decay_filter, "decay_filter", _OWNER),
            experimental=self.experimental.get_config())
        return config
