"""Renders the benchmark tables of docs/performance.md, docs/convergence.md,
docs/thor_measurements.md, docs/adam_offload.md, docs/distributed.md and docs/thor_monitor.md
from benchmarks/results/, and docs/thor.md's table of THOR's options from their entries in the
code.

Each table sits between two marker comments in a page::

    <!-- render:NAME -->
    ...the table, written by this script...
    <!-- /render:NAME -->

and ``TABLES`` says which results files NAME is rendered from. Every file in
``benchmarks/results/`` is the ``--out`` (or ``--save``) file of one benchmark run; re-running
that benchmark with ``--out`` replaces it, and this script then rewrites the tables. A file of
``OPTIONAL`` (a convergence task or block not measured yet) may be missing: its table then
says so, with the command that measures it.

    python benchmarks/render.py           # rewrite the tables in place
    python benchmarks/render.py --check   # exit 1, naming the tables, if a page differs

It draws docs/images/batch_scaling.svg too (benchmarks/render_batch_scaling.py), whose
metadata names the digest of the results it shows: ``--check`` compares that digest.
"""
import argparse
import json
import math
import os
import re
import sys
from statistics import median

from render_common import RESULTS, _ms, _x, load, machine_line, table
from render_batch_scaling import (
    BATCH_SCALING_FILES, PLOT, batch_scaling_plot_is_current, draw_batch_scaling_plot,
    render_batch_scaling)
from render_distributed import DISTRIBUTED_TABLES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PAGES = [os.path.join(ROOT, "docs", page)
         for page in ("performance.md", "convergence.md", "thor.md", "thor_measurements.md",
                      "adam_offload.md", "distributed.md", "thor_monitor.md")]
TASKS = ("mlp", "cnn", "mnist1d", "transformer")
# benchmarks/convergence.py's tasks measured after the first four, and its blocks beside the
# tuned grids: their files are optional until measured.
NEW_TASKS = ("mnist_mlp", "charlm", "rnn", "autoencoder")
ALL_TASKS = TASKS + NEW_TASKS
BLOCKS = ("defaults", "robustness", "heldout")
# The THOR configuration docs/thor_measurements.md lists for each task (benchmarks/convergence.py's
# THOR_CONFIGS): the first THOR row of each task in the re-timed table.
RECOMMENDED = {"mlp": "THOR-klclip", "cnn": "THOR", "mnist1d": "THOR-expand",
               "transformer": "THOR-expand", "mnist_mlp": "THOR-output-side",
               "charlm": "THOR-graft"}
MARKER = re.compile(r"(<!-- render:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /render:(?P=name) -->)",
                    re.S)


