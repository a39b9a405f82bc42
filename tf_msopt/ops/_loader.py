"""Loader of the compiled op library, with the ``TF_MSOPT_DISABLE_CUSTOM_OPS`` kill switch.

``import tf_msopt`` loads the library (about 10 ms), so that its ops are registered
before a SavedModel whose functions use them is loaded. A library that is missing, that was
built against another TensorFlow release (the version is a string in the file,
``custom_ops/build_info.cc``; such a library is not loaded, as its ABI differs) or that
fails to load leaves ``load_custom_ops()`` returning None with one warning saying why and how
to rebuild, and callers take their pure-TF path. The kill switch does the same without a
warning.
"""
import os
import re
import warnings

import tensorflow as tf

DISABLE_ENV = "TF_MSOPT_DISABLE_CUSTOM_OPS"
LIBRARY_PATH = os.path.join(os.path.dirname(__file__), "_msopt_ops.so")
REBUILD = ("to build them against this TensorFlow (needs g++): pip install --force-reinstall "
           "--no-deps --no-binary tf_msopt tf_msopt, or pip install --no-build-isolation . "
           "in a checkout")

_state = {"loaded": False, "module": None, "reason": None}


def _disabled():
    return os.environ.get(DISABLE_ENV, "").strip() not in ("", "0")


_BUILT_AGAINST = re.compile(rb"tf_msopt built against TensorFlow ([0-9A-Za-z.+-]+)\0")


def built_against():
    """The TensorFlow version the library was built against, read from the file without
    loading it; None where the file or the record is missing."""
    try:
        with open(LIBRARY_PATH, "rb") as f:
            found = _BUILT_AGAINST.search(f.read())
    except OSError:
        return None
    return found.group(1).decode() if found else None


def _release(version):
    return version.split(".")[:2]


def _load():
    """``(module, None)``, or ``(None, why not)``."""
    if not os.path.exists(LIBRARY_PATH):
        return None, (f"no library at {LIBRARY_PATH}: the package was installed without "
                      f"building it (no C++ compiler, or TF_MSOPT_BUILD_CUSTOM_OPS=0)")
    built = built_against()
    if built is not None and _release(built) != _release(tf.__version__):
        return None, f"built against TensorFlow {built}, running {tf.__version__}"
    try:
        return tf.load_op_library(LIBRARY_PATH), None
    except (tf.errors.NotFoundError, OSError) as err:
        return None, f"{type(err).__name__}: {err}"


def load_custom_ops():
    """The loaded op module, or None when the pure-TF path must be used."""
    if _disabled():
        return None
    if not _state["loaded"]:
        _state["loaded"] = True
        _state["module"], _state["reason"] = _load()
        if _state["reason"] is not None:
            warnings.warn(f"tf_msopt: the compiled custom ops are not used ({_state['reason']})"
                          f"; every feature runs on its slower pure-TensorFlow path. "
                          f"{REBUILD[0].upper()}{REBUILD[1:]}.", RuntimeWarning, stacklevel=2)
    return _state["module"]


def custom_ops_available():
    """True when the compiled ops are loaded and enabled."""
    return load_custom_ops() is not None


def custom_ops_status():
    """One line saying which back-end is in use and why."""
    if _disabled():
        return f"pure TensorFlow ({DISABLE_ENV} is set)"
    if load_custom_ops() is not None:
        built = built_against()
        return (f"custom ops loaded from {LIBRARY_PATH}"
                + (f" (built against TensorFlow {built})" if built else ""))
    return f"pure TensorFlow (custom ops not loaded: {_state['reason']}; {REBUILD})"
