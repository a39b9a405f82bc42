"""The batch-size benchmark: its generated task, its grids, its scoring and its table."""
import json
import math

import keras
import numpy as np
import pytest

import tf_msopt as mso
from helpers import benchmark_module

batch_scaling = benchmark_module("batch_scaling")
render_batch_scaling = benchmark_module("render_batch_scaling")
inf = math.inf


@pytest.fixture
def small_task(monkeypatch):
    task = {**batch_scaling.TASKS["teacher"], "train": 512, "validation": 128}
    monkeypatch.setitem(batch_scaling.TASKS, "teacher", task)
    return task


def test_the_task_is_generated_the_same_every_time_without_near_ties(small_task):
    x_train, x_val, y_train, y_val = batch_scaling.make_teacher_data(small_task)
    again = batch_scaling.make_teacher_data(small_task)
    for a, b in zip((x_train, x_val, y_train, y_val), again):
        np.testing.assert_array_equal(a, b)
    assert x_train.shape == (512, 32) and x_val.shape == (128, 32)
    assert set(np.unique(np.concatenate([y_train, y_val]))) <= set(range(10))
    assert len(np.unique(y_train)) >= 5


def test_each_pass_over_the_data_is_a_new_order_of_every_full_batch():
    x = np.arange(10, dtype="float32")[:, None]
    y = np.arange(10, dtype="int32")
    drawn = [b.numpy() for b, _ in batch_scaling.batches(x, y, 3, seed=0, steps=7)]
    assert len(drawn) == 7 and all(len(b) == 3 for b in drawn)
    first_pass, second_pass = np.concatenate(drawn[:3]), np.concatenate(drawn[3:6])
    assert len(set(first_pass[:, 0])) == 9 and len(set(second_pass[:, 0])) == 9
    assert not np.array_equal(first_pass, second_pass)
    again = [b.numpy() for b, _ in batch_scaling.batches(x, y, 3, seed=0, steps=7)]
    np.testing.assert_array_equal(np.concatenate(drawn), np.concatenate(again))


def test_grids_centre_thor_on_its_default_and_first_order_on_the_square_root_rule():
    task = batch_scaling.TASKS["teacher"]
    points = batch_scaling.settings(task, ["THOR", "Adam"], 1024)
    thor = {label: rate for name, label, rate in points if name == "THOR"}
    default = mso.thor.DEFAULTS["learning_rate"]
    assert thor["default"] == default
    assert sorted(thor.values()) == pytest.approx([default / 3, default, default * 3])
    adam = sorted(rate for name, _, rate in points if name == "Adam")
    centre = task["rate_centres"]["Adam"] * 2     # sqrt(1024 / 256)
    assert adam == pytest.approx([centre / 3, centre, centre * 3])


def test_mindspore_thor_is_centred_on_its_tuned_rate_at_every_batch():
    task = batch_scaling.TASKS["mnist1d"]
    for batch in (64, 4096):
        rates = sorted(rate for _, _, rate in batch_scaling.settings(task, ["THOR-MS"], batch))
        assert rates == pytest.approx([0.05 / 3, 0.05, 0.15])

    def config(make):
        keras.backend.clear_session()     # the same layer names
        model = batch_scaling.make_teacher_student(batch_scaling.TASKS["teacher"])
        return {k: v for k, v in make(model).get_config().items() if k != "name"}

    measured = config(lambda model: batch_scaling.make_optimizer("THOR-MS", model, 0.05))
    assert measured == config(lambda model: mso.thor(model, learning_rate=0.05, damping=0.3,
                                                     momentum=0.9, frequency=10))
    assert measured != config(lambda model: mso.thor(model, learning_rate=0.05))


class _Model:
    stop_training = False


