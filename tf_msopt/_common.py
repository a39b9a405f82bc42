"""Small helpers shared by every module: serialization registration, XLA detection, the
``tf.Variable`` behind a Keras variable."""
import keras

from tf_msopt._keras_compat import in_xla_context

__all__ = ["in_xla_context", "register", "tf_variable"]

#: Registers a class or function for ``keras.saving`` under the ``tf_msopt`` package.
register = keras.saving.register_keras_serializable(package="tf_msopt")


def tf_variable(variable):
    """The ``tf.Variable`` behind a ``keras.Variable`` (or ``variable`` itself), which
    TensorFlow's raw ops and ``tf.distribute`` take."""
    return variable.value if isinstance(variable, keras.Variable) else variable
