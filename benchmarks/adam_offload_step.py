"""AdamOffload's host update against other CPU Adam implementations, in one process.

Every case applies one Adam step to N float32 parameters split over V variables,
all on the CPU: AdamOffload with the compiled kernel (variables on the host: one
fused pass updating m, v and w), AdamOffload's offload path (state on a second
logical CPU standing for the host, variables on the first: the kernel returns
delta and ``w += delta`` runs on the variables' device), the host's share of
that path alone (the kernel computing m, v and delta), AdamOffload's pure-TF
path, ``keras.optimizers.Adam``, TensorFlow's fused ``ResourceApplyAdam``
kernel, and, when installed, DeepSpeed's ``DeepSpeedCPUAdam`` and
``torch.optim.Adam(fused=True)``; and AdamOffload's in-place step with its
moments stored in bfloat16 and in int8 (``state_dtype``), whose rows also
give the bytes a parameter each step moves (28 for float32 moments, 20 for
bfloat16, about 16 for int8) and the bandwidth that achieves. Cases run interleaved, round after round
(medians reported), so machine noise hits them alike. The last line printed is
JSON (``--out FILE`` also writes it to FILE, replacing the file).

    python benchmarks/adam_offload_step.py [--params 10000000] [--variables 10] [--rounds 15]
                                           [--threads both|default|N] [--idle-ms MS]
                                           [--torch-site DIR]

``--idle-ms`` sleeps before every timed step (untimed): the cadence of a real offload, where
the host waits while the accelerator runs the forward and backward pass, so each step
starts with cold thread pools and caches instead of right after the previous step.

``--threads`` sets TensorFlow's and PyTorch's thread counts alike: ``default``
(their own, one per core), a number, or ``both`` (the default: the script runs
itself once with the default thread count and once with one thread, each in a
fresh process since thread pools are fixed at start-up, and prints both tables
and a combined JSON line). On a shared machine ``--threads 1`` is the steadier
comparison: DeepSpeed's OpenMP loop slows down many times over when another
process takes one of its cores, TensorFlow's thread pool much less.

DeepSpeed and PyTorch are optional (not dependencies of the package); see
docs/adam_offload.md for installing them beside TensorFlow. They may also live in
a virtual environment of their own (same Python version):
``--torch-site /path/to/venv/lib/python3.X/site-packages`` (or the environment
variable ``TF_MSOPT_BENCH_TORCH_SITE``) appends that folder to ``sys.path``. PyTorch
and DeepSpeed's CPU Adam extension are then loaded before TensorFlow (loading
them after TensorFlow crashes the process), and every case still runs
interleaved in this one process. Without them the benchmark runs the
TensorFlow cases only.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

from timing import emit, machine, time_cases, traced_without_custom_ops

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--variables", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls-per-round", type=int, default=3)
    parser.add_argument("--threads", default="both",
                        help="both (default), default (one per core), or a number")
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="sleep this long before each timed step (an offload's cadence: "
                             "the host waits while the accelerator runs the model)")
    parser.add_argument("--torch-site", default=os.environ.get("TF_MSOPT_BENCH_TORCH_SITE"),
                        help="a site-packages folder holding torch and deepspeed")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    return parser.parse_args()


ARGS = parse_arguments()
THREADS = int(ARGS.threads) if ARGS.threads.isdigit() else None


def make_problem(params, variables):
    size = params // variables
    rng = np.random.default_rng(0)
    values = [rng.normal(size=size).astype(np.float32) for _ in range(variables)]
    grads = [(rng.normal(size=size) * 1e-2).astype(np.float32) for _ in range(variables)]
    return values, grads


def torch_cases(values, grads):
    """DeepSpeed's CPU Adam and PyTorch's fused Adam, when they are installed.

    Built (and stepped once) before TensorFlow is imported: PyTorch, Triton and
    DeepSpeed's extension crash the process when they load after TensorFlow.
    """
    if ARGS.torch_site:
        sys.path.append(ARGS.torch_site)
    cases, notes = {}, {}
    try:
        import torch
    except ImportError as err:
        return cases, {"torch": f"not installed ({err})"}
    if THREADS:
        torch.set_num_threads(THREADS)
    notes["torch"] = f"{torch.__version__}, {torch.get_num_threads()} threads"

    def parameters():
        # Copies into PyTorch's own 64-byte aligned buffers, as a model's parameters and
        # autograd's gradients are (a NumPy copy is 16-byte aligned, or 64 by chance).
        params = [torch.nn.Parameter(torch.tensor(v)) for v in values]
        for param, grad in zip(params, grads):
            param.grad = torch.tensor(grad)
        return params

    fused = torch.optim.Adam(parameters(), lr=1e-3, eps=1e-8, fused=True)
    fused.step()
    cases["torch_adam_fused"] = fused.step
    try:
        import deepspeed as deepspeed_package
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        deepspeed = DeepSpeedCPUAdam(parameters(), lr=1e-3, eps=1e-8, adamw_mode=False)
        deepspeed.step()
        cases["deepspeed_cpu_adam"] = deepspeed.step
        notes["deepspeed"] = deepspeed_package.__version__
    except Exception as err:  # not installed, or its C++ extension failed to build
        notes["deepspeed"] = f"unavailable ({type(err).__name__}: {err})"
    return cases, notes


def without_out(arguments):
    """``arguments`` less ``--out FILE``: the runs of ``run_both`` leave the file to it."""
    kept, skip = [], False
    for argument in arguments:
        if skip:
            skip = False
        elif argument == "--out":
            skip = True
        elif not argument.startswith("--out="):
            kept.append(argument)
    return kept


def run_both():
    """Runs this script with the default thread count, then one thread; prints both."""
    results = {}
    for threads in ("default", "1"):
        command = [sys.executable, os.path.abspath(__file__), *without_out(sys.argv[1:]),
                   "--threads", threads]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        lines = output.strip().splitlines()
        print("\n".join(lines[:-1]) + "\n")
        results[threads] = json.loads(lines[-1])
    summaries = {}
    for name in ("adam_offload", "adam_offload_bf16", "adam_offload_int8"):
        summary = {f"threads_{k}": r["ratios"].get(f"{name}_throughput_vs_deepspeed_cpu_adam")
                   for k, r in results.items()}
        print(f"{name} throughput vs DeepSpeedCPUAdam: " + ", ".join(
            f"{k} {v:.2f}x" if v else f"{k} not measured" for k, v in summary.items()))
        summaries[name] = summary
    emit({"benchmark": "adam_offload_step", "threads": "both", "machine": machine(),
          "vs_deepspeed": summaries.pop("adam_offload"), "vs_deepspeed_by_state": summaries,
          "runs": results}, ARGS.out)


if __name__ == "__main__" and ARGS.threads == "both":
    run_both()
    sys.exit(0)

VALUES, GRADS = make_problem(ARGS.params, ARGS.variables)
TORCH_CASES, TORCH_NOTES = torch_cases(VALUES, GRADS)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
if THREADS:
    tf.config.threading.set_intra_op_parallelism_threads(THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(THREADS)

import tf_msopt as mso  # noqa: E402
from tf_msopt.ops.adam import adam_offload_steps, host_step_bytes  # noqa: E402

#: The in-place AdamOffload cases by state_dtype, and what each must reach against
#: DeepSpeed's float32 CPU Adam (docs/adam_offload.md).
STATE_CASES = {"float32": ("adam_offload", 1.0), "bfloat16": ("adam_offload_bf16", 1.25),
               "int8": ("adam_offload_int8", 1.6)}


def keras_case(make_optimizer, values, grads, device="/CPU:0", pure_tf=False):
    with tf.device(device):
        variables = [keras.Variable(v) for v in values]
        grad_tensors = [tf.constant(g) for g in grads]
    optimizer = make_optimizer()
    optimizer.build(variables)
    step = tf.function(lambda: optimizer.apply(grad_tensors, variables))
    return traced_without_custom_ops(step) if pure_tf else step


def host_kernel_case(values, grads):
    """The host's share of an offloaded step: m, v and delta, without ``w += delta``."""
    moments = [(tf.Variable(tf.zeros_like(v)), tf.Variable(tf.zeros_like(v))) for v in values]
    grad_tensors = [tf.constant(g) for g in grads]

    def step():
        adam_offload_steps([m for m, _ in moments], [v for _, v in moments], grad_tensors, 0.9,
                           0.999, 1e-3, 0.9, 0.999, 1e-8)

    return tf.function(step)


