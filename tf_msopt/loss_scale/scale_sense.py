"""``LossScaleOptimizer``'s two forms of its scale, MindSpore's ``scale_sense`` and Keras'
``initial_scale`` / ``dynamic_growth_steps``: from the arguments to an update cell, into a
config with Keras' keys, back from such a config, and from Keras' own class."""
import numbers

import keras
import numpy as np
import tensorflow as tf

from tf_msopt._validation import check_int, type_name
from tf_msopt.loss_scale.managers import DynamicLossScaleManager, FixedLossScaleManager
from tf_msopt.loss_scale.update_cells import (DynamicLossScaleUpdateCell,
                                              FixedLossScaleUpdateCell, LossScaleUpdateCell,
                                              check_loss_scale)

__all__ = ["add_scale_sense", "constructor_arguments", "keras_equivalent", "keras_scale_state",
           "resolve_scale_sense", "scale_sense_of"]


_Managers = (DynamicLossScaleManager, FixedLossScaleManager)
_Scalars = (tf.Tensor, tf.Variable, keras.Variable, np.ndarray, np.generic)


def scale_sense_of(scale_sense, initial_scale, dynamic_growth_steps, owner):
    """``scale_sense`` as given, or the dynamic cell Keras' form means: Keras' rule (factor
    2) and defaults. Both forms at once are a ``ValueError``."""
    keras_form = {key: value for key, value in (("initial_scale", initial_scale),
                                                ("dynamic_growth_steps", dynamic_growth_steps))
                  if value is not None}
    if scale_sense is not None and keras_form:
        raise ValueError(
            f"For '{owner}', give either MindSpore's 'scale_sense' or Keras' "
            f"'initial_scale' / 'dynamic_growth_steps', not both, but got "
            f"scale_sense={scale_sense!r} and {keras_form}."
        )
    if scale_sense is not None:
        return scale_sense
    return DynamicLossScaleUpdateCell(
        check_loss_scale(2.0**15 if initial_scale is None else initial_scale,
                         "initial_scale", owner),
        2,
        check_int(2000 if dynamic_growth_steps is None else dynamic_growth_steps,
                  "dynamic_growth_steps", owner, min_value=1))


def resolve_scale_sense(scale_sense, owner):
    """``(scale_sense to keep, update cell or None, initial scale)`` of a scale_sense."""
    if isinstance(scale_sense, LossScaleUpdateCell):
        return scale_sense, scale_sense, scale_sense.get_loss_scale()
    if isinstance(scale_sense, _Managers):
        return scale_sense, scale_sense.get_update_cell(), scale_sense.get_loss_scale()
    if isinstance(scale_sense, _Scalars) and not isinstance(scale_sense, bool):
        array = np.asarray(scale_sense)
        if array.shape not in ((), (1,)):
            raise ValueError(f"For '{owner}', the shape of 'scale_sense' must be (1,) or (), "
                             f"but got {array.shape}.")
        if np.issubdtype(array.dtype, np.number) and array.dtype != bool:
            scale_sense = array.reshape(()).item()
    if isinstance(scale_sense, numbers.Real) and not isinstance(scale_sense, bool):
        value = check_loss_scale(scale_sense, "scale_sense", owner)
        return value, FixedLossScaleUpdateCell(value), value
    raise TypeError(
        f"For '{owner}', the 'scale_sense' must be a DynamicLossScaleUpdateCell, "
        f"FixedLossScaleUpdateCell, DynamicLossScaleManager, FixedLossScaleManager, a number or a "
        f"scalar tensor, but got type '{type_name(scale_sense)}'."
    )


def keras_equivalent(scale_sense):
    """True when Keras' class has the same rule: a dynamic cell with factor 2."""
    return type(scale_sense) is DynamicLossScaleUpdateCell and scale_sense.scale_factor == 2


def add_scale_sense(config, scale_sense):
    """``config`` (Keras' keys) with ``scale_sense`` added where Keras' class has no
    equivalent: Keras' class loads the config where it means the same, and refuses it,
    naming ``scale_sense``, where it does not."""
    if not keras_equivalent(scale_sense):
        if not isinstance(scale_sense, float):
            scale_sense = keras.saving.serialize_keras_object(scale_sense)
        config["scale_sense"] = scale_sense
    return config


def constructor_arguments(config, custom_objects=None):
    """``(args, kwargs)`` of the constructor, from a config of either form or one written
    by Keras' class."""
    config = dict(config)
    inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                  custom_objects=custom_objects)
    scale_sense = config.pop("scale_sense", None)
    if scale_sense is None:
        return (inner,), config           # Keras' form (also Keras' own configs)
    # initial_scale / dynamic_growth_steps were written beside it for Keras' class.
    config.pop("initial_scale", None)
    config.pop("dynamic_growth_steps", None)
    if isinstance(scale_sense, dict):
        scale_sense = keras.saving.deserialize_keras_object(scale_sense,
                                                            custom_objects=custom_objects)
    return (inner, scale_sense), config


def keras_scale_state(optimizer):
    """``(scale, step_counter)`` to continue from, of a ``keras.optimizers.LossScaleOptimizer``:
    its current scale and window position once built, else its initial scale and ``None``."""
    if not optimizer.built:
        return optimizer.initial_scale, None
    return (float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)),
            int(keras.ops.convert_to_numpy(optimizer.step_counter)))
