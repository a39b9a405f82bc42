"""The benchmark tables of the docs are those benchmarks/render.py renders from benchmarks/results/."""
import json
import math
import os
import shutil

import pytest

from helpers import REPO_ROOT, benchmark_module

from tf_msopt import _keras_compat as compat

render = benchmark_module("render")
timing = benchmark_module("timing")
RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")


def test_the_docs_tables_match_the_results_files():
    stale = {os.path.relpath(page, REPO_ROOT): names
             for page, (_, _, names) in render.differences().items() if names}
    assert not stale, f"run `python benchmarks/render.py`: {stale}"
    assert render.main(["--check"]) == 0


def test_every_results_file_is_read_by_a_table_and_every_table_file_exists():
    present = set(os.listdir(RESULTS))
    assert present <= set(render.SOURCES), sorted(present - set(render.SOURCES))
    assert set(render.SOURCES) - set(render.OPTIONAL) <= present


def test_a_convergence_block_not_measured_yet_names_the_command_that_measures_it(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    for name in render.OPTIONAL:
        if (results / name).exists():
            (results / name).unlink()
    text = render.render_convergence_defaults(str(results))
    assert ("not measured yet: run `python benchmarks/convergence.py --block defaults --task "
            "charlm --rounds 3 --out benchmarks/results/convergence_charlm_defaults.json`") in text
    assert "From" not in text
    assert "not measured yet" in render.render_convergence_robustness(str(results))
    assert "--block tuned --task mnist_mlp" in render.render_convergence_grids(str(results))


def _block_file(convergence, path, block, runs, **info):
    convergence.save_results(str(path), {"mlp": {"block": block, "target": 0.97, "seeds": [0, 1, 2],
                                                 "max_epochs": 15, "runs": runs, **info}})


def test_a_grid_where_no_setting_reaches_the_target_has_no_best_setting(tmp_path):
    convergence = render._convergence()
    results = tmp_path / "results"
    results.mkdir()
    never = {"epochs": [math.inf, 4, math.inf], "seconds": [math.inf, 1.0, math.inf]}
    runs = {"Adam": {f"lr={lr}": {"params": {"lr": lr}, **never} for lr in (0.001, 0.01)},
            "Muon": {f"lr={lr}": {"params": {"lr": lr}, "epochs": [3, 3, 3],
                                  "seconds": [1.0] * 3} for lr in (0.001, 0.01)}}
    for task in render.TASKS:
        convergence.save_results(str(results / f"convergence_{task}.json"), {task: {
            "target": 0.97, "seeds": [0, 1, 2], "max_epochs": 15, "runs": runs}})
    text = render.render_convergence_grids(str(results))
    assert "| digits MLP, accuracy 0.97 | Adam | none reaches the target |  | - | 2, none |" in text
    assert "|  | Muon | lr=0.001 | 3, 3, 3 | 3 | 2, edge: lr |" in text


def test_a_heldout_block_without_a_tuned_thor_setting_says_none_reached(tmp_path):
    convergence = render._convergence()
    results = tmp_path / "results"
    results.mkdir()
    never = {"epochs": [math.inf] * 3, "seconds": [math.inf] * 3}
    _block_file(convergence, results / "convergence_mlp_heldout.json", "heldout",
                {convergence.DEFAULT_THOR: {"default": never},
                 "Muon": {"lr=0.001": {"epochs": [8, 7, 9], "seconds": [1.0] * 3}}},
                tuned_best={"Muon": {"setting": "lr=0.001", "median_epochs": 7,
                                     "median_seconds": 1.0}})
    text = render.render_convergence_heldout(str(results))
    none = "none reached the target when tuned"
    assert (f"| digits MLP, accuracy 0.97 | - (-, -, -) | {none} | {none} |  | "
            f"Muon lr=0.001: 8 |") in text


def test_defaults_and_robustness_tables_render_a_measured_block(tmp_path):
    convergence = render._convergence()
    results = tmp_path / "results"
    results.mkdir()

    def setting(epochs, seconds, **params):
        return {"params": params, "epochs": epochs, "seconds": seconds}

    _block_file(convergence, results / "convergence_mlp_defaults.json", "defaults", {
        "THOR": {"default": setting([3, 4, 3], [1.0, 1.2, 1.1])},
        "Adam": {"default": setting([5, 6, 5], [1.5, 1.6, 1.4])},
        "Muon": {"default": setting([4, 4, 4], [2.0, 2.0, 2.0])},
        "SGD-momentum": {"default": setting([math.inf] * 3, [math.inf] * 3)},
        "Adam-THOR-rate": {"default": setting([4, 4, 5], [1.2, 1.3, 1.2])}})
    text = render.render_convergence_defaults(str(results))
    row = next(line for line in text.splitlines() if line.startswith("| digits MLP"))
    assert row == ("| digits MLP, accuracy 0.97, not re-timed | 3 (3, 4, 3), 1.10 s | "
                   "5 (5, 6, 5), 1.50 s | 4 (4, 4, 4), 2.00 s | never in 15 | not run | "
                   "4 (4, 4, 5), 1.20 s | 0.75x epochs, 0.55x s of Muon |")
    points = {f"lr x{a} damping x{b}": setting([2, 2, 2] if b != "3" else [math.inf] * 3,
                                               [1.0] * 3, lr_scale=s)
              for a, s in (("1/3", 1 / 3), ("1", 1.0), ("3", 3.0)) for b in ("1/3", "1", "3")}
    _block_file(convergence, results / "convergence_mlp_robustness.json", "robustness",
                {"THOR": points, "Adam": {f"lr x{a}": setting([4, 4, math.inf], [1.0] * 3,
                                                             lr_scale=s)
                                          for a, s in (("1/3", 1 / 3), ("1", 1.0), ("3", 3.0))}})
    text = render.render_convergence_robustness(str(results))
    assert ("| digits MLP, accuracy 0.97 in 15 epochs | THOR | 2 / 2 / - | 2 / 2 / - | 2 / 2 / - "
            "| 6 of 9 |") in text
    assert "|  | Adam | 4 | 4 | 4 | 3 of 3 |" in text


def test_every_table_is_on_a_page_between_its_markers():
    text = "".join(open(page).read() for page in render.PAGES)
    for name in render.TABLES:
        assert f"<!-- render:{name} -->" in text and f"<!-- /render:{name} -->" in text, name


@pytest.mark.parametrize("name, change", [
    ("thor_step.json", lambda r: r["models"]["mlp"]["ratio_vs_sgd"].update({"thor stale": 1.3})),
    ("roofline.json", lambda r: r["paths"]["addsign"].update(ms=7.5)),
    ("convergence_mlp.json", lambda r: r["tasks"]["mlp"]["runs"]["Adam"]["lr=0.005"].update(
        val_accuracy=[[0.5, 0.98]] * 3, epoch_seconds=[[1.0, 1.0]] * 3)),
])
def test_a_changed_figure_in_a_results_file_shows_as_a_difference(tmp_path, name, change):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    with open(results / name) as f:
        payload = json.load(f)
    change(payload)
    with open(results / name, "w") as f:
        json.dump(payload, f)
    stale = [names for _, _, names in render.differences(str(results)).values() if names]
    assert stale, name


def test_rendering_rewrites_only_the_marked_blocks():
    text = "before\n<!-- render:loss_scale_step -->\nold table\n<!-- /render:loss_scale_step -->\nafter\n"
    rendered = render.render_page(text)
    assert rendered.startswith("before\n<!-- render:loss_scale_step -->\n| case |")
    assert rendered.endswith("<!-- /render:loss_scale_step -->\nafter\n")
    assert "old table" not in rendered
    assert render.render_page(rendered) == rendered
    with pytest.raises(KeyError):
        render.render_page("<!-- render:nothing -->\n<!-- /render:nothing -->")


def test_out_replaces_the_file_and_names_the_machine(tmp_path, capsys):
    path = str(tmp_path / "sub" / "result.json")
    timing.emit({"benchmark": "x", "value": 1, "machine": timing.machine()}, path)
    timing.emit({"benchmark": "x", "value": 2}, path)
    with open(path) as f:
        assert json.load(f) == {"benchmark": "x", "value": 2}
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"benchmark": "x", "value": 2}
    machine = timing.machine()
    assert machine["cpus"] == os.cpu_count() and machine["cpu"]
    assert machine["onednn"] is compat.onednn_enabled()


