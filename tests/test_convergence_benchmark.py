"""The convergence benchmark's scoring: first epoch at the target, medians over seeds, ratios."""
import importlib.util
import math
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "convergence", os.path.join(REPO_ROOT, "benchmarks", "convergence.py"))
convergence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convergence)


def test_to_target_takes_the_first_epoch_reaching_it():
    history = {"val_accuracy": [0.9, 0.98, 0.97, 0.99], "seconds": [1.5, 2.0, 2.5, 3.0]}
    assert convergence.to_target(history, 0.98) == (2, 2.0)
    assert convergence.to_target(history, 0.995) == (math.inf, math.inf)


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
    assert math.isclose(ratios["thor_epochs_vs_best_first_order"], 5 / 7)
    assert math.isclose(ratios["thor_seconds_vs_best_first_order"], 2.8 / 2.6)
    assert convergence.ratios({"THOR": ("a", inf, inf), "Adam": ("d", 7, 2.6)}) == {}
