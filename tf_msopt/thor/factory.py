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
from tf_msopt._validation import check_choice, type_name
from tf_msopt.thor.experimental import split_experimental
from tf_msopt.thor.model_link import check_model, wrapped_optimizers
from tf_msopt.thor.optimizer import THOR

__all__ = ["DEFAULTS", "connect", "thor"]

_OWNER = "THOR"

#: The keyword arguments of ``tf_msopt.thor(model)``; any of them given replaces its entry:
#: ``tf_msopt.thor(model, learning_rate=0.01)``.
DEFAULTS = {"learning_rate": 5e-3, "damping": None, "momentum": 0.9, "frequency": 10,
            "graft": "adam", "preconditioner": "eigenbasis",
            "statistics_decay": 0.95, "block_size": 1024, "kl_clip": 2e-3,
            "eigenbasis_exponent": {"conv": 0.75, "recurrent": 0.6}, "eigenbasis_tolerance": 0.01,
            "statistics_rows": 512, "cautious": "sequence"}
_MINDSPORE = {"frequency": 100, "block_size": 128}
_PRESETS = ("default", "mindspore")


def thor(model, learning_rate=None, damping=None, momentum=None, weight_decay=0.0,
         loss_scale=1.0, batch_size=32, use_nesterov=False, decay_filter=None,
         split_indices=None, enable_clip_grad=False, frequency=None, preset=None, **kwargs):
    """Creates a :class:`THOR` optimizer for ``model`` and connects it to the model's layers.

    ``thor(model)`` is the default configuration (:data:`DEFAULTS`); any argument given
    replaces its entry, one at a time (``thor(model, learning_rate=1e-2)``).
    ``thor(model, learning_rate, damping, momentum, ...)``, the three given together, is
    MindSpore's THOR (``frequency`` 100 and ``block_size`` 128 unless given).
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
    given = {"learning_rate": learning_rate, "damping": damping, "momentum": momentum}
    missing = [name for name, value in given.items() if value is None]
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
    options = dict(weight_decay=weight_decay, loss_scale=loss_scale, batch_size=batch_size,
                   experimental=experimental, use_nesterov=use_nesterov, decay_filter=decay_filter,
                   split_indices=split_indices, enable_clip_grad=enable_clip_grad,
                   **{name: value for name, value in given.items() if value is not None},
                   **kwargs)
    if frequency is not None:
        options["frequency"] = frequency
    return THOR(**{**(DEFAULTS if preset == "default" else _MINDSPORE), **options}).connect(model)


def connect(model):
    """Connects the THOR optimizer of a compiled ``model`` (e.g. after ``load_model``).

    Finds THOR in ``model.optimizer``, inside any ``LossScaleOptimizer``, and
    calls :meth:`THOR.connect`. Returns the THOR optimizer.
    """
    compiled = getattr(model, "optimizer", None)
    found = [o for o in wrapped_optimizers(compiled) if isinstance(o, THOR)]
    if not found:
        raise ValueError(
            f"For '{_OWNER}', the model has no THOR optimizer to connect (its optimizer is "
            f"'{type_name(compiled)}'); compile it with one first."
        )
    return found[0].connect(model)


thor.connect = connect
thor.DEFAULTS = DEFAULTS