def raw_apply_adam_case(values, grads):
    variables = [tf.Variable(v) for v in values]
    moments = [(tf.Variable(tf.zeros_like(v)), tf.Variable(tf.zeros_like(v))) for v in values]
    grad_tensors = [tf.constant(g) for g in grads]

    def step():
        for var, (m, v), grad in zip(variables, moments, grad_tensors):
            tf.raw_ops.ResourceApplyAdam(var=var.handle, m=m.handle, v=v.handle,
                                         beta1_power=0.9, beta2_power=0.999, lr=1e-3, beta1=0.9,
                                         beta2=0.999, epsilon=1e-8, grad=grad)

    return tf.function(step)


def cases(values, grads):
    def offload(host="/CPU:0", state_dtype="float32"):
        return lambda: mso.AdamOffload(1e-3, host_device=host, state_dtype=state_dtype)

    found = {
        "adam_offload": keras_case(offload(), values, grads),
        "adam_offload_bf16": keras_case(offload(state_dtype="bfloat16"), values, grads),
        "adam_offload_int8": keras_case(offload(state_dtype="int8"), values, grads),
        "adam_offload_delta_path": keras_case(offload("/CPU:1"), values, grads),
        "adam_offload_host_kernel": host_kernel_case(values, grads),
        "adam_offload_pure_tf": keras_case(offload(), values, grads, pure_tf=True),
        "keras_adam": keras_case(lambda: keras.optimizers.Adam(1e-3, epsilon=1e-8), values,
                                 grads),
        "raw_apply_adam": raw_apply_adam_case(values, grads),
    }
    found.update(TORCH_CASES)
    return found, dict(TORCH_NOTES)