def _convergence():
    """benchmarks/convergence.py (imports TensorFlow: loaded only for its tables)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import convergence
    return convergence


# --- speed benchmarks

ROOFLINE_NAMES = {
    "addsign": "AddSign (one-pass kernel)",
    "powersign": "PowerSign (one-pass kernel)",
    "lars_sgd_momentum": "LARS(SGD momentum), two-pass kernel",
    "keras_sgd_momentum": "Keras SGD(momentum=0.9), for comparison",
    "adam_offload_host_update": "AdamOffload host update (in place)",
    "adam_offload_host_update_bf16": "AdamOffload host update, bfloat16 moments",
    "adam_offload_host_update_int8": "AdamOffload host update, int8 moments",
    "thor_stale_precondition": "THOR stale-step preconditioning `A_inv g G_inv` "
                               "(784-512-512-10 MLP, blocks of 128)",
    "thor_inverse": "THOR block inverse, 64 blocks of 128, custom op",
}


def render_roofline(results):
    r = load("roofline.json", results)
    rows = []
    for key, p in r["paths"].items():
        size = (f"{p['bytes'] / 1e6:.0f} MB" if p["bound"] == "memory"
                else f"{p['flops'] / 1e6:.0f} MFLOP")
        achieved = (f"{p['gb_per_s']:.1f} GB/s" if p["bound"] == "memory"
                    else f"{p['gflop_per_s']:.1f} GFLOP/s")
        rows.append([ROOFLINE_NAMES.get(key, key), size, f"{p['ms']:.2f}", achieved, p["bound"],
                     f"{p['fraction_of_limit']:.0%}"])
    return (f"Bandwidth {r['bandwidth_gb_per_s']:.1f} GB/s, float32 matmul "
            f"{r['matmul_gflop_per_s']:.0f} GFLOP/s; {r['params'] / 1e6:g}M float32 parameters "
            f"in {r['variables']} variables.\n\n"
            + table(["path", "MB (or MFLOP) per step", "ms/step", "achieved", "bound",
                     "fraction of the limit"], rows)
            + machine_line(r, files=["roofline.json"]))


UPDATE_NAMES = {
    "keras_sgd_momentum": "Keras SGD(momentum=0.9)",
    "raw_apply_momentum": "raw `ResourceApplyMomentum`",
    "keras_adam": "Keras Adam",
    "addsign": "AddSign (one-pass kernel)",
    "addsign_tf_kernel": "AddSign, TensorFlow's `ResourceApplyAddSign`",
    "addsign_jit": "AddSign, `jit_compile=True`",
    "powersign": "PowerSign (one-pass kernel)",
    "powersign_jit": "PowerSign, `jit_compile=True`",
    "lars_sgd_momentum": "LARS(SGD momentum), two-pass kernel (default)",
    "lars_sgd_momentum_pure_tf": "LARS(SGD momentum), pure-TF path "
                                 "(`TF_MSOPT_DISABLE_CUSTOM_OPS=1`)",
    "lars_sgd_momentum_jit": "LARS(SGD momentum), `jit_compile=True`",
    "lars_adam": "LARS(Adam)",
}


def render_update_step(results):
    r = load("update_step.json", results)
    ms = r["ms_per_step"]
    sgd, raw = ms["keras_sgd_momentum"], ms["raw_apply_momentum"]
    rows = [[UPDATE_NAMES.get(k, k), f"{v:.2f}", _x(v / sgd), _x(v / raw)] for k, v in ms.items()]
    return (table(["case", "ms/step", "vs Keras SGD(momentum=0.9)", "vs `ResourceApplyMomentum`"],
                  rows) + machine_line(r, files=["update_step.json"]))


ADAM_NAMES = {
    "adam_offload": "AdamOffload (variables on the host, one in-place pass, 28 bytes/param)",
    "adam_offload_bf16": "the same, `state_dtype=\"bfloat16\"` (20 bytes/param)",
    "adam_offload_int8": "the same, `state_dtype=\"int8\"` (16 bytes/param)",
    "adam_offload_host_kernel": "AdamOffload host kernel alone (m, v, delta: 24 bytes/param)",
    "adam_offload_delta_path": "AdamOffload, offload path (state on a second logical CPU)",
    "adam_offload_pure_tf": "AdamOffload pure-TF path",
    "keras_adam": "Keras Adam",
    "raw_apply_adam": "`ResourceApplyAdam`",
    "torch_adam_fused": "`torch.optim.Adam(fused=True)`",
    "deepspeed_cpu_adam": "DeepSpeed `DeepSpeedCPUAdam`",
}


def _adam_columns(files, results):
    payloads = [load(f, results) for f in files]
    columns = []
    for payload in payloads:
        for threads, run in payload["runs"].items():
            label = "2 threads" if threads == "default" else f"{threads} thread"
            columns.append((f"{run['variables']} variables, {label}", run))
    cases = [case for case in ADAM_NAMES if any(case in run["ms_per_step"] for _, run in columns)]
    rows = [[ADAM_NAMES[case]] + [f"{run['ms_per_step'][case]:.2f}"
                                  if case in run["ms_per_step"] else "" for _, run in columns]
            for case in cases]
    for case, moments in (("adam_offload", ""), ("adam_offload_bf16", ", bfloat16 moments"),
                          ("adam_offload_int8", ", int8 moments")):
        if any(case in run["ms_per_step"] for _, run in columns):
            rows.append([f"AdamOffload{moments} throughput vs DeepSpeed"] + [
                _x(run["ms_per_step"]["deepspeed_cpu_adam"] / run["ms_per_step"][case])
                if case in run["ms_per_step"] else "" for _, run in columns])
    notes = payloads[0]["runs"]["default"].get("notes", {})
    versions = ", ".join(f"{k} {v}" for k, v in notes.items())
    return (table(["case (ms/step)"] + [label for label, _ in columns], rows)
            + machine_line(*payloads, files=files).rstrip("\n").rstrip(".")
            + (f"; {versions}.\n" if versions else ".\n"))


def _adam_table(*files):
    """The TABLES entry of the AdamOffload benchmark's runs in ``files``, one column each."""
    return (lambda results: _adam_columns(list(files), results)), list(files)


THOR_MODELS = {
    "mlp": "MLP 784-512-512-10",
    "resnet50": "`keras.applications.ResNet50(weights=None)`, 64x64x3",
    "transformer": "transformer, 2 blocks, MultiHeadAttention 4 heads, width 128, sequence 64",
    "digits-mlp": "digits MLP 64-64-64-10 (`tf-msopt compare`)",
}


def render_thor_step(results):
    r = load("thor_step.json", results)
    rows = []
    for name, m in r["models"].items():
        frequency = m["args"]["frequency"]
        ratio, target = m["ratio_vs_sgd"], m["target"]
        which = "average" if target["case"].startswith("thor F=") else "stale"
        rows.append([THOR_MODELS.get(name, name), m["args"]["batch"], frequency,
                     f"{m['ms_per_step']['sgd momentum']:.3g}",
                     f"{ratio[f'thor F={frequency}']:.3f}x", f"{ratio['thor stale']:.3f}x",
                     f"{which} <= {target['ratio_vs_sgd']}x", "yes" if target["met"] else "**no**"])
    return (table(["model", "batch", "F", "SGD momentum ms/step", "THOR average / SGD",
                   "THOR stale / SGD", "target", "met?"], rows)
            + machine_line(r, files=["thor_step.json"]))


