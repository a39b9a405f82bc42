"""Every private Keras/TensorFlow name the package uses is checked when it is imported."""
import subprocess
import sys

import keras
import pytest
from helpers import REPO_ROOT

from tf_msopt import _keras_compat as compat

METHODS = [(owner, name) for owner, name, _ in compat._METHODS]


@pytest.mark.parametrize("owner, name", METHODS, ids=[n for _, n in METHODS])
def test_a_missing_method_is_named(monkeypatch, owner, name):
    monkeypatch.setattr(owner, name, None)
    with pytest.raises(compat.KerasCompatibilityError, match=rf"{name}.*does not exist"):
        compat.check()


FUNCTIONS = [(module, dotted) for module, dotted, _ in compat._FUNCTIONS]


@pytest.mark.parametrize("module, dotted", FUNCTIONS, ids=[d for _, d in FUNCTIONS])
def test_a_missing_function_is_named(monkeypatch, module, dotted):
    *parents, name = dotted.split(".")
    owner = module
    for part in parents:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, name, None)
    with pytest.raises(compat.KerasCompatibilityError, match=rf"{dotted}.*does not exist"):
        compat.check()


def test_a_changed_signature_is_named(monkeypatch):
    monkeypatch.setattr(keras.optimizers.Optimizer, "_backend_update_step",
                        lambda self, grads, variables, learning_rate: None)
    with pytest.raises(compat.KerasCompatibilityError,
                       match=r"_backend_update_step.*now takes \(grads, variables"):
        compat.check()


def test_a_vanished_instance_attribute_is_named(monkeypatch):
    monkeypatch.setattr(compat, "_INSTANCE_ATTRIBUTES",
                        ((keras.optimizers.Optimizer, ("_renamed_by_a_future_keras",)),))
    with pytest.raises(compat.KerasCompatibilityError,
                       match="_renamed_by_a_future_keras.*no longer set"):
        compat.check()


@pytest.mark.parametrize("backend", ["jax", "torch", "numpy"])
def test_another_keras_backend_is_named(monkeypatch, backend):
    """A Keras configured for another backend (KERAS_BACKEND, keras.json) is named as the
    cause, not blamed on the versions."""
    monkeypatch.setattr(keras.backend, "backend", lambda: backend)
    with pytest.raises(compat.KerasCompatibilityError,
                       match=rf"TensorFlow backend.*'{backend}' backend.*KERAS_BACKEND="):
        compat.check()


@pytest.mark.parametrize("owner, attribute", [
    (owner, attribute) for owner, attributes in compat._INSTANCE_ATTRIBUTES
    for attribute in attributes])
def test_instance_attributes_are_found_in_the_methods_lines(owner, attribute):
    """The import's cheap path finds every attribute in the lines of the classes' own
    functions, without reading (and tokenizing) whole classes; those lines are part of
    the class's source."""
    pattern = compat._assignment(attribute)
    found = [cls for cls in owner.__mro__ if pattern.search(compat._methods_source(cls))]
    assert found
    class_source = compat._class_source(found[0])
    assert all(line in class_source
               for line in compat._methods_source(found[0]).splitlines())


def test_the_installed_versions_pass():
    compat.check()


@pytest.mark.slow
def test_import_fails_loudly_with_the_keras_version():
    """A fresh process where Keras lost a private method: ``import tf_msopt`` raises with the
    name and the version, before anything could train with wrong numbers."""
    code = ("import keras\n"
            "keras.layers.Layer._flatten_layers = None\n"
            "import tf_msopt\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=240,
                            env={"PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2",
                                 "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0
    assert "KerasCompatibilityError" in result.stderr
    assert f"Keras {keras.__version__}" in result.stderr
    assert "keras.src.layers.layer.Layer._flatten_layers" in result.stderr
