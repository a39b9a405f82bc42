"""Small helpers shared by every module: serialization registration, XLA detection."""
import keras

from tf_msopt._keras_compat import in_xla_context

__all__ = ["in_xla_context", "register"]

#: Registers a class or function for ``keras.saving`` under the ``tf_msopt`` package.
register = keras.saving.register_keras_serializable(package="tf_msopt")

