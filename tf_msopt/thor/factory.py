"""``tf_msopt.thor(model, ...)`` and ``tf_msopt.thor.connect(model)``: a THOR for a model.

``tf_msopt.thor(model)`` with no hyper-parameters is the default, one configuration for
every model kind (:data:`DEFAULTS`): Adam run in the eigenbases of THOR's Kronecker factors
(SOAP's direction; the second moment's power is 0.75 on convolutions and 0.6 on recurrent
kernels, not Adam's 1/2),
each step grafted to Adam's length (a learning rate that means what it means to Adam) and
scaled down by the KL clip where it would move the model too far, the factors' moving
averages over steps (from at least 512 rows of each batch), a refresh every 10 steps
that decomposes only the factors whose eigenvectors no longer hold and, on the Dense and
EinsumDense kernels applied at each position of a sequence, the cautious mask (a momentum
step only where it agrees in sign with the current direction); any argument given
replaces its entry. Given MindSpore's ``learning_rate``, ``damping`` and ``momentum`` together (or
``preset="mindspore"``), it is MindSpore's THOR, with MindSpore's defaults for the rest.
"""
import inspect

from tf_msopt._validation import check_choice, type_name
from tf_msopt.thor.experimental import split_experimental
from tf_msopt.thor.model_link import check_model
from tf_msopt.thor.optimizer import THOR, wrapped_thor
from tf_msopt.thor.options import OPTIONS, SAME, default_configuration

__all__ = ["DEFAULTS", "connect", "thor"]

_OWNER = "THOR"

#: The keyword arguments of ``tf_msopt.thor(model)``, made from the options' entries
#: (:data:`tf_msopt.thor.options.OPTIONS`); any of them given replaces its entry:
#: ``tf_msopt.thor(model, learning_rate=0.01)``.
DEFAULTS = default_configuration()
_PRESETS = ("default", "mindspore")
#: The arguments MindSpore's ``nn.thor`` takes by position after the model, in its order.
_POSITIONAL = ("learning_rate", "damping", "momentum", "weight_decay", "loss_scale",
               "batch_size", "use_nesterov", "decay_filter", "split_indices",
               "enable_clip_grad", "frequency")


def thor(model, *args, preset=None, **kwargs):
    """Creates a :class:`THOR` optimizer for ``model`` and connects it to the model's layers.

    ``thor(model)`` is the default configuration (:data:`DEFAULTS`); any argument given
    replaces its entry, one at a time (``thor(model, learning_rate=1e-2)``).
    ``thor(model, learning_rate, damping, momentum, ...)``, the three given together, is
    MindSpore's THOR (``frequency`` 100 and ``block_size`` 128 unless given), with
    ``nn.thor``'s positional arguments after them.
    ``preset="default"`` or ``"mindspore"`` names the starting point instead: the default
    with all three replaced, or MindSpore's THOR, which then needs all three. The
    experimental options (:class:`~tf_msopt.thor.experimental.Experimental`) are taken by
    name too.

    The kernels of Dense, EinsumDense, convolution (1D, 2D, 3D, transposed, depthwise,
    separable, grouped), Embedding and recurrent (SimpleRNN, GRU, LSTM) layers get
    Kronecker-factored preconditioning; every other variable takes Adam's step with the
    default's graft, or without one its plain gradient (LayerNormalization's gamma and beta
    MindSpore's LayerNorm rule); ``optimizer.report()`` lists which and
    why. Call it under the distribution strategy's scope, if any, and pass the
    result to ``model.compile``. Arguments: as :class:`THOR` (MindSpore's
    ``nn.thor`` names and defaults, plus ``block_size``).
    """
    check_model(model)   # before the options: thor(1e-3, model) would fail on the rate
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"For '{_OWNER}', thor() takes the model and at most "
                        f"{len(_POSITIONAL)} arguments by position, but got {len(args)}.")
    for name, value in zip(_POSITIONAL, args):
        if name in kwargs:
            raise TypeError(f"For '{_OWNER}', thor() got the '{name}' twice.")
        kwargs[name] = value
    kwargs = {name: value for name, value in kwargs.items()
              if value is not None or name not in _PRESET_DIFFERS}
    missing = [name for name in ("learning_rate", "damping", "momentum") if name not in kwargs]
    if preset is None:
        preset = "default" if missing else "mindspore"
    check_choice(preset, "preset", _OWNER, _PRESETS)
    if preset == "mindspore" and missing:
        raise TypeError(
            f"For '{_OWNER}', MindSpore's THOR (preset='mindspore') needs 'learning_rate', "
            f"'damping' and 'momentum', but "
            f"{', '.join(repr(name) for name in missing)} {'is' if len(missing) == 1 else 'are'}"
            f" missing.")
    kwargs, experimental = split_experimental(kwargs)
    start = DEFAULTS if preset == "default" else {}
    return THOR(**{**start, **kwargs, "experimental": experimental}).connect(model)


#: The positional arguments whose None stands for the preset's value: those whose value the
#: default configuration changes.
_PRESET_DIFFERS = frozenset(option.name for option in OPTIONS
                            if option.name in _POSITIONAL and option.preset is not SAME)

thor.__signature__ = inspect.Signature([
    inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    *(inspect.Parameter(option.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                        default=None if option.name in _PRESET_DIFFERS else option.default)
      for option in OPTIONS if option.name in _POSITIONAL),
    inspect.Parameter("preset", inspect.Parameter.KEYWORD_ONLY, default=None),
    inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def connect(model):
    """Connects the THOR optimizer of a compiled ``model`` (e.g. after ``load_model``).

    Finds THOR in ``model.optimizer``, inside any ``LossScaleOptimizer``, and
    calls :meth:`THOR.connect`. Returns the THOR optimizer.
    """
    compiled = getattr(model, "optimizer", None)
    found = wrapped_thor(compiled)
    if found is None:
        raise ValueError(
            f"For '{_OWNER}', the model has no THOR optimizer to connect (its optimizer is "
            f"'{type_name(compiled)}'); compile it with one first."
        )
    return found.connect(model)


thor.connect = connect
thor.DEFAULTS = DEFAULTS