def render_thor_step_split(results):
    r = load("thor_step_resnet50_split.json", results)
    (name, m), = r["models"].items()
    split = m["split_ms"]
    return (f"{THOR_MODELS.get(name, name)}, batch {m['args']['batch']}, "
            f"F={m['args']['frequency']}, ms:\n\n"
            + table(list(split), [[f"{ms:.1f}" for ms in split.values()]])
            + machine_line(r, files=["thor_step_resnet50_split.json"]))


DEFAULT_STEP_FILES = ["default_step.json", "default_step_resnet50.json"]


def render_default_step(results):
    payloads = [load(f, results) for f in DEFAULT_STEP_FILES]
    rows = []
    for m in (m for r in payloads for m in r["models"].values()):
        ms, gflop = m["ms_per_step"], m["parts_gflop"]
        title = m["title"] if "batch" in m["title"] else f"{m['title']}, batch {m['batch']}"
        rows.append([title, _ms(ms["adam"]), _ms(ms["thor default"]),
                     _x(m["ratio_vs_adam"]["thor default"]), f"{m['model_gflop']:.3g}"]
                    + [f"{gflop[part]:.3g} / {m['parts_ms'][part]:.1f}" for part in gflop]
                    + [_x(m["flops_added_vs_model"])])
    return (table(["model", "Adam ms/step", "default THOR ms/step", "THOR / Adam",
                   "model GFLOP", "rotation GFLOP / ms", "statistics GFLOP / ms",
                   "refresh GFLOP / ms (per step)", "THOR's FLOPs / model's"], rows)
            + machine_line(*payloads, files=DEFAULT_STEP_FILES))


def render_default_step_levers(results):
    r = load("default_step_resnet50_levers.json", results)
    (m,) = r["models"].values()
    rows = []
    for case, ms in m["ms_per_step"].items():
        gflop = m["parts_gflop"].get(case)
        label = ("`keras.optimizers.Adam()`" if gflop is None else "the default"
                 if case == "thor default" else f"`{case.removeprefix('thor ')}`")
        rows.append([label, f"{ms:.0f}", _x(m["ratio_vs_adam"][case])]
                    + ([f"{value:.3g}" for value in gflop.values()] if gflop else ["", "", ""]))
    return (f"{m['title']}, batch {m['batch']}, {m['rounds']} rounds; the model's forward "
            f"and backward pass {m['model_gflop']:.3g} GFLOP:\n\n"
            + table(["THOR", "ms/step", "/ Adam", "rotation GFLOP", "statistics GFLOP",
                     "refresh GFLOP (per step, every factor)"], rows)
            + machine_line(r, files=["default_step_resnet50_levers.json"]))


def render_thor_inverse(results):
    files = ["thor_inverse.json", "thor_inverse_float64.json"]
    payloads = [load(f, results) for f in files]
    rows = []
    for p in payloads:
        for blocks, b in p["batches"].items():
            ms = b["ms"]
            rows.append([f"{p['dtype']}, {blocks}", f"{ms['op']:.2f}",
                         f"{ms['tf_cholesky_solve']:.2f}", f"{ms['tf_inv']:.2f}",
                         f"{b['speedup_vs_best_tf']:.1f}x"])
    return (table(["dtype, blocks", "op ms", "`cholesky` + `cholesky_solve` ms",
                   "`tf.linalg.inv` ms", "speed-up"], rows)
            + machine_line(*payloads, files=files))


def render_xla_refresh(results):
    r = load("xla_refresh.json", results)
    factors = r["ms_per_factor"]
    names = {"eigh": "eigendecomposition (`tf.linalg.eigh`)",
             "inverse": "damped inverse (`tf_msopt.ops.inverse.damped_inverse`)"}
    def ms(value):
        return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"

    rows = [[names[kind], width, ms(plain), ms(factors[kind + " (XLA)"][width]),
             f"{factors[kind + ' (XLA)'][width] / plain:.0f}x"]
            for kind in names for width, plain in factors[kind].items()]
    text = table(["factorisation", "width", "ms per factor", "inside XLA, ms", "XLA / not"],
                 rows)
    if "ms_per_step" in r:
        steps, optimizers = r["ms_per_step"], {"adam": "`keras.optimizers.Adam()`",
                                               "thor default": "`tf_msopt.thor(model)`"}
        text += f"\n{r['model']}:\n\n" + table(
            ["train step", "ms/step", "/ Adam without XLA"],
            [[optimizers[case.removesuffix(" (XLA)")]
              + (", compiled with XLA" if case.endswith(" (XLA)") else ""),
              f"{value:.1f}", _x(value / steps["adam"])] for case, value in steps.items()])
    return text + machine_line(r, files=["xla_refresh.json"])


