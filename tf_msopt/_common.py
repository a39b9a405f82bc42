"""Small helpers shared by every module: serialization registration, XLA detection, the
``tf.Variable`` behind a Keras variable, the mark of functions users call in a
``tf.function``, variables kept in one copy under a strategy."""
import contextlib

import keras
import tensorflow as tf

from tf_msopt._keras_compat import in_xla_context, resource_variable

__all__ = ["entry_point", "in_xla_context", "register", "single_copy_variables", "tf_variable"]

#: Registers a class or function for ``keras.saving`` under the ``tf_msopt`` package.
register = keras.saving.register_keras_serializable(package="tf_msopt")


def entry_point(function):
    """Marks a function or method that users call inside their own ``tf.function`` (an
    optimizer's ``apply``, the public ops): AutoGraph leaves it and what it calls
    unconverted. Converting them added 0.03-0.13 s to the first trace of a step per
    optimizer, and 0.3-0.6 s per op, for code with no Python control flow on tensors
    (Keras' ``fit`` turns AutoGraph off for its whole train step)."""
    return tf.autograph.experimental.do_not_convert(function)


def tf_variable(variable):
    """The ``tf.Variable`` behind a ``keras.Variable`` (or ``variable`` itself), which
    TensorFlow's raw ops and ``tf.distribute`` take."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _single_copy(next_creator, **kwargs):
    del next_creator
    return resource_variable(**kwargs)


@contextlib.contextmanager
def single_copy_variables(device):
    """Variables created inside are plain ones, one copy on ``device``, even inside a
    ``tf.distribute`` scope (whose creator would put a mirror on every replica's device)."""
    with tf.device(device), tf.variable_creator_scope(_single_copy):
        yield
