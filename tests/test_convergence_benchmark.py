"""The convergence benchmark's scoring: first epoch at the target, medians over seeds, ratios."""
import math
import os

from helpers import REPO_ROOT, benchmark_module

convergence = benchmark_module("convergence")


def test_to_target_takes_the_first_epoch_reaching_it():
    history = {"val_accuracy": [0.9, 0.98, 0.97, 0.99], "seconds": [1.5, 2.0, 2.5, 3.0]}
    assert convergence.to_target(history, 0.98) == (2, 2.0)
    assert convergence.to_target(history, 0.995) == (math.inf, math.inf)


def test_to_target_sums_the_epoch_times_including_the_first():
    history = {"val_accuracy": [0.9, 0.98, 0.99], "epoch_seconds": [1.5, 0.5, 0.5]}
    assert convergence.to_target(history, 0.98) == (2, 2.0)
    assert convergence.to_target(history, 0.9) == (1, 1.5)


def test_best_setting_is_the_lowest_median_and_a_miss_counts_as_infinite():
    inf = math.inf
    results = {
        "THOR": {"a": {"epochs": [18, 4, 5], "seconds": [9.0, 2.5, 2.8]},
                 "b": {"epochs": [3, inf, inf], "seconds": [1.0, inf, inf]}},
        "SGD-momentum": {"c": {"epochs": [inf, inf, inf], "seconds": [inf, inf, inf]}},
        "Adam": {"d": {"epochs": [inf, 7, 7], "seconds": [inf, 2.4, 2.6]},
                 "e": {"epochs": [20, 10, 7], "seconds": [5.0, 3.0, 2.0]}},
    }
    best = convergence.best_settings(results)
    assert best["THOR"] == ("a", 5, 2.8)
    assert best["Adam"] == ("d", 7, 2.6)
    assert best["SGD-momentum"][1] == inf
    ratios = convergence.ratios(best)   # SGD never reached the target: Adam is the reference
    assert math.isclose(ratios["THOR"]["epochs_vs_best_first_order"], 5 / 7)
    assert math.isclose(ratios["THOR"]["seconds_vs_best_first_order"], 2.8 / 2.6)
    assert "epochs_vs_kfac_jax" not in ratios["THOR"]
    assert convergence.ratios({"THOR": ("a", inf, inf), "Adam": ("d", 7, 2.6)}) == {}


def test_ratios_cover_every_thor_configuration_and_kfac_jax():
    best = {"THOR": ("a", 10, 5.0), "THOR-pi": ("b", 3, 2.0), "Adam": ("c", 6, 2.5),
            "SGD-momentum": ("d", 8, 2.2), "kfac-jax": ("e", 4, 9.0)}
    ratios = convergence.ratios(best)
    assert set(ratios) == {"THOR", "THOR-pi"}
    assert math.isclose(ratios["THOR-pi"]["epochs_vs_best_first_order"], 3 / 6)
    assert math.isclose(ratios["THOR-pi"]["seconds_vs_best_first_order"], 2.0 / 2.2)
    assert math.isclose(ratios["THOR-pi"]["epochs_vs_kfac_jax"], 3 / 4)


def test_edge_of_grid_names_the_axes_where_the_best_setting_is_extreme():
    settings = {f"lr={lr} damping={d}": {"params": {"lr": lr, "damping": d}}
                for lr in (0.01, 0.02, 0.03) for d in (0.1, 0.3, 1.0)}
    assert convergence.edge_of_grid(settings, "lr=0.02 damping=0.3") == []
    assert convergence.edge_of_grid(settings, "lr=0.03 damping=0.3") == ["lr"]
    assert convergence.edge_of_grid(settings, "lr=0.01 damping=1.0") == ["lr", "damping"]
    rates = {f"lr={lr}": {"params": {"lr": lr}} for lr in (0.1, 0.2)}
    assert convergence.edge_of_grid(rates, "lr=0.2") == ["lr"]


def test_every_optimizer_grid_has_a_setting_inside_it():
    for task in convergence.TASKS:
        for name, settings in convergence.grids(task, frequency=10).items():
            table = {label: {"params": params} for label, params, _ in settings}
            assert any(not convergence.edge_of_grid(table, label) for label in table), (
                task, name)


def test_a_widened_grid_is_the_union_of_its_products(monkeypatch):
    """A list of (learning rates, dampings) products runs each setting once, in order."""
    monkeypatch.setitem(convergence.THOR_GRIDS["THOR"], "mlp",
                        [((0.02, 0.03), (0.1, 0.3)), ((0.01, 0.02), (0.03, 0.1))])
    labels = [label for label, _, _ in convergence.grids("mlp", frequency=10)["THOR"]]
    assert labels == ["lr=0.01 damping=0.03", "lr=0.01 damping=0.1", "lr=0.02 damping=0.03",
                      "lr=0.02 damping=0.1", "lr=0.02 damping=0.3", "lr=0.03 damping=0.1",
                      "lr=0.03 damping=0.3"]