CUDA_ROUTES = {"cupy_linalg_inv": "`cupy.linalg.inv`",
               "torch_linalg_inv_ex": "`torch.linalg.inv_ex`",
               "torch_cholesky_ex_inverse": "torch `cholesky_ex` + `cholesky_inverse`"}


def render_thor_inverse_cuda(results):
    p = load("thor_inverse_cuda.json", results)
    if not p["checks_passed"]:
        raise ValueError("thor_inverse_cuda.json: the kernel failed its checks")
    rows, errors = [], {}
    for size, batches in p["sizes"].items():
        for blocks, b in batches.items():
            ms = b["ms"]
            rows.append([f"{size}, {blocks}", f"{ms['kernel']:.3f}"]
                        + [f"{ms[route]:.3f}" if route in ms else "" for route in CUDA_ROUTES]
                        + [_x(b["speedup_vs_best_library"]), f"{b['kernel_tflops']:.1f}",
                           f"{b['percent_of_fp32_peak']:.1f}%"])
    for key, error in p["max_rel_error"].items():
        dtype = key.split()[0]
        errors[dtype] = max(errors.get(dtype, 0.0), error)
    worst = ", ".join(f"{dtype} {error:.1e}" for dtype, error in errors.items())
    return (table(["block size, blocks", "kernel ms"]
                  + [f"{name} ms" for name in CUDA_ROUTES.values()]
                  + ["speed-up over the fastest library", "kernel TFLOP/s",
                     "of FP32 peak"], rows)
            + f"\nLargest error relative to the largest entry of `numpy.linalg.inv`: {worst}; "
            f"NaN and indefinite blocks flagged and zeroed. Medians of {p['loops']} loops of "
            f"{p['repeats']} calls; TFLOP/s count 2 n^3 a block.\n"
            f"From `benchmarks/results/thor_inverse_cuda.json`; {p['gpu']} ({p['arch']}, FP32 "
            f"peak {p['fp32_peak_tflops']:.1f} TFLOP/s at {p['sm_clock_mhz']:.0f} MHz).\n")


def render_conditional_cost(results):
    r = load("conditional_cost.json", results)
    rows = []
    for case, us in r["us_per_step"].items():
        count = case.split()[0]
        per = r["us_per_conditional"].get(count)
        rows.append([case, f"{us:.0f}", f"{r['ratio'][case]:.3f}x",
                     "" if per is None else f"{per:.1f}"])
    return (table(["step with", "µs/step", "ratio", "µs per conditional"], rows)
            + machine_line(r, files=["conditional_cost.json"]))


def render_loss_scale_step(results):
    r = load("loss_scale_step.json", results)
    rows = [[f"MLP {'with' if r['mirrored'] else 'without'} MirroredStrategy, hidden "
             f"{r['hidden']}, batch {r['batch']}",
             f"{r['ratios']['mso_vs_keras_loss_scale']:.3f}x", "<= 1.02x"]]
    return (table(["case", "`mso.LossScaleOptimizer` / Keras' `LossScaleOptimizer`", "target"],
                  rows) + machine_line(r, files=["loss_scale_step.json"]))


def render_thor_monitor(results):
    r = load("thor_monitor.json", results)
    names = {"without": "without the monitor", "monitor": "`Monitor()`",
             "monitor_every_10": f"`Monitor(update_freq={r['update_freq']})`"}
    base = r["ms_per_epoch"]["without"]
    rows = [[names[case], f"{ms:.0f}", f"{ms / base:.3f}x"]
            for case, ms in r["ms_per_epoch"].items()]
    return (table([f"MLP 784-{r['hidden']}-{r['hidden']}-10, `mso.thor(model)`, batch "
                   f"{r['batch']}, {r['steps_per_epoch']} batches", "ms per epoch",
                   "vs without"], rows) + machine_line(r, files=["thor_monitor.json"]))


# --- convergence

STATE_DTYPE_RUNS = {"AdamOffload": "float32", "AdamOffload-bf16": "bfloat16",
                    "AdamOffload-int8": "int8"}


