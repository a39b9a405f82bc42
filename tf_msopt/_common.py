"""Small helpers shared by every module: serialization registration, XLA detection."""
import keras
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

#: Registers a class or function for ``keras.saving`` under the ``tf_msopt`` package.
register = keras.saving.register_keras_serializable(package="tf_msopt")


def in_xla_context():
    """True while tracing inside a ``jit_compile=True`` function (the ops are XLA-compiled)."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
