"""The default THOR's train-step time against Keras' Adam, and what each of its parts costs.

The models are two of ``benchmarks/convergence.py``'s tasks, where the default's epochs cost
the most: ``charlm`` (the character-level transformer, batch 32 x 64 characters) and
``mnist_mlp`` (784-256-128-10, batch 64). Each case is the compiled train step of
``benchmarks/thor_step.py`` on the same model and random batch (nothing is downloaded); the
cases run interleaved, round after round, each round a multiple of the default's
``frequency`` consecutive steps, and the median per-step time of each is reported:

- ``adam``: ``keras.optimizers.Adam()``;
- ``thor default``: ``tf_msopt.thor(model)``: the factors' statistics every step, new
  eigenvectors every ``frequency`` steps;
- ``no refresh``: the default with no new eigenvectors in the timed window;
- ``rotation only``: neither statistics nor new eigenvectors: the gradient rotated into the
  eigenbases, Adam's second moment there, rotated back, grafted and averaged.

The parts of a default step follow by difference: the rotation (``rotation only - adam``),
the statistics (``no refresh - rotation only``) and the eigenvectors (``thor default - no
refresh``, each refresh spread over its ``frequency`` steps). The last line printed is JSON
(``--out FILE`` also writes it to FILE, replacing it).

    python benchmarks/default_step.py [--model charlm|mnist_mlp|all] [--rounds R] [--out FILE]
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_msopt as mso  # noqa: E402
from convergence import build_model  # noqa: E402
from thor_step import Case  # noqa: E402
from timing import emit, machine, time_cases  # noqa: E402

NEVER = 10**9     # a frequency no timed step reaches (step 0, in the warm-up, refreshes)
# Per model: input shape, classes, batch, whether every position has a label, and the title.
MODELS = {
    "charlm": ((64,), 96, 32, True, "character LM (2 pre-LN blocks, width 128, MLP 512), "
                                    "batch 32 x 64"),
    "mnist_mlp": ((784,), 10, 64, False, "MNIST MLP 784-256-128-10, batch 64"),
}
PARTS = {"rotation": ("rotation only", "adam"),
         "statistics": ("no refresh", "rotation only"),
         "eigenvectors": ("thor default", "no refresh")}


def cases():
    """The four cases' optimizer factories."""
    def thor(**kwargs):
        return lambda model: mso.thor(model, **kwargs)
    return {"adam": lambda model: keras.optimizers.Adam(),
            "thor default": thor(),
            "no refresh": thor(frequency=NEVER),
            "rotation only": thor(frequency=NEVER, statistics_frequency=NEVER)}


def run_model(name, rounds, repeats):
    input_shape, classes, batch, per_position, title = MODELS[name]
    rng = np.random.default_rng(0)
    if per_position:
        x = rng.integers(0, classes, size=(batch, *input_shape)).astype("int32")
        y = rng.integers(0, classes, size=(batch, *input_shape)).astype("int32")
    else:
        x = rng.random((batch, *input_shape), dtype=np.float32)
        y = rng.integers(0, classes, size=batch).astype("int32")
    steps = {case: Case(lambda: build_model(name, input_shape, classes), factory, x, y).step()
             for case, factory in cases().items()}
    frequency = mso.thor.DEFAULTS["frequency"]
    times = time_cases(steps, rounds, frequency * repeats, warmup=frequency)
    ms = {case: 1e3 * seconds for case, seconds in times.items()}
    parts = {part: ms[minuend] - ms[subtrahend]
             for part, (minuend, subtrahend) in PARTS.items()}
    print(f"\n== {name}: {title}, default frequency {frequency}, {rounds} rounds")
    for case, value in ms.items():
        print(f"{case:>14} {value:9.2f} ms/step {value / ms['adam']:6.2f}x Adam")
    for part, value in parts.items():
        print(f"{part:>14} {value:9.2f} ms/step")
    return {"title": title, "batch": batch, "frequency": frequency, "rounds": rounds,
            "ms_per_step": ms, "ratio_vs_adam": {c: v / ms["adam"] for c, v in ms.items()},
            "parts_ms": parts}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=[*MODELS, "all"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2,
                        help="frequency-long runs per case and round")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()
    names = list(MODELS) if args.model == "all" else [args.model]
    emit({"benchmark": "default_step", "machine": machine(), "defaults": mso.thor.DEFAULTS,
          "models": {name: run_model(name, args.rounds, args.repeats) for name in names}},
         args.out)


if __name__ == "__main__":
    main()