def main():
    args = ARGS
    steps, notes = cases(VALUES, GRADS)
    medians = time_cases(steps, args.rounds, args.calls_per_round, idle=args.idle_ms / 1e3)
    throughput = {name: args.params / seconds / 1e6 for name, seconds in medians.items()}

    threads = THREADS or "default"
    print(f"{args.params:,} float32 params in {args.variables} variables, {os.cpu_count()} CPUs, "
          f"threads: {threads}, idle before each step: {args.idle_ms:g} ms, "
          f"TF {tf.__version__}, Keras {keras.__version__}; "
          f"{mso.ops.custom_ops_status()}")
    for name, note in notes.items():
        print(f"{name}: {note}")
    baseline = "deepspeed_cpu_adam" if "deepspeed_cpu_adam" in medians else "keras_adam"
    print(f"{'case':<26}{'ms/step':>10}{'Mparams/s':>12}{'vs ' + baseline:>26}")
    for name, seconds in medians.items():
        speedup = medians[baseline] / seconds
        print(f"{name:<26}{seconds * 1e3:>10.2f}{throughput[name]:>12.0f}{speedup:>25.2f}x")
    ratios = {f"{name}_throughput_vs_{other}": medians[other] / medians[name]
              for name in ("adam_offload", "adam_offload_bf16", "adam_offload_int8",
                           "adam_offload_delta_path", "adam_offload_host_kernel")
              for other in ("deepspeed_cpu_adam", "torch_adam_fused", "keras_adam",
                            "raw_apply_adam") if other in medians}
    sizes = [len(v) for v in VALUES]
    state_traffic = {}
    print(f"{'in-place step':<26}{'state':>10}{'bytes/param':>13}{'GB/s':>8}")
    for state_dtype, (name, _) in STATE_CASES.items():
        moved = host_step_bytes(state_dtype, sizes)
        state_traffic[name] = {"state_dtype": state_dtype,
                               "bytes_per_param": round(moved / sum(sizes), 3),
                               "gb_per_s": round(moved / medians[name] / 1e9, 2)}
        print(f"{name:<26}{state_dtype:>10}{moved / sum(sizes):>13.3f}"
              f"{moved / medians[name] / 1e9:>8.1f}")
    for state_dtype, (name, target) in STATE_CASES.items():
        if "deepspeed_cpu_adam" not in medians:
            print(f"target {name} vs DeepSpeedCPUAdam: not measured (DeepSpeed unavailable)")
            continue
        ratio = ratios[f"{name}_throughput_vs_deepspeed_cpu_adam"]
        verdict = "meets" if ratio >= target else "MISSES"
        print(f"target {name} ({state_dtype} moments) throughput vs DeepSpeedCPUAdam "
              f"(float32): {ratio:.2f}x (target >= {target}x) {verdict}")
    emit({
        "benchmark": "adam_offload_step", "params": args.params, "variables": args.variables,
        "threads": THREADS, "idle_ms": args.idle_ms, "machine": machine(),
        "custom_ops": mso.ops.custom_ops_available(), "notes": notes,
        "ms_per_step": {k: round(s * 1e3, 3) for k, s in medians.items()},
        "mparams_per_s": {k: round(v, 1) for k, v in throughput.items()},
        "ratios": {k: round(r, 3) for k, r in ratios.items()},
        "state_traffic": state_traffic,
    }, args.out)


if __name__ == "__main__":
    main()