def render_state_dtype(results):
    """The character LM's validation loss per epoch: float32 AdamOffload's range over its
    seeds beside each compact state's median over its seeds."""
    name = results_file("charlm", "state_dtype")
    r = load(name, results)["tasks"]["charlm"]
    curves = {dtype: next(iter(r["runs"][run].values()))["val_loss"]
              for run, dtype in STATE_DTYPE_RUNS.items()}
    epochs = min(len(curve) for seeds in curves.values() for curve in seeds)
    rows, inside = [], {"bfloat16": 0, "int8": 0}
    for epoch in range(epochs):
        low, high = (f(curve[epoch] for curve in curves["float32"]) for f in (min, max))
        row = [epoch + 1, f"{low:.4f} to {high:.4f}"]
        for dtype in inside:
            value = median(curve[epoch] for curve in curves[dtype])
            inside[dtype] += low <= value <= high
            row.append(f"{value:.4f}" + (" (below)" if value < low else
                                         " (above)" if value > high else ""))
        rows.append(row)
    seeds = ", ".join(str(seed) for seed in r["seeds"])
    return (table(["epoch", "float32: range over the seeds", "bfloat16: median",
                   "int8: median"], rows)
            + f"\nSeeds {seeds}; batch {r['batch_size']}. Inside float32's range at "
            + f"{inside['bfloat16']} of {epochs} epochs (bfloat16) and {inside['int8']} of "
            + f"{epochs} (int8).\n" + machine_line(r, files=[name]))


def results_file(task, block="tuned"):
    """The file of ``benchmarks/results/`` that holds convergence.py's ``block`` of ``task``."""
    return f"convergence_{task}.json" if block == "tuned" else f"convergence_{task}_{block}.json"


def measure_command(task, block="tuned"):
    """The command that writes :func:`results_file`: the defaults re-timed in interleaved
    rounds (a tuned block is re-timed ``--from`` its file afterwards; robustness counts
    epochs only)."""
    rounds = " --rounds 3" if block == "defaults" else ""
    return (f"python benchmarks/convergence.py --block {block} --task {task}{rounds} "
            f"--out benchmarks/results/{results_file(task, block)}")


def _measured(convergence, tasks, block, columns, rows):
    """The ``(task, info)`` of ``tasks`` that were measured; for each other one a row of
    ``columns`` cells joins ``rows``: the task, then the command that measures it."""
    for task, info in tasks.items():
        if info is None:
            rows.append([_title(convergence, task),
                         f"not measured yet: run `{measure_command(task, block)}`",
                         *[""] * (columns - 2)])
        else:
            yield task, info


def _tasks(results, tasks=TASKS, block="tuned"):
    """convergence.py and ``{task: its results, or None where the file is missing}``."""
    convergence = _convergence()
    found = {}
    for task in tasks:
        path = os.path.join(results, results_file(task, block))
        found[task] = convergence.load_results([path])[task] if os.path.exists(path) else None
    return convergence, found


def _title(convergence, task, info=None):
    target = info["target"] if info else convergence.DEFAULT_TARGETS[task]
    metric = "loss" if convergence.target_metric(task) == "val_loss" else "accuracy"
    return f"{convergence.TASKS[task]['title']}, {metric} {target:g}"


def _from_files(tasks, block="tuned"):
    measured = {task: info for task, info in tasks.items() if info}
    return machine_line(*measured.values(), files=[results_file(task, block)
                                                   for task in measured]) if measured else ""


def _epochs(values, show):
    return ", ".join(show(e) for e in values)


def render_convergence_grids(results):
    convergence, tasks = _tasks(results, ALL_TASKS)
    rows = []
    for task, info in _measured(convergence, tasks, "tuned", 6, rows):
        runs = info["runs"]
        order = convergence._ordered(runs)
        best = convergence.best_settings({name: runs[name] for name in order})
        for i, name in enumerate(order):
            label, epochs, _ = best[name]
            if math.isfinite(epochs):
                per_seed = _epochs(runs[name][label]["epochs"], convergence._show)
                edge = convergence.edge_of_grid(runs[name], label)
                where = "edge: " + ", ".join(edge) if edge else "inside"
            else:    # no best setting: none reaches the target on two seeds
                label, per_seed, where = "none reaches the target", "", "none"
            rows.append([_title(convergence, task, info) if i == 0 else "", name, label,
                         per_seed, convergence._show(epochs), f"{len(runs[name])}, {where}"])
    return (table(["task, target", "optimizer", "best setting", "epochs per seed",
                   "median epochs", "settings (best setting)"], rows) + _from_files(tasks))