def test_a_run_stops_once_it_predicts_one_class_for_the_patience():
    stop = batch_scaling.StopWhenCollapsed(chance=0.1, margin=0.02, patience=3)
    model = _Model()
    stop.set_model(model)
    accuracies = [0.5, 0.11, 0.12, 0.5, 0.11, 0.12, 0.115]
    for epoch, accuracy in enumerate(accuracies):
        assert not model.stop_training, epoch
        stop.on_epoch_end(epoch, {"val_accuracy": accuracy})
    assert model.stop_training         # the last three are within 0.02 of the share 0.1


def test_steps_and_time_run_to_the_first_validation_at_the_target():
    run = {"val_accuracy": [0.5, 0.91, 0.89, 0.95], "epoch_seconds": [3.0, 0.5, 0.5, 0.5]}
    assert batch_scaling.to_target(run, 0.9, eval_every=10) == (20, 3.5)
    assert batch_scaling.to_target(run, 0.96, eval_every=10) == (inf, inf)


def test_the_critical_batch_is_where_the_next_batch_stops_paying():
    # 256 -> 1024 cuts 200 / 70 = 2.9x >= 1.6 ** 2; 1024 -> 4096 only 1.75x.
    assert batch_scaling.critical_batch({64: 800, 256: 200, 1024: 70, 4096: 40}) == (1024, False)
    assert batch_scaling.critical_batch({128: 100, 256: 70}) == (128, False)   # 1.43 < 1.6
    assert batch_scaling.critical_batch({64: inf, 256: 100, 1024: 30}) == (1024, True)


def _point(lr, steps, seconds):
    return {"lr": lr, "steps": steps, "seconds": seconds, "val_accuracy": []}


RESULTS = {
    "256": {"THOR": {"lr=0.00167": _point(0.00167, [90, 80, 100], [4.0, 3.0, 5.0]),
                     "default": _point(0.005, [60, 70, 50], [3.0, 3.5, 2.5]),
                     "lr=0.015": _point(0.015, [inf, 40, inf], [inf, 2.0, inf])},
            "Adam": {"lr=0.001": _point(0.001, [300, 200, 250], [3.0, 2.0, 2.5]),
                     "lr=0.003": _point(0.003, [120, 140, 130], [1.2, 1.4, 1.3])},
            "LARS": {"lr=0.5": _point(0.5, [100, 110, 150], [1.0, 1.1, 1.5]),
                     "lr=1.5": _point(1.5, [inf, inf, inf], [inf, inf, inf])}},
    "1024": {"THOR": {"default": _point(0.005, [20, 20, 30], [2.0, 2.0, 3.0])},
             "Adam": {"lr=0.006": _point(0.006, [90, 100, 80], [2.0, 2.0, 2.0])},
             "LARS": {"lr=1.0": _point(1.0, [80, 80, 80], [2.5, 2.5, 2.5])}},
}


def test_summary_compares_the_default_thor_with_the_best_first_order_runs():
    info = batch_scaling.summary(RESULTS)
    row = info["batches"]["256"]
    assert row["best"]["THOR"] == {"setting": "default", "steps": 60, "seconds": 3.0,
                                   "edge": False}
    assert row["best"]["LARS"]["setting"] == "lr=0.5" and row["best"]["LARS"]["edge"]
    assert row["best"]["Adam"]["steps"] == 130
    # Steps against the fewest (LARS, 110), time against the fastest (LARS, 1.1 s).
    assert row["ratios"]["steps"] == pytest.approx(60 / 110)
    assert row["ratios"]["seconds"] == pytest.approx(3.0 / 1.1)
    assert row["ratios"]["default_over_thor_best"] == 1.0
    assert info["critical"]["THOR"] == {"batch": 1024, "at_least": True}     # 60 / 20 >= 2.56
    assert info["critical"]["LARS"] == {"batch": 256, "at_least": False}     # 110 / 80


