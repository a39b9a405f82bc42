"""THOR's options, each written once: :data:`OPTIONS` holds its name, MindSpore's default, the
default configuration's value, its check and its line of docs/thor.md's table.

Everything else is made from it: :class:`ThorOptions` (the checked values, ``optimizer.options``),
the config, ``tf_msopt.thor.DEFAULTS`` (:func:`default_configuration`), the signature
:class:`~tf_msopt.THOR` shows and the table (:func:`arguments_table`). Adding an option is one
entry here plus its use.
"""
import dataclasses
import inspect
import random

from tf_msopt._validation import (check_bool, check_choice, check_float, check_int,
                                  check_number_range, type_name)
from tf_msopt.optimizers.base import check_filter, resolve_learning_rate, serialize_filter
from tf_msopt.schedules import serialize_step_value
from tf_msopt.thor.curvature_blocks import REGISTRY
from tf_msopt.thor.experimental import Experimental
from tf_msopt.thor.preconditioners import PRECONDITIONERS

__all__ = ["OPTIONS", "Option", "ThorOptions", "arguments_table", "default_configuration"]

_OWNER = "THOR"
#: The marker of an argument MindSpore's form needs (``learning_rate``, ``damping``, ``momentum``).
REQUIRED = inspect.Parameter.empty
#: The marker of an option the default configuration leaves at MindSpore's value.
SAME = object()


@dataclasses.dataclass(frozen=True)
class Option:
    """One of THOR's options.

    Attributes:
        name: the keyword argument.
        default: MindSpore's value (``THOR``'s own default), or :data:`REQUIRED`.
        check: ``(value, options) -> value``: raises MindSpore's error type naming the
            argument, else returns the value normalised; ``options`` holds the entries before
            it. None: Keras' base class checks it (the learning rate).
        description: its cell in docs/thor.md's table.
        preset: its value in ``tf_msopt.thor(model)``, the default configuration.
        none_means: what ``None`` stands for, shown beside it in the table.
        serialize: ``value -> config value`` where the value is not written as it is.
    """

    name: str
    default: object
    check: object
    description: str
    preset: object = SAME
    none_means: str = ""
    serialize: object = None


def _non_negative(value, arg, allow_int=True):
    return check_number_range(check_float(value, arg, _OWNER, allow_int=allow_int), arg, _OWNER,
                              low=0.0)


def _positive(value, arg):
    return check_number_range(check_float(value, arg, _OWNER), arg, _OWNER, low=0.0,
                              low_inclusive=False)


def _optional(check):
    """``check`` for a value other than None."""
    return lambda value, options: None if value is None else check(value, options)


def _optional_int(arg):
    return _optional(lambda value, options: check_int(value, arg, _OWNER, min_value=1))


def _check_cautious(cautious, options):
    if not isinstance(cautious, (bool, str)):
        raise TypeError(f"For '{_OWNER}', the 'cautious' must be a bool or 'sequence', but got "
                        f"type '{type_name(cautious)}'.")
    return check_choice(cautious, "cautious", _OWNER, (False, True, "sequence"))


def _check_split_indices(split_indices, options):
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


def _check_graft(graft, options):
    check_choice(graft, "graft", _OWNER, (None, "adam"))
    if graft is not None and options["momentum"] >= 1.0:
        raise ValueError(
            f"For '{_OWNER}', with graft={graft!r} the 'momentum' must be below 1: it "
            f"averages the steps as Adam's beta_1 does, v = m*v + (1 - m)*d: at 1 no step "
            f"moves anything and above 1 the steps grow without bound; but got "
            f"{options['momentum']}.")
    return graft


def _check_exponent(exponent, options):
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


def _check_seed(seed, options):
    if seed is None and options["fisher"] == "sampled":
        seed = random.SystemRandom().randrange(2**31)   # leaves Python's global state alone
    if seed is not None:
        seed = check_int(seed, "seed", _OWNER, min_value=0, max_value=2**64 - 1)
    return seed


def _choice(arg, choices):
    return lambda value, options: check_choice(value, arg, _OWNER, choices)


