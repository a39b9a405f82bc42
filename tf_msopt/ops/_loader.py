"""Loader of the compiled op library, with the ``TF_MSOPT_DISABLE_CUSTOM_OPS`` kill switch.

``import tf_msopt`` loads the library (about 10 ms), so that its ops are registered
before a SavedModel whose functions use them is loaded. A missing file, a build against
another TensorFlow (``undefined symbol``) or the kill switch all leave
``load_custom_ops()`` returning None, and callers take their pure-TF path.
"""
import os

import tensorflow as tf

DISABLE_ENV = "TF_MSOPT_DISABLE_CUSTOM_OPS"
LIBRARY_PATH = os.path.join(os.path.dirname(__file__), "_msopt_ops.so")

_state = {"loaded": False, "module": None, "reason": None}


def load_custom_ops():
    """The loaded op module, or None when the pure-TF path must be used."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    if not _state["loaded"]:
        _state["loaded"] = True
        try:
            _state["module"] = tf.load_op_library(LIBRARY_PATH)
        except (tf.errors.NotFoundError, OSError) as err:
            _state["reason"] = f"{type(err).__name__}: {err}"
    return _state["module"]


def custom_ops_available():
    """True when the compiled ops are loaded and enabled."""
    return load_custom_ops() is not None


def custom_ops_status():
    """One line saying which back-end is in use and why."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return f"pure TensorFlow ({DISABLE_ENV} is set)"
    if load_custom_ops() is not None:
        return f"custom ops loaded from {LIBRARY_PATH}"
    return f"pure TensorFlow (custom ops not loaded: {_state['reason']})"