def test_the_table_renders_each_batch_and_the_critical_batches(tmp_path):
    for name in render_batch_scaling.BATCH_SCALING_FILES:
        payload = {"task": {"title": f"task of {name}"}, "target": 0.9, "seeds": [0, 1, 2],
                   "max_steps": 1000, "eval_every": 10, "machine": {"cpu": "a CPU", "cpus": 2},
                   "results": RESULTS}
        (tmp_path / name).write_text(json.dumps(payload))
    text = render_batch_scaling.render_batch_scaling(str(tmp_path))
    for name in render_batch_scaling.BATCH_SCALING_FILES:
        assert f"task of {name}, target validation accuracy 0.9, at most 1000 steps" in text
    assert ("| 256 | 60 / 3.0 s | 60 / 3.0 s (default) |  | 130 / 1.3 s (lr=0.003, edge) |  | "
            "110 / 1.1 s (lr=0.5, edge) | 0.55x / 2.73x |") in text
    assert "Critical batch sizes (steps to target cut by 1.6x per doubling): " in text
    assert "Adam 256" in text and "LARS 256" in text and "THOR >= 1024" in text


@pytest.mark.slow
def test_a_short_run_saves_what_it_tabulates_again(small_task, tmp_path, capsys):
    path = tmp_path / "r.json"
    # Target 0: every run reaches it at its first validation.
    assert batch_scaling.main(["--batches", "32,64", "--seeds", "0", "--optimizers",
                               "THOR,Adam", "--max-steps", "4", "--eval-every", "2",
                               "--target", "0", "--save", str(path)]) == 0
    measured = capsys.readouterr().out
    saved = json.loads(path.read_text())
    assert set(saved["results"]) == {"32", "64"}
    for batch in ("32", "64"):
        assert set(saved["results"][batch]) == {"THOR", "Adam"}
        for point in saved["results"][batch]["THOR"].values():
            assert point["steps"] == [2] and point["seconds"][0] > 0
    assert batch_scaling.main(["--from", str(path)]) == 0
    again = capsys.readouterr().out
    assert measured.splitlines()[-1] == again.splitlines()[-1]


class FakeRunner:
    """Runs nothing: a run's steps are ``steps(rate)`` and its seconds ``steps / 10 + seed``."""

    seeds = (0, 1)

    def __init__(self, steps):
        self.steps, self.calls = steps, []

    def run(self, name, label, rate, batch, seed, into):
        self.calls.append((batch, name, label, seed))
        batch_scaling.record(into, name, label, rate, self.steps(rate),
                             self.steps(rate) / 10 + seed, [])


def test_widening_runs_beyond_an_edge_until_the_best_rate_is_inside():
    runner = FakeRunner(lambda rate: 100 * abs(math.log(rate / 0.01)) + 50)   # best at 0.01
    results = {"256": {}}
    for rate in (0.3, 0.9, 2.7):
        runner.run("Adam", f"lr={rate:.3g}", rate, 256, 0, results["256"])
        runner.run("Adam", f"lr={rate:.3g}", rate, 256, 1, results["256"])
    batch_scaling.widen(runner, results, times=5)
    rates = sorted(p["lr"] for p in results["256"]["Adam"].values())
    # 0.3 -> 0.1 -> 0.0333 -> 0.0111 -> 0.0037: the last is worse, so 0.0111 is inside.
    assert rates == pytest.approx([0.3 / 81, 0.3 / 27, 0.3 / 9, 0.1, 0.3, 0.9, 2.7])
    assert batch_scaling.best(results["256"]["Adam"])[0] == "lr=0.0111"
    assert all(len(p["steps"]) == 2 for p in results["256"]["Adam"].values())