def _flag(arg):
    return lambda value, options: check_bool(value, arg, _OWNER)


def _fraction(arg, **bounds):
    return _optional(lambda value, options: check_number_range(
        check_float(value, arg, _OWNER), arg, _OWNER, low=0.0, high=1.0, **bounds))


#: THOR's options in the order of its signature.
OPTIONS = (
    Option("learning_rate", REQUIRED, None, "number, 0-D/1-D tensor or array (entry `i` at "
           "step `i`), iterable, or `LearningRateSchedule`", preset=5e-3),
    Option("damping", REQUIRED, _optional(
        lambda value, options: resolve_learning_rate(value, _OWNER, arg="damping")),
           "`lambda`, in the same forms; `mso.schedules.thor_damping` makes MindSpore's. "
           "Needed where a step reads it: `preconditioner=\"inverse\"`, `graft=None` (the "
           "LayerNorm rule) or the trace rule; a `ValueError` says which", preset=None,
           none_means="no step reads one",
           serialize=lambda value: None if value is None else serialize_step_value(
               value, "the 'damping'", _OWNER)),
    Option("momentum", REQUIRED,
           lambda value, options: _non_negative(value, "momentum", allow_int=False),
           "float >= 0; below 1 with `graft` (it averages the steps: `v = m*v + (1 - m)*d`)",
           preset=0.9),
    Option("weight_decay", 0.0, lambda value, options: _non_negative(value, "weight_decay"),
           "float >= 0, added to the preconditioned gradient"),
    Option("loss_scale", 1.0, lambda value, options: _positive(value, "loss_scale"),
           "float > 0: the scale of the gradients THOR receives, when the loss was scaled by "
           "hand"),
    Option("batch_size", 32,
           lambda value, options: check_int(value, "batch_size", _OWNER, min_value=1),
           "global batch size, used only before the first batch is seen (LayerNorm rule)"),
    Option("use_nesterov", False, _flag("use_nesterov"), "bool"),
    Option("decay_filter", None,
           lambda value, options: check_filter(value, "decay_filter", _OWNER),
           "callable `f(keras.Variable) -> bool` (True: decay), or list of regular expressions "
           "of variable paths to exclude", none_means="all variables",
           serialize=lambda value: serialize_filter(value, "decay_filter", _OWNER)),
    Option("split_indices", None, _check_split_indices,
           "indices of preconditioned layers that close an all-reduce bucket"),
    Option("replica_division", "refresh", _optional(_choice("replica_division",
                                                            ("step", "refresh"))),
           "under a strategy of several replicas, the work each factored layer's owner does "
           "for all: `\"refresh\"` its factorisations, `\"step\"` also its per-step "
           "preconditioning, both handed to every replica by one all-gather, and with the "
           "replicas in one process holds its state alone (see "
           "[Distributed training](distributed.md))", preset="step",
           none_means="every replica does all of it"),
    Option("enable_clip_grad", False, _flag("enable_clip_grad"),
           "bool: clip each gradient to L2 norm 1"),
    Option("frequency", 100,
           lambda value, options: check_int(value, "frequency", _OWNER, min_value=2),
           "int >= 2: steps between THOR steps", preset=10),
    Option("block_size", 128, _optional_int("block_size"),
           "int >= 1, or `None` for whole-factor inverses (not in MindSpore)", preset=1024),
    Option("damping_mode", "sqrt", _choice("damping_mode", ("sqrt", "relative")),
           "`\"sqrt\"`: `sqrt(lambda)` on both factors; `\"relative\"`: `sqrt(lambda)` times "
           "each factor's mean eigenvalue (`lambda` in units of the factor's scale)"),
    Option("statistics_decay", None, _fraction("statistics_decay", high_inclusive=False),
           "float in [0, 1): bias-corrected moving averages of `A` and `G`", preset=0.95),
    Option("fisher", "empirical", _choice("fisher", ("empirical", "sampled")),
           "`\"sampled\"`: `G` from labels drawn from the model's own predictions"),
    Option("kl_clip", None, _optional(lambda value, options: _positive(value, "kl_clip")),
           "float > 0: scale the preconditioned step so its KL size stays below it",
           preset=2e-3),
    Option("seed", None, _check_seed, "int in [0, 2**64): seed of the sampled labels",
           none_means="drawn, kept in the config"),
    Option("graft", None, _check_graft,
           "`\"adam\"`: each step's direction from THOR, its length from Adam (the default's, "
           "see [Choosing a configuration](#choosing-a-configuration))", preset="adam"),
    Option("preconditioner", "inverse",
           lambda value, options: check_choice(value, "preconditioner", _OWNER,
                                               tuple(PRECONDITIONERS)),
           "`\"eigenbasis\"`: Adam in the eigenbasis of `A` and `G` (SOAP) instead of `A_inv g "
           "G_inv` (see [Convergence options](#convergence-options))", preset="eigenbasis"),
    Option("eigenbasis_exponent", None, _check_exponent,
           "with `\"eigenbasis\"`: the power `e` of the rotated second moment that divides the "
           "rotated gradient, a number in (0, 1] for every kernel or a dict of layer kinds "
           "(`\"dense\"`, `\"einsum_dense\"`, `\"conv\"`, `\"conv_transpose\"`, "
           "`\"grouped_conv\"`, `\"depthwise_conv\"`, `\"separable_depthwise\"`, "
           "`\"separable_pointwise\"`, `\"embedding\"`, `\"recurrent\"`) to numbers, 1/2 for the "
           "others; other than 1/2 the divisor is `(v_hat + 1e-2 mean(v_hat))^e` (1: EKFAC's "
           "natural gradient)", preset={"conv": 0.75, "recurrent": 0.6}, none_means="1/2"),
    Option("eigenbasis_tolerance", None,
           _fraction("eigenbasis_tolerance", low_inclusive=False, high_inclusive=False),
           "with `\"eigenbasis\"`: a float in (0, 1): a refresh keeps a factor's eigenvectors "
           "`Q` while at most this share of the factor's squared Frobenius mass lies off the "
           "diagonal of `Q^T P Q` in every block (with moving averages, once they have had `2 / "
           "(1 - statistics_decay)` updates); `None` decomposes every factor at every refresh",
           preset=0.01),
    Option("max_rotated_dim", None, _optional_int("max_rotated_dim"),
           "with `\"eigenbasis\"`: an int >= 1: a kernel's factor wider than this and than its "
           "other factor is neither estimated nor rotated (the kernel is rotated on its "
           "narrower side only)"),
    Option("statistics_rows", None, _optional_int("statistics_rows"),
           "an int >= 1: each layer's statistics from every `s`-th example of the batch, `s` "
           "the largest stride that leaves at least this many rows (examples times the "
           "positions where the kernel is applied); `None` uses every row", preset=512),
    Option("cautious", False, _check_cautious,
           "`True`: each variable steps only where its momentum step agrees in sign with this "
           "step's direction; `\"sequence\"`: only the kernels of Dense and EinsumDense layers "
           "applied at each position of a sequence do (see [Convergence "
           "options](#convergence-options))", preset="sequence"),
    Option("experimental", None, lambda value, options: Experimental.of(value),
           "a `mso.thor.Experimental` (or its dict) of the [experimental "
           "options](#experimental-options); `mso.thor` also takes each by name",
           serialize=lambda value: value.get_config()),
)