@pytest.mark.parametrize("onednn, said", [(False, ", oneDNN's kernels off"), (True, ""),
                                          (None, "")])
def test_machine_line_says_when_onednn_was_off(onednn, said):
    """An AVX2 CPU runs Eigen's kernels unless asked otherwise: the line says so (files from
    before the field, None here, ran where TensorFlow's default is oneDNN's)."""
    machine = {"cpu": "AMD EPYC (Zen 3), AVX2", "cpus": 2, "tensorflow": "2.21.0"}
    if onednn is not None:
        machine["onednn"] = onednn
    assert render.machine_line({"machine": machine}, files=["x.json"]) == (
        f"\nFrom `benchmarks/results/x.json`; 2-core AMD EPYC (Zen 3), AVX2, TensorFlow "
        f"2.21.0{said}.\n")


def test_machine_line_names_each_machine_after_its_files():
    intel = {"machine": {"cpu": "Intel Xeon, AVX-512", "cpus": 2, "tensorflow": "2.21.0"}}
    amd = {"machine": {"cpu": "AMD EPYC (Zen 5), AVX-512", "cpus": 2, "tensorflow": "2.21.0"}}
    assert render.machine_line(intel, amd, intel, files=["a.json", "b.json", "c.json"]) == (
        "\nFrom `benchmarks/results/a.json`, `benchmarks/results/c.json`: 2-core Intel Xeon, "
        "AVX-512, TensorFlow 2.21.0; `benchmarks/results/b.json`: 2-core AMD EPYC (Zen 5), "
        "AVX-512, TensorFlow 2.21.0.\n")
    assert render.machine_line(intel, intel, files=["a.json", "b.json"]) == (
        "\nFrom `benchmarks/results/a.json`, `benchmarks/results/b.json`; 2-core Intel Xeon, "
        "AVX-512, TensorFlow 2.21.0.\n")


