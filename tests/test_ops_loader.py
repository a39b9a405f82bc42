"""The op loader and its kill switch."""
import os

import pytest

import tf_msopt as mso
from tf_msopt.ops import _loader


def test_kill_switch_forces_the_pure_tf_path(monkeypatch):
    monkeypatch.setenv(_loader.DISABLE_ENV, "1")
    assert mso.ops.custom_ops_available() is False
    assert "TF_MSOPT_DISABLE_CUSTOM_OPS is set" in mso.ops.custom_ops_status()


def test_missing_library_falls_back_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    monkeypatch.setattr(_loader, "LIBRARY_PATH", os.path.join(tmp_path, "absent.so"))
    monkeypatch.setattr(_loader, "_state", {"loaded": False, "module": None, "reason": None})
    assert mso.ops.custom_ops_available() is False
    status = mso.ops.custom_ops_status()
    assert status.startswith("pure TensorFlow (custom ops not loaded: NotFoundError")


@pytest.mark.parametrize("value", ["", "0"])
def test_switch_off_values_do_not_disable(monkeypatch, tmp_path, value):
    monkeypatch.setenv(_loader.DISABLE_ENV, value)
    monkeypatch.setattr(_loader, "LIBRARY_PATH", os.path.join(tmp_path, "absent.so"))
    monkeypatch.setattr(_loader, "_state", {"loaded": False, "module": None, "reason": None})
    assert "is set" not in mso.ops.custom_ops_status()