def _check_combinations(options):
    """The checks that read several options, after each option's own."""
    experimental = options.experimental
    given = experimental.statistics_frequency
    if given is not None:
        if options.statistics_decay is None and given != options.frequency:
            raise ValueError(
                f"For '{_OWNER}', 'statistics_frequency' needs 'statistics_decay' (without a "
                f"moving average, statistics are only used every 'frequency' steps), but got "
                f"statistics_frequency={given} and statistics_decay=None.")
        if options.frequency % given:
            raise ValueError(
                f"For '{_OWNER}', the 'statistics_frequency' must divide 'frequency' "
                f"({options.frequency}), but got {given}.")
    if options.max_rotated_dim is not None and experimental.trace_thresholds is not None:
        raise ValueError(
            f"For '{_OWNER}', 'max_rotated_dim' leaves the factors it does not rotate "
            f"unestimated, but the trace rule (trace_thresholds) reads every factor's "
            f"trace; got max_rotated_dim={options.max_rotated_dim}.")
    if experimental.pi_damping and options.damping_mode != "sqrt":
        raise ValueError(f"For '{_OWNER}', 'pi_damping' splits damping_mode='sqrt' by the "
                         f"factors' traces, but got damping_mode={options.damping_mode!r}.")
    if options.damping is None and options.uses_damping:
        raise ValueError(
            f"For '{_OWNER}', the 'damping' is needed: {options.damping_reader()} reads it; "
            f"give it, e.g. damping=0.1, damping_mode='relative'.")


