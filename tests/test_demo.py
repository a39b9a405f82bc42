"""The demo (`make demo` = `python -m tf_msopt compare`) and the examples run for real."""
import os
import runpy
import sys

import numpy as np
import pytest

from tf_msopt import __main__ as cli
from tf_msopt.compare import compare

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compare_trains_every_optimizer_and_writes_the_plot(tmp_path, capsys):
    results = compare(epochs=2, output_dir=str(tmp_path), verbose=0)
    assert set(results) == {"AddSign", "PowerSign", "SGD-momentum", "Adam"}
    for name, r in results.items():
        assert len(r["loss"]) == 2 and np.all(np.isfinite(r["loss"])), name
        assert r["loss"][1] < r["loss"][0], name
        assert r["val_accuracy"][-1] > 0.5, name  # 10 classes: chance is 0.1
    out = capsys.readouterr().out
    assert "optimizer" in out and "val acc" in out and "AddSign" in out
    assert os.path.getsize(os.path.join(tmp_path, "loss_curves.png")) > 10_000


def test_cli_rejects_unknown_command(capsys):
    assert cli.main(["nope"]) == 2
    assert "usage: python -m tf_msopt" in capsys.readouterr().err


@pytest.mark.parametrize("script, expected", [
    ("sign_optimizers.py", "final validation accuracy"),
    ("lars_large_batch.py", "final test accuracy"),
])
def test_example_runs(script, expected, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--epochs", "3"])
    runpy.run_path(os.path.join(REPO_ROOT, "examples", script), run_name="__main__")
    assert expected in capsys.readouterr().out
