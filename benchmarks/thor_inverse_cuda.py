"""The CUDA damped block inverse on its own (no TensorFlow): numbers against NumPy, speed against
cuSOLVER routes. For a machine with a GPU, nvcc and CuPy (torch optional).

The kernel comes from ``custom_ops/damped_inverse.cu``, built with ``nvcc -shared`` for the
current GPU and called through its C launcher, as the TensorFlow op calls it. Checks, for
batches of 1 to 64 blocks of sizes 1 to 256 (float32; every size class of the launcher and
sizes just past each) plus 128 and 300 (float64): max relative error against
``numpy.linalg.inv`` of the damped blocks (float64) <= 1e-5 (float32) / 1e-12 (float64), and
that NaN / indefinite blocks come back with ok=False and zeros. Then times the kernel on
``--batches`` blocks of each of ``--sizes`` against the library routes that need no host
synchronisation: ``cupy.linalg.inv`` and, when torch is installed, ``torch.linalg.inv_ex`` and
``torch.linalg.cholesky_ex`` + ``torch.cholesky_inverse`` (cuSOLVER / cuBLAS), each the
median of ``--loops`` timed loops of ``--repeats`` calls (CUDA events). The kernel's rate
counts Gauss-Jordan's 2 n^3 operations a block, beside the chip's FP32 peak (multiprocessors
x FP32 lanes x 2 x the highest SM clock). The last line printed is JSON (``--out FILE`` also
writes it to FILE, replacing the file); the exit status is 1 if a check failed.

    python benchmarks/thor_inverse_cuda.py [--sizes 64 128 256] [--batches 16 64 256 1024]
"""
import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from timing import emit

try:
    import cupy as cp
except ImportError:  # pragma: no cover - needs a GPU machine
    raise SystemExit("this check needs CuPy and a CUDA GPU (pip install cupy-cuda13x)")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "custom_ops",
                      "damped_inverse.cu")
DAMPING = 0.1
# FP32 lanes per multiprocessor by compute capability (CUDA C++ Programming Guide's
# arithmetic-throughput table).
FP32_LANES = {"70": 64, "75": 64, "80": 64, "86": 128, "89": 128, "90": 128, "100": 128,
              "120": 128}


class LauncherKernel:
    """The .cu built as a shared library with nvcc; calls its extern "C" launchers."""

    def __init__(self, nvcc, arch):
        self.directory = tempfile.mkdtemp(prefix="msopt_inverse_")
        library = os.path.join(self.directory, "libmsopt_inverse.so")
        subprocess.check_call([nvcc, "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC",
                               f"-gencode=arch=compute_{arch},code=sm_{arch}", SOURCE,
                               "-o", library])
        self.lib = ctypes.CDLL(library)
        for name, real in (("msopt_damped_inverse_f32", ctypes.c_float),
                           ("msopt_damped_inverse_f64", ctypes.c_double)):
            getattr(self.lib, name).argtypes = [ctypes.c_void_p, real, ctypes.c_int64,
                                                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_void_p, ctypes.c_void_p]
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.msopt_damped_inverse_workspace_elements.restype = ctypes.c_int64
        self.lib.msopt_damped_inverse_workspace_elements.argtypes = [ctypes.c_int64, ctypes.c_int]
        self.workspaces = {}

    def __call__(self, matrices, damping, inverse, ok):
        batch, n = matrices.shape[0], matrices.shape[-1]
        key = (batch, n, matrices.dtype)
        if key not in self.workspaces:  # allocated once per shape, as a TF op's temp would be
            self.workspaces[key] = cp.empty(
                max(1, self.lib.msopt_damped_inverse_workspace_elements(batch, n)),
                matrices.dtype)
        launch = (self.lib.msopt_damped_inverse_f32 if matrices.dtype == np.float32
                  else self.lib.msopt_damped_inverse_f64)
        status = launch(matrices.data.ptr, damping, batch, n, inverse.data.ptr, ok.data.ptr,
                        self.workspaces[key].data.ptr, cp.cuda.get_current_stream().ptr)
        if status != 0:
            raise RuntimeError(f"launch failed with cudaError {status}")

    def close(self):
        shutil.rmtree(self.directory, ignore_errors=True)


def spd_blocks(batch, n, dtype, seed=0):
    x = np.random.default_rng(seed).normal(size=(batch, n, 2 * n))
    return (x @ x.transpose(0, 2, 1) / (2 * n)).astype(dtype)


def run(kernel, host_matrices, damping=DAMPING):
    matrices = cp.asarray(host_matrices)
    inverse = cp.full_like(matrices, 7.0)  # a kernel that skips an entry cannot pass
    ok = cp.empty(matrices.shape[0], cp.bool_)
    kernel(matrices, damping, inverse, ok)
    return cp.asnumpy(inverse), cp.asnumpy(ok)


def check_numbers(kernel):
    failures, worst = [], {}
    cases = [(np.float32, n, b) for n in (1, 7, 32, 33, 64, 65, 128, 129, 200, 256)
             for b in (1, 16, 64)]
    cases += [(np.float64, 128, 16), (np.float64, 300, 2), (np.float32, 300, 2)]
    for dtype, n, batch in cases:
        matrices = spd_blocks(batch, n, dtype)
        inverse, ok = run(kernel, matrices)
        expected = np.linalg.inv(matrices.astype(np.float64) + DAMPING * np.eye(n))
        error = float(np.abs(inverse - expected).max() / np.abs(expected).max())
        limit = 1e-5 if dtype == np.float32 else 1e-12
        key = f"{np.dtype(dtype).name} n={n} batch={batch}"
        worst[key] = error
        if not ok.all() or error > limit:
            failures.append(f"{key}: ok={ok.all()} error={error:.2e} (limit {limit:g})")
    for n in (50, 100, 250):  # one size per kernel shape
        matrices = spd_blocks(4, n, np.float32)
        matrices[1, 3, 0] = np.nan
        matrices[2] -= 3 * np.eye(n, dtype=np.float32)
        inverse, ok = run(kernel, matrices)
        if ok.tolist() != [True, False, False, True] or np.any(inverse[1:3]):
            failures.append(f"n={n}: failed blocks not flagged/zeroed: ok={ok.tolist()}")
    return failures, worst