def _documented_results():
    """The results docs/performance.md tabulates: one file per task, every task."""
    paths = [os.path.join(REPO_ROOT, "benchmarks", "results", f"convergence_{task}.json")
             for task in convergence.TASKS]
    tasks = convergence.load_results(paths)
    assert set(tasks) == set(convergence.TASKS)
    return tasks


def test_documented_results_are_the_declared_grids_with_best_settings_inside():
    """docs/performance.md's tables come from exactly the settings of THOR_GRIDS,
    FIRST_ORDER_RATES and KFAC_JAX_GRIDS, so that a regeneration reruns what is shown, and
    no best setting lies on its grid's edge."""
    for task, info in _documented_results().items():
        declared = {name: {label for label, _, _ in settings}
                    for name, settings in convergence.grids(task, frequency=10).items()}
        declared["kfac-jax"] = {f"lr={lr} damping={damping}" for lr, damping in
                                convergence.grid_settings(convergence.KFAC_JAX_GRIDS[task])}
        for name, settings in info["runs"].items():
            assert set(settings) == declared[name], (task, name)
            label = convergence.best_settings({name: settings})[name][0]
            assert convergence.edge_of_grid(settings, label) == [], (task, name, label)


def test_saved_results_tabulate_again_with_misses_as_infinite(tmp_path, capsys):
    inf = math.inf
    runs = {"THOR": {"lr=0.1 damping=0.3": {
                "params": {"lr": 0.1, "damping": 0.3}, "epochs": [3, inf, 4],
                "seconds": [1.0, inf, 1.2], "val_accuracy": [[0.99], [0.5, 0.6], [0.9, 0.99]],
                "epoch_seconds": [[1.0], [1.0, 0.5], [0.7, 0.5]]}},
            "Adam": {"lr=0.01": {
                "params": {"lr": 0.01}, "epochs": [8, 8, 9], "seconds": [2.0, 2.1, 2.2],
                "val_accuracy": [[0.99]] * 3, "epoch_seconds": [[2.0]] * 3}}}
    path = str(tmp_path / "r.json")
    convergence.save_results(path, {"mlp": {"target": 0.97, "seeds": [0, 1, 2],
                                            "thor_frequency": 11, "runs": runs}})
    tasks = convergence.load_results([path])
    assert tasks["mlp"]["runs"]["THOR"]["lr=0.1 damping=0.3"]["epochs"] == [3, inf, 4]
    summary = convergence.report(tasks)
    assert summary["mlp"]["best"]["THOR"]["median_epochs"] == 4
    assert summary["mlp"]["ratios"]["THOR"]["epochs_vs_best_first_order"] == 0.5
    out = capsys.readouterr().out
    assert "| THOR | lr=0.1 damping=0.3 | 3, -, 4 | 4 | 1.20 | inside, 1 settings |" in out
    assert "WARNING" not in out                  # a grid of one setting has no edge


def test_best_accuracy_by_epoch_bounds_every_setting_per_seed():
    settings = {"a": {"val_accuracy": [[0.90, 0.95, 0.97], [0.80, 0.96], [0.91, 0.92, 0.99]]},
                "b": {"val_accuracy": [[0.93, 0.94], [0.97], [0.85, 0.95]]}}
    # Seed 1's run "b" stopped at the target after one epoch: its last accuracy counts.
    assert convergence.best_accuracy_by_epoch(settings, 1) == [0.93, 0.97, 0.91]
    assert convergence.best_accuracy_by_epoch(settings, 2) == [0.95, 0.97, 0.95]
    assert convergence.best_accuracy_by_epoch(settings, 3) == [0.97, 0.97, 0.99]


def test_epochs_for_half_rounds_down_from_the_best_first_order_optimizer():
    inf = math.inf
    assert convergence.epochs_for_half({"Adam": ("a", 7, 2.0), "SGD-momentum": ("b", 5, 1.0),
                                        "THOR": ("c", 1, 9.0)}) == 2
    assert convergence.epochs_for_half({"Adam": ("a", 6, 2.0),
                                        "SGD-momentum": ("b", inf, inf)}) == 3
    assert convergence.epochs_for_half({"Adam": ("a", inf, inf)}) is None


def test_report_says_whether_half_the_epochs_is_within_reach_of_the_grid(capsys):
    def setting(accuracies):
        epochs = [convergence.first_reaching(a, 0.97) for a in accuracies]
        epochs = [math.inf if e is None else e + 1 for e in epochs]
        return {"epochs": epochs, "seconds": [1.0 if math.isfinite(e) else math.inf
                                              for e in epochs],
                "val_accuracy": accuracies, "epoch_seconds": [[0.5] * len(a)
                                                              for a in accuracies]}
    runs = {"THOR": {"x": setting([[0.96, 0.97], [0.96, 0.95, 0.97], [0.9, 0.96, 0.97]])},
            "Adam": {"y": setting([[0.9, 0.95, 0.96, 0.97]] * 3)}}
    summary = convergence.report({"mlp": {"target": 0.97, "seeds": [0, 1, 2], "runs": runs}})
    reach = summary["mlp"]["best_accuracy_by_epoch"]
    assert reach == {"epochs": 2, "THOR": [0.97, 0.96, 0.96], "Adam": [0.95, 0.95, 0.95]}
    out = capsys.readouterr().out
    assert "0.97 within 2 epoch(s)" in out
    assert "THOR: 0.970, 0.960, 0.960 (median 0.960: out of reach)" in out