class ThorOptions:
    """THOR's options other than the learning rate, one attribute per entry of
    :data:`OPTIONS`, checked and normalised on creation: a bad argument raises MindSpore's
    error type naming it. ``damping`` becomes a float or a schedule (or stays None where no
    step reads it)."""

    def __init__(self, **given):
        checked = {}
        for option in OPTIONS:
            if option.check is not None:
                value = given.get(option.name, option.default)
                if value is REQUIRED:
                    raise TypeError(f"For '{_OWNER}', the '{option.name}' is required.")
                checked[option.name] = option.check(value, checked)
        vars(self).update(checked)
        _check_combinations(self)

    @staticmethod
    def names():
        """The names of the options :class:`ThorOptions` holds."""
        return [option.name for option in OPTIONS if option.check is not None]

    def __eq__(self, other):
        return isinstance(other, ThorOptions) and vars(self) == vars(other)

    def __repr__(self):
        return f"ThorOptions({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

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

    def damping_reader(self):
        """What reads the damping, for the error that asks for it."""
        if PRECONDITIONERS[self.preconditioner].damps_factors:
            return f"preconditioner={self.preconditioner!r}"
        if self.graft is None:
            return "the LayerNorm rule (graft=None)"
        return "the trace rule (trace_thresholds)"

    def get_config(self):
        """The options as the optimizer's config writes them (``weight_decay`` is Keras')."""
        return {option.name: (option.serialize or (lambda value: value))(
                    getattr(self, option.name))
                for option in OPTIONS if option.check is not None
                and option.name != "weight_decay"}


def default_configuration():
    """``tf_msopt.thor(model)``'s arguments: every option whose value differs from
    MindSpore's."""
    return {option.name: option.preset for option in OPTIONS if option.preset is not SAME}


def signature(*leading, trailing=()):
    """The signature of THOR's constructor: ``leading`` parameters, the options (those
    MindSpore requires by position, the others by keyword), then ``trailing``."""
    return inspect.Signature([*leading, *(inspect.Parameter(
        option.name, inspect.Parameter.POSITIONAL_OR_KEYWORD if option.default is REQUIRED
        else inspect.Parameter.KEYWORD_ONLY, default=option.default) for option in OPTIONS),
                              *trailing])


def _cell(value, option, required="(required)"):
    if value is REQUIRED:
        return required
    if isinstance(value, str):
        text = f'"{value}"'
    elif isinstance(value, dict):
        text = "{" + ", ".join(f'"{k}": {v!r}' for k, v in value.items()) + "}"
    else:
        text = repr(value)
    return f"`{text}`" + (f" ({option.none_means})" if value is None and option.none_means
                          else "")


def arguments_table():
    """docs/thor.md's table of the options: each with the default configuration's value,
    MindSpore's and its description."""
    rows = ["| argument | `mso.thor(model)` | MindSpore's form | meaning |",
            "| --- | --- | --- | --- |"]
    for option in OPTIONS:
        preset = option.default if option.preset is SAME else option.preset
        rows.append(f"| `{option.name}` | {_cell(preset, option)} | "
                    f"{_cell(option.default, option)} | {option.description} |")
    return "\n".join(rows) + "\n"