def render_convergence_retimed(results):
    convergence, tasks = _tasks(results, ALL_TASKS)
    tasks = {task: info for task, info in tasks.items() if info and info.get("retimed")}
    rows = []
    for task, info in tasks.items():
        retimed = info["retimed"]
        seconds = convergence.retimed_seconds(retimed)
        epochs = {name: median(r["epochs"][0]) for name, r in retimed.items()}
        first_order = [n for n in convergence.FIRST_ORDER if n in retimed]
        by_seconds = min(first_order, key=lambda n: seconds[n][1])
        fewest = min(epochs[n] for n in first_order)
        thor = sorted((n for n in retimed if n.startswith("THOR")),
                      key=lambda n: n != RECOMMENDED.get(task))
        rounds = len(next(iter(retimed.values()))["seconds"])

        def cell(name):
            return (f"{seconds[name][1]:.2f} ({convergence._show(epochs[name])})"
                    if name in retimed else "")

        for i, name in enumerate(thor):
            per_round = [a / b for a, b in zip(seconds[name][0], seconds[by_seconds][0])]
            rows.append([
                f"{convergence.TASKS[task]['title']}, {rounds} rounds" if i == 0 else "",
                name, f"{convergence._show(epochs[name])} "
                      f"({_epochs(retimed[name]['epochs'][0], convergence._show)})",
                f"{seconds[name][1]:.2f}",
                *([cell("SGD-momentum"), cell("Adam"), cell("Muon"), cell("kfac-jax")]
                  if i == 0 else ["", "", "", ""]),
                f"{_x(epochs[name] / fewest)}, {_x(seconds[name][1] / seconds[by_seconds][1])} "
                f"({min(per_round):.2f}-{max(per_round):.2f}x)"])
    return (table(["task", "THOR configuration", "epochs (seeds)", "THOR s",
                   "SGD-momentum s (epochs)", "Adam s (epochs)", "Muon s (epochs)",
                   "kfac-jax s (epochs)",
                   "THOR vs best first-order: epochs, seconds (per round)"], rows)
            + machine_line(*tasks.values(),
                           files=[f"convergence_{task}.json" for task in tasks]))


def render_convergence_half(results):
    convergence, tasks = _tasks(results)
    rows = []
    for task, info in tasks.items():
        runs = info["runs"]
        best = convergence.best_settings(runs)
        within = convergence.epochs_for_half(best)
        cells = []
        for name in (RECOMMENDED[task], "kfac-jax", "Adam"):
            values = convergence.best_accuracy_by_epoch(runs[name], within)
            verdict = " (within reach)" if median(values) >= info["target"] else ""
            prefix = f"{name} " if name == RECOMMENDED[task] else ""
            cells.append(prefix + ", ".join(f"{v:.3f}" for v in values) + verdict)
        rows.append([convergence.TASKS[task]["title"],
                     f"{info['target']:g} in {within} epochs", *cells])
    return table(["task", "needed", "THOR, recommended configuration", "kfac-jax", "Adam"], rows)


DEFAULTS_ORDER = ("THOR", "Adam", "Muon", "SGD-momentum", "kfac-jax", "Adam-THOR-rate")
DEFAULTS_HEADERS = {"kfac-jax": "kfac-jax (adaptive)", "Adam-THOR-rate": "Adam at THOR's rate"}


def _seconds(convergence, info):
    """``({optimizer: median seconds}, how they were timed)``: the re-timed rounds' where the
    file has them, else the block's own runs'."""
    if info.get("retimed"):
        seconds = convergence.retimed_seconds(info["retimed"])
        rounds = len(next(iter(info["retimed"].values()))["seconds"])
        return {name: overall for name, (_, overall) in seconds.items()}, f"{rounds} rounds"
    best = convergence.best_settings(info["runs"])
    return {name: b[2] for name, b in best.items()}, "not re-timed"


def render_convergence_defaults(results):
    convergence, tasks = _tasks(results, ALL_TASKS, "defaults")
    rows = []
    for task, info in _measured(convergence, tasks, "defaults", len(DEFAULTS_ORDER) + 2, rows):
        best = convergence.best_settings(info["runs"])
        seconds, timed = _seconds(convergence, info)

        def cell(name):
            if name not in best:
                return "not run"
            epochs = best[name][1]
            if math.isinf(epochs):
                return f"never in {info['max_epochs']}"
            per_seed = _epochs(info["runs"][name][best[name][0]]["epochs"], convergence._show)
            text = f"{convergence._show(epochs)} ({per_seed})"
            return f"{text}, {seconds[name]:.2f} s" if name in seconds else text

        rivals = [n for n in ("Adam", "Muon")
                  if n in best and n in seconds and math.isfinite(best[n][1])]
        versus = ""
        if "THOR" in best and math.isfinite(best["THOR"][1]) and rivals and "THOR" in seconds:
            rival = min(rivals, key=lambda n: (best[n][1], seconds.get(n, math.inf)))
            versus = (f"{_x(best['THOR'][1] / best[rival][1])} epochs, "
                      f"{_x(seconds['THOR'] / seconds[rival])} s of {rival}")
        rows.append([f"{_title(convergence, task, info)}, {timed}",
                     *[cell(name) for name in DEFAULTS_ORDER], versus])
    return (table(["task, target, timing",
                   *[DEFAULTS_HEADERS.get(name, name) for name in DEFAULTS_ORDER],
                   "THOR vs the better of Adam and Muon"], rows)
            + _from_files(tasks, "defaults"))


LOWEST_LOSS_FILE = "convergence_autoencoder_curves.json"