def test_retime_interleaves_the_best_settings_in_balanced_orders(monkeypatch, tmp_path):
    """Each round runs every optimizer's best setting (one that reaches the target) once, in
    the next of the balanced orders; the re-timed ratio uses the rounds' medians."""
    inf = math.inf
    results = {
        "THOR": {"good": {"epochs": [2, 3, 3], "seconds": [1.0, 1.1, 1.2]},
                 "bad": {"epochs": [9, 9, 9], "seconds": [3.0, 3.0, 3.0]}},
        "Adam": {"a": {"epochs": [5, 5, 5], "seconds": [1.5, 1.5, 1.5]}},
        "SGD-momentum": {"never": {"epochs": [inf] * 3, "seconds": [inf] * 3}},
    }
    calls, seconds = [], {"THOR": [0.9, 1.1, 1.0], "Adam": [1.2, 1.6, 1.0]}

    def trainer(name, label):
        def train(data, weights, epochs, batch, seed):
            calls.append((name, label, seed))
            per_round = seconds[name][sum(c[0] == name for c in calls[:-1]) // 3]
            return {"val_accuracy": [0.99], "epoch_seconds": [per_round]}
        return train

    monkeypatch.setattr(convergence, "_prepare", lambda task, seeds, batch: (
        {s: None for s in seeds}, {s: None for s in seeds}, 20))
    monkeypatch.setattr(convergence, "_runners", lambda task, target, frequency, names: {
        name: [(label, {}, trainer(name, label)) for label in results[name]] for name in names})
    retimed = convergence.retime("mlp", 0.97, [0, 1, 2], 25, 64, 10, results, rounds=3)
    assert set(retimed) == {"THOR", "Adam"}                  # SGD never reached the target
    assert retimed["THOR"]["setting"] == "good"
    assert {label for _, label, _ in calls} == {"good", "a"}
    order = [name for name, _, seed in calls if seed == 0]
    assert order == ["THOR", "Adam", "Adam", "THOR", "THOR", "Adam"]
    assert retimed["Adam"]["seconds"] == [[1.2] * 3, [1.6] * 3, [1.0] * 3]
    summary = convergence.report_retimed(retimed)
    assert summary["seconds"]["THOR"]["median"] == 1.0
    assert summary["seconds_vs_best_first_order"] == {"THOR": round(1.0 / 1.2, 3)}
    path = str(tmp_path / "r.json")
    convergence.save_results(path, {"mlp": {"target": 0.97, "seeds": [0, 1, 2], "runs": results,
                                            "retimed": retimed}})
    assert convergence.load_results([path])["mlp"]["retimed"] == retimed


def test_retime_without_a_setting_at_the_target_runs_nothing():
    inf = math.inf
    results = {"THOR": {"x": {"epochs": [inf] * 3, "seconds": [inf] * 3}}}
    assert convergence.retime("mlp", 0.97, [0, 1, 2], 25, 64, 10, results, rounds=3) == {}
    assert convergence.report({"mlp": {"target": 0.97, "runs": results,
                                       "retimed": {}}})["mlp"]["retimed"] is None


def test_rounds_from_saved_results_retime_only_the_named_optimizers(monkeypatch, tmp_path):
    runs = {name: {"s": {"params": {}, "epochs": [3, 3, 3], "seconds": [1.0, 1.0, 1.0],
                         "val_accuracy": [[0.9, 0.95, 0.99]] * 3}}
            for name in ("THOR", "Adam", "SGD-momentum")}
    path = str(tmp_path / "r.json")
    convergence.save_results(path, {"mlp": {"target": 0.97, "seeds": [0, 1, 2], "max_epochs": 25,
                                            "batch_size": 64, "thor_frequency": 11,
                                            "runs": runs}})
    retimed = []

    def fake_retime(task, target, seeds, max_epochs, batch_size, frequency, results, rounds):
        retimed.append(sorted(results))
        return {}

    monkeypatch.setattr(convergence, "retime", fake_retime)
    convergence.main(["--from", path, "--rounds", "2", "--optimizers", "THOR,Adam",
                      "--plot", ""])
    convergence.main(["--from", path, "--rounds", "2", "--plot", ""])
    assert retimed == [["Adam", "THOR"], ["Adam", "SGD-momentum", "THOR"]]
