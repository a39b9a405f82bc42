"""benchmarks/default_step.py times what its cases say: the default step, one without new
eigenvectors, and one without statistics either."""
import keras
import numpy as np

from helpers import benchmark_module, curvature_variables

default_step = benchmark_module("default_step")


def test_the_cases_leave_out_the_refresh_and_the_statistics():
    def make_model():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3, activation="softmax")])
    rng = np.random.default_rng(0)
    x = rng.random((16, 5), dtype=np.float32)
    y = rng.integers(0, 3, size=16).astype("int32")
    changed = {}
    for name, factory in default_step.cases().items():
        case = default_step.Case(make_model, factory, x, y)
        step = case.step()
        step()      # step 0 computes statistics and eigenvectors in every THOR case
        if name == "adam":
            continue
        groups = (curvature_variables(case.optimizer, "a_average"),
                  curvature_variables(case.optimizer, "g_eigenvectors"))
        before = [[v.numpy() for v in group] for group in groups]
        for _ in range(10):    # steps 1-10: step 10 is the default's next refresh
            step()
        changed[name] = tuple(
            any(not np.array_equal(old, v.numpy()) for old, v in zip(values, group))
            for values, group in zip(before, groups))
    # (statistics changed, eigenvectors changed)
    assert changed == {"thor default": (True, True), "no refresh": (True, False),
                       "rotation only": (False, False)}