def render_convergence_lowest_loss(results):
    """The autoencoder's defaults run for all their epochs (``--target 0``): each one's lowest
    validation loss on each seed, with its epoch: how far each gets, target or not."""
    convergence = _convergence()
    path = os.path.join(results, LOWEST_LOSS_FILE)
    if not os.path.exists(path):
        return ("not measured yet: run `python benchmarks/convergence.py --block defaults "
                f"--task autoencoder --target 0 --out benchmarks/results/{LOWEST_LOSS_FILE}`\n")
    info = convergence.load_results([path])["autoencoder"]
    rows = []
    for name in (name for name in DEFAULTS_ORDER if name in info["runs"]):
        lowest = [min((loss, epoch + 1) for epoch, loss in enumerate(curve))
                  for curve in next(iter(info["runs"][name].values()))["val_loss"]]
        rows.append([DEFAULTS_HEADERS.get(name, name),
                     ", ".join(f"{loss:.4f} ({epoch})" for loss, epoch in lowest),
                     f"{median(loss for loss, _ in lowest):.4f}"])
    return (table(["optimizer", f"lowest validation loss in {info['max_epochs']} epochs, seeds "
                   f"{', '.join(str(seed) for seed in info['seeds'])} (its epoch)", "median"],
                  rows)
            + machine_line(info, files=[LOWEST_LOSS_FILE]))


def render_convergence_robustness(results):
    convergence, tasks = _tasks(results, ALL_TASKS, "robustness")
    scales = [convergence._scale_label(s) for s in convergence.ROBUSTNESS_SCALES]
    rows = []
    for task, info in _measured(convergence, tasks, "robustness", len(scales) + 3, rows):
        found = convergence.robustness(info["runs"])
        for i, (name, r) in enumerate(found.items()):
            by_lr = {}
            for label, epochs in r["median_epochs"].items():
                by_lr.setdefault(info["runs"][name][label]["params"]["lr_scale"], []).append(
                    convergence._show(epochs))
            title = f"{_title(convergence, task, info)} in {info['max_epochs']} epochs"
            rows.append([title if i == 0 else "", name,
                         *[" / ".join(values) for values in by_lr.values()],
                         f"{r['reached']} of {r['points']}"])
    return (table(["task, target", "optimizer", *[f"lr x{s}" for s in scales],
                   "points reaching the target"], rows)
            + _from_files(tasks, "robustness"))


#: The heldout table's THOR cells where no tuned THOR setting reached the target.
NO_TUNED_THOR = "none reached the target when tuned"


def render_convergence_heldout(results):
    convergence, tasks = _tasks(results, ALL_TASKS, "heldout")
    show = convergence._show
    rows = []
    for task, info in _measured(convergence, tasks, "heldout", 6, rows):
        found = convergence.heldout(info)
        runs = info["runs"]

        def setting(entry, per_seed=True):
            text = f"{entry['optimizer']} {entry['setting']}: {show(entry['epochs'])}"
            epochs = runs[entry["optimizer"]][entry["setting"]]["epochs"]
            return f"{text} ({_epochs(epochs, show)})" if per_seed else text

        chosen = found.get("chosen")
        best = found.get("best_thor")
        rows.append([
            _title(convergence, task, info),
            f"{show(found['default'])} "
            f"({_epochs(runs[convergence.DEFAULT_THOR]['default']['epochs'], show)})",
            f"{chosen['optimizer']} {chosen['setting']}: {show(chosen['tuned_epochs'])} there, "
            f"{show(chosen['epochs'])} here" if chosen else NO_TUNED_THOR,
            setting(best) if best else NO_TUNED_THOR,
            _x(found["default"] / best["epochs"]) if best and math.isfinite(best["epochs"])
            else "",
            setting(found["best_first_order"], False) if "best_first_order" in found else ""])
    seeds = {tuple(info["seeds"]) for info in tasks.values() if info}
    here = ", ".join(str(s) for s in next(iter(seeds))) if len(seeds) == 1 else "held out"
    return (table(["task, target", f"default THOR (seeds {here})",
                   "THOR's best tuned setting (tuned seeds)", "best THOR tuned setting here",
                   "default / it", "best first-order tuned setting here"], rows)
            + _from_files(tasks, "heldout"))