def test_retiming_interleaves_each_batchs_best_settings_and_the_default_thor():
    runner = FakeRunner(lambda rate: 10)
    results = {"256": {"THOR": {"default": _point(0.005, [60, 60], [1.0, 1.0]),
                                "lr=0.015": _point(0.015, [40, 40], [1.0, 1.0])},
                       "Adam": {"lr=0.003": _point(0.003, [80, 80], [9.0, 9.0])},
                       "LARS": {"lr=0.5": _point(0.5, [inf, inf], [inf, inf])}}}
    retimed = batch_scaling.retime(runner, results, rounds=2)    # LARS missed: not re-timed
    cases = [call[1:3] for call in runner.calls if call[3] == 0]
    assert sorted(cases[:3]) == sorted(cases[3:]) == [
        ("Adam", "lr=0.003"), ("THOR", "default"), ("THOR", "lr=0.015")]
    assert cases[:3] != cases[3:]                     # another order in the second round
    assert len(retimed["256"]["Adam"]["lr=0.003"]["seconds"]) == 4   # 2 rounds x 2 seeds
    row = batch_scaling.summary(results, retimed)["batches"]["256"]
    assert row["best"]["Adam"]["seconds"] == 1.5      # the re-timed median, not 9.0
    assert row["best"]["Adam"]["steps"] == 80         # steps stay the grid's
    assert row["default THOR"]["seconds"] == 1.5


def test_from_a_file_only_the_optimizers_it_lacks_are_measured(tmp_path, monkeypatch):
    runner = FakeRunner(lambda rate: 30)

    def make_runner(task, *args):
        runner.task = task
        return runner

    monkeypatch.setattr(batch_scaling, "Runner", make_runner)
    source, out = tmp_path / "in.json", tmp_path / "out.json"
    task = batch_scaling.task_record({**batch_scaling.TASKS["teacher"], "name": "teacher"})
    # A file from before THOR-MS was measured.
    task["rate_centres"] = {n: r for n, r in task["rate_centres"].items() if n != "THOR-MS"}
    source.write_text(json.dumps({"task": task, "target": 0.9, "seeds": [0, 1],
                                  "max_steps": 100, "eval_every": 10,
                                  "rate_scaling": {"Adam": 0.5}, "results": RESULTS}))
    assert batch_scaling.main(["--from", str(source), "--optimizers", "THOR-MS,Adam",
                               "--save", str(out)]) == 0
    assert {call[1] for call in runner.calls} == {"THOR-MS"}
    assert len(runner.calls) == 2 * 3 * 2        # batches x grid x seeds
    saved = json.loads(out.read_text())
    for batch, row in RESULTS.items():
        assert sorted(p["lr"] for p in saved["results"][batch]["THOR-MS"].values()) == (
            pytest.approx([0.05 / 3, 0.05, 0.15]))
        assert saved["results"][batch]["Adam"] == json.loads(json.dumps(row["Adam"]))
    assert saved["task"]["rate_centres"]["THOR-MS"] == 0.05
    assert saved["rate_scaling"]["THOR-MS"] == 0.0


def _write_results(directory, steps_at_256):
    results = json.loads(json.dumps(RESULTS))
    results["256"]["Adam"]["lr=0.003"]["steps"] = steps_at_256
    for name in render_batch_scaling.BATCH_SCALING_FILES:
        (directory / name).write_text(json.dumps(
            {"task": {"title": name}, "target": 0.9, "results": results}))


def test_the_plot_is_drawn_alike_from_alike_results_and_flagged_when_they_change(tmp_path):
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    _write_results(results, [120, 140, 130])
    assert not render_batch_scaling.batch_scaling_plot_is_current(str(results), str(docs))
    render_batch_scaling.draw_batch_scaling_plot(str(results), str(docs))
    plot = docs / render_batch_scaling.PLOT
    drawn = plot.read_bytes()
    assert drawn.startswith(b"<?xml") and b"<svg" in drawn
    assert render_batch_scaling.batch_scaling_plot_is_current(str(results), str(docs))
    render_batch_scaling.draw_batch_scaling_plot(str(results), str(docs))
    assert plot.read_bytes() == drawn
    _write_results(results, [120, 150, 130])
    assert not render_batch_scaling.batch_scaling_plot_is_current(str(results), str(docs))
