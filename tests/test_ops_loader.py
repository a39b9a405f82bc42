"""The op loader, its kill switch, and its fallback with a warning."""

import pytest
import tensorflow as tf

import tf_msopt as mso
from tf_msopt.ops import _loader


@pytest.fixture
def library(monkeypatch, tmp_path):
    """A fresh loader state whose library path is in ``tmp_path`` (nothing there yet)."""
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    path = tmp_path / "_msopt_ops.so"
    monkeypatch.setattr(_loader, "LIBRARY_PATH", str(path))
    monkeypatch.setattr(_loader, "_state", {"loaded": False, "module": None, "reason": None})
    return path


def test_kill_switch_forces_the_pure_tf_path(monkeypatch):
    monkeypatch.setenv(_loader.DISABLE_ENV, "1")
    assert mso.ops.custom_ops_available() is False
    assert "TF_MSOPT_DISABLE_CUSTOM_OPS is set" in mso.ops.custom_ops_status()


def test_missing_library_falls_back_with_one_warning(library):
    with pytest.warns(RuntimeWarning, match="no library at .*without building it") as caught:
        assert mso.ops.custom_ops_available() is False
        assert mso.ops.custom_ops_available() is False
    assert len(caught) == 1 and "pip install --no-build-isolation ." in str(caught[0].message)
    status = mso.ops.custom_ops_status()
    assert status.startswith(f"pure TensorFlow (custom ops not loaded: no library at {library}")


def test_corrupted_library_falls_back_with_a_warning(library):
    library.write_bytes(b"\x7fELF but not a shared object")
    with pytest.warns(RuntimeWarning, match="custom ops are not used .*NotFoundError"):
        assert mso.ops.custom_ops_available() is False
    assert "NotFoundError" in mso.ops.custom_ops_status()


def test_library_of_another_tensorflow_is_not_loaded(library):
    """The ABI of another release differs: the library is never opened (this one would fail to
    load, and the reason would say so instead)."""
    def record(version):
        return b"not a library" + b"tf_msopt built against TensorFlow " + version.encode() + b"\0"

    major, minor = map(int, tf.__version__.split(".")[:2])
    other = f"{major}.{minor - 1}.0"
    library.write_bytes(record(other))
    with pytest.warns(RuntimeWarning, match=rf"built against TensorFlow {other}, running "):
        assert mso.ops.custom_ops_available() is False
    assert _loader.built_against() == other
    # A patch release of the same TensorFlow is the same ABI: the library is tried.
    library.write_bytes(record(f"{major}.{minor}.99"))
    _loader._state["loaded"] = False
    with pytest.warns(RuntimeWarning, match="NotFoundError"):
        assert mso.ops.custom_ops_available() is False


@pytest.mark.parametrize("value", ["", "0"])
def test_switch_off_values_do_not_disable(monkeypatch, library, value):
    monkeypatch.setenv(_loader.DISABLE_ENV, value)
    with pytest.warns(RuntimeWarning):
        assert "is set" not in mso.ops.custom_ops_status()


def test_status_names_the_tensorflow_the_library_was_built_against():
    if not mso.ops.custom_ops_available():
        pytest.skip("the compiled ops are not loaded in this run (kill switch)")
    assert _loader.built_against() == tf.__version__
    assert mso.ops.custom_ops_status() == (f"custom ops loaded from {_loader.LIBRARY_PATH} "
                                           f"(built against TensorFlow {tf.__version__})")