def test_machine_line_takes_the_note_where_no_cpu_was_recorded():
    payload = {"note": "THOR on a 2-core Intel Xeon; Adam on a 2-core AMD EPYC",
               "machine": {"cpus": 2, "processor": "x86_64", "tensorflow": "2.21.0"}}
    assert render.machine_line(payload, files=["x.json"]) == (
        "\nFrom `benchmarks/results/x.json`; THOR on a 2-core Intel Xeon; Adam on a 2-core AMD "
        "EPYC, TensorFlow 2.21.0.\n")


def test_every_benchmark_offers_out():
    folder = os.path.join(REPO_ROOT, "benchmarks")
    scripts = [name for name in os.listdir(folder) if name.endswith(".py")
               and name not in ("timing.py", "targets.py", "render.py", "render_common.py",
                                "render_distributed.py", "render_batch_scaling.py",
                                "kfac_jax_baseline.py")]
    for name in scripts:
        with open(os.path.join(folder, name)) as f:
            assert '"--out"' in f.read(), name


def test_the_cuda_inverse_table_refuses_a_run_whose_checks_failed(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    assert "| 128, 1024 | " in render.render_thor_inverse_cuda(str(results))
    payload = json.loads((results / "thor_inverse_cuda.json").read_text())
    payload["checks_passed"] = False
    (results / "thor_inverse_cuda.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="failed its checks"):
        render.render_thor_inverse_cuda(str(results))