def time_gpu(function, loops, repeats, event, synchronize, elapsed):
    """Median over ``loops`` of the milliseconds per call of ``repeats`` calls."""
    function()  # warm up (and compile, for library routes)
    synchronize()
    samples = []
    for _ in range(loops):
        start, end = event(), event()
        start.record()
        for _ in range(repeats):
            function()
        end.record()
        end.synchronize()
        samples.append(elapsed(start, end) / repeats)
    return float(np.median(samples))


def timings(kernel, batch, n, loops, repeats):
    x = cp.random.default_rng(batch * 1000 + n).standard_normal((batch, n, 2 * n), cp.float32)
    matrices = x @ x.transpose(0, 2, 1) / (2 * n)
    damped = matrices + DAMPING * cp.eye(n, dtype=cp.float32)
    inverse, ok = cp.empty_like(matrices), cp.empty(batch, cp.bool_)
    on_cupy = dict(event=cp.cuda.Event,
                   synchronize=lambda: cp.cuda.get_current_stream().synchronize(),
                   elapsed=cp.cuda.get_elapsed_time)
    results = {"kernel": time_gpu(lambda: kernel(matrices, DAMPING, inverse, ok), loops,
                                  repeats, **on_cupy),
               "cupy_linalg_inv": time_gpu(lambda: cp.linalg.inv(damped), loops, repeats,
                                           **on_cupy)}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        on_torch = dict(event=lambda: torch.cuda.Event(enable_timing=True),
                        synchronize=torch.cuda.synchronize,
                        elapsed=lambda start, end: start.elapsed_time(end))
        t_damped = torch.as_tensor(damped, device="cuda")
        results["torch_linalg_inv_ex"] = time_gpu(lambda: torch.linalg.inv_ex(t_damped),
                                                  loops, repeats, **on_torch)
        results["torch_cholesky_ex_inverse"] = time_gpu(
            lambda: torch.cholesky_inverse(torch.linalg.cholesky_ex(t_damped).L), loops,
            repeats, **on_torch)
    return results


def fp32_peak_tflops(device, arch):
    """Multiprocessors x FP32 lanes x 2 x the highest SM clock (nvidia-smi's, else CUDA's)."""
    clock_mhz = None
    try:
        clock_mhz = float(subprocess.check_output(
            ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits",
             f"--id={device.id}"], text=True).split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        clock_mhz = device.attributes.get("ClockRate", 0) / 1000.0
    sms = device.attributes["MultiProcessorCount"]
    return sms * FP32_LANES.get(arch, 128) * 2 * clock_mhz * 1e6 / 1e12, clock_mhz


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--loops", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("this check builds the kernel with nvcc; none is on the PATH")
    device = cp.cuda.Device()
    arch = "".join(map(str, device.compute_capability)) if isinstance(
        device.compute_capability, tuple) else device.compute_capability
    kernel = LauncherKernel(nvcc, arch)
    name = cp.cuda.runtime.getDeviceProperties(device.id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    peak, clock_mhz = fp32_peak_tflops(device, arch)
    print(f"GPU {name} (sm_{arch}), FP32 peak {peak:.1f} TFLOP/s at {clock_mhz:.0f} MHz")
    try:
        failures, errors = check_numbers(kernel)
        for key, error in errors.items():
            print(f"  {key:<28} max rel error {error:.2e}")
        print("numbers:", "OK" if not failures else "FAILED\n  " + "\n  ".join(failures))
        table = {}
        print(f"{'size':>5}{'blocks':>7}{'case':>28}{'ms':>10}{'kernel speed-up':>17}")
        for n in args.sizes:
            for batch in args.batches:
                medians = timings(kernel, batch, n, args.loops, args.repeats)
                for case, ms in medians.items():
                    print(f"{n:>5}{batch:>7}{case:>28}{ms:>10.4f}"
                          f"{ms / medians['kernel']:>16.2f}x")
                best = min(medians[k] for k in medians if k != "kernel")
                tflops = 2.0 * batch * n ** 3 / (medians["kernel"] * 1e-3) / 1e12
                print(f"{'':>12}kernel {tflops:.2f} TFLOP/s, {100 * tflops / peak:.1f}% of peak")
                table.setdefault(str(n), {})[str(batch)] = {
                    "ms": {k: round(v, 4) for k, v in medians.items()},
                    "speedup_vs_best_library": round(best / medians["kernel"], 3),
                    "kernel_tflops": round(tflops, 3),
                    "percent_of_fp32_peak": round(100 * tflops / peak, 2)}
    finally:
        kernel.close()
    emit({"benchmark": "thor_inverse_cuda", "gpu": name, "arch": f"sm_{arch}",
          "fp32_peak_tflops": round(peak, 2), "sm_clock_mhz": clock_mhz,
          "checks_passed": not failures, "max_rel_error": errors, "loops": args.loops,
          "repeats": args.repeats, "sizes": table}, args.out)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