def _options(config):
    if not config:
        return "MindSpore's update (defaults)"
    return "`" + ", ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                           for k, v in config.items()) + "`"


def render_thor_configurations(results):
    convergence, tasks = _tasks(results)
    rows = []
    for task, info in tasks.items():
        name = RECOMMENDED[task]
        runs = info["runs"][name]
        label, epochs, _ = convergence.best_settings({name: runs})[name]
        rows.append([convergence.TASKS[task]["title"], _options(convergence.THOR_CONFIGS[name]),
                     label.replace(" ", ", "), f"{convergence._show(epochs)} "
                     f"({_epochs(runs[label]['epochs'], convergence._show)})"])
    return table(["task", "configuration", "best setting", "median epochs (per seed)"], rows)


def render_thor_arguments(results):
    """THOR's options, from ``tf_msopt.thor.options.OPTIONS`` (no results file)."""
    from tf_msopt.thor.options import arguments_table

    return arguments_table()


TABLES = {  # name: (renderer, the results files it reads)
    "roofline": (render_roofline, ["roofline.json"]),
    "update_step": (render_update_step, ["update_step.json"]),
    "adam_offload_step": _adam_table("adam_offload_step.json", "adam_offload_step_200.json"),
    "adam_offload_step_idle": _adam_table("adam_offload_step_idle.json"),
    "adam_offload_step_zen5": _adam_table("adam_offload_step_zen5.json"),
    "adam_offload_step_zen4": _adam_table("adam_offload_step_zen4.json"),
    "thor_step": (render_thor_step, ["thor_step.json"]),
    "thor_step_split": (render_thor_step_split, ["thor_step_resnet50_split.json"]),
    **DISTRIBUTED_TABLES,
    "default_step": (render_default_step, DEFAULT_STEP_FILES),
    "default_step_levers": (render_default_step_levers, ["default_step_resnet50_levers.json"]),
    "thor_inverse": (render_thor_inverse, ["thor_inverse.json", "thor_inverse_float64.json"]),
    "thor_inverse_cuda": (render_thor_inverse_cuda, ["thor_inverse_cuda.json"]),
    "conditional_cost": (render_conditional_cost, ["conditional_cost.json"]),
    "xla_refresh": (render_xla_refresh, ["xla_refresh.json"]),
    "loss_scale_step": (render_loss_scale_step, ["loss_scale_step.json"]),
    "convergence_lowest_loss": (render_convergence_lowest_loss, [LOWEST_LOSS_FILE]),
    "convergence_grids": (render_convergence_grids, [results_file(task) for task in ALL_TASKS]),
    "convergence_retimed": (render_convergence_retimed, [results_file(task) for task in ALL_TASKS]),
    "convergence_half": (render_convergence_half, [f"convergence_{task}.json" for task in TASKS]),
    "thor_configurations": (render_thor_configurations,
                            [f"convergence_{task}.json" for task in TASKS]),
    "convergence_defaults": (render_convergence_defaults,
                             [results_file(task, "defaults") for task in ALL_TASKS]),
    "convergence_robustness": (render_convergence_robustness,
                               [results_file(task, "robustness") for task in ALL_TASKS]),
    "convergence_heldout": (render_convergence_heldout,
                            [results_file(task, "heldout") for task in ALL_TASKS]),
    "state_dtype": (render_state_dtype, [results_file("charlm", "state_dtype")]),
    "batch_scaling": (render_batch_scaling, BATCH_SCALING_FILES),
    "thor_arguments": (render_thor_arguments, []),
    "thor_monitor": (render_thor_monitor, ["thor_monitor.json"]),
}
OPTIONAL = sorted({results_file(task) for task in NEW_TASKS} | {LOWEST_LOSS_FILE}
                  | {results_file(task, block) for task in ALL_TASKS for block in BLOCKS})
SOURCES = sorted({f for _, files in TABLES.values() for f in files})


def render_page(text, results=RESULTS, cache=None):
    """``text`` with every marked table rendered again; unknown names raise KeyError."""
    cache = {} if cache is None else cache

    def replace(match):
        name = match.group("name")
        if name not in cache:
            cache[name] = TABLES[name][0](results)
        return match.group(1) + cache[name] + match.group(4)

    return MARKER.sub(replace, text)


def differences(results=RESULTS, pages=PAGES):
    """{page: (current text, rendered text, [names of the tables that differ])}; also
    raises when a table of ``TABLES`` is used on no page."""
    cache, found, used = {}, {}, set()
    for page in pages:
        with open(page) as f:
            text = f.read()
        rendered = render_page(text, results, cache)
        old = {m.group("name"): m.group("body") for m in MARKER.finditer(text)}
        new = {m.group("name"): m.group("body") for m in MARKER.finditer(rendered)}
        used.update(old)
        found[page] = (text, rendered, sorted(n for n in old if old[n] != new[n]))
    unused = set(TABLES) - used
    if unused:
        raise ValueError(f"tables on no page: {sorted(unused)}")
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a page's tables differ from the results")
    args = parser.parse_args(argv)
    stale = False
    for page, (text, rendered, names) in differences().items():
        if not names:
            continue
        stale = True
        where = os.path.relpath(page, ROOT)
        if args.check:
            print(f"{where}: out of date with benchmarks/results/: {', '.join(names)}")
        else:
            with open(page, "w") as f:
                f.write(rendered)
            print(f"{where}: rendered {', '.join(names)}")
    if not batch_scaling_plot_is_current(RESULTS):
        stale = True
        if args.check:
            print(f"docs/{PLOT}: out of date with benchmarks/results/")
        else:
            draw_batch_scaling_plot(RESULTS)
            print(f"docs/{PLOT}: drawn")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
