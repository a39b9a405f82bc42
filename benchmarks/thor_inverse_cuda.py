"""The CUDA damped block inverse on its own (no TensorFlow): numbers against NumPy, speed against
cuSOLVER routes. For a machine with a GPU and CuPy (torch optional).

The kernel comes from ``custom_ops/damped_inverse.cu``: built with ``nvcc -shared``
for the current GPU and called through its C launcher when ``nvcc`` is on the
PATH, else compiled by NVRTC through ``cupy.RawModule`` (``MSOPT_KERNELS_ONLY``)
and launched the way the launcher does. Checks, for batches of 1, 16 and 64 blocks
of sizes 1, 7, 64, 128 and 200 (float32) plus 128 (float64): max relative error
vs ``numpy.linalg.inv`` of the damped blocks <= 1e-5 (float32) / 1e-12 (float64),
and that NaN / indefinite blocks come back with ok=False and zeros. Then times
the kernel on 16 and 64 blocks of 128x128 against ``cupy.linalg.inv`` and, when
torch is installed, ``torch.linalg.cholesky`` + ``torch.cholesky_inverse``
(both cuSOLVER), with CUDA events. The last line printed is JSON (``--out FILE`` also writes it to FILE, replacing the file); the exit
status is 1 if a check failed.

    python benchmarks/thor_inverse_cuda.py [--size 128] [--batches 16 64] [--repeats 50]
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
    raise SystemExit("this check needs CuPy and a CUDA GPU (pip install cupy-cuda12x)")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "custom_ops",
                      "damped_inverse.cu")
THREADS = (32, 32)  # kThreadsX, kThreadsY in the .cu
DAMPING = 0.1


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
        self.name = "nvcc launcher"

    def __call__(self, matrices, damping, inverse, ok):
        batch, n = matrices.shape[0], matrices.shape[-1]
        workspace = cp.empty(max(1, self.lib.msopt_damped_inverse_workspace_elements(batch, n)),
                             matrices.dtype)
        launch = (self.lib.msopt_damped_inverse_f32 if matrices.dtype == np.float32
                  else self.lib.msopt_damped_inverse_f64)
        status = launch(matrices.data.ptr, damping, batch, n, inverse.data.ptr, ok.data.ptr,
                        workspace.data.ptr, cp.cuda.get_current_stream().ptr)
        if status != 0:
            raise RuntimeError(f"launch failed with cudaError {status}")

    def close(self):
        shutil.rmtree(self.directory, ignore_errors=True)


class RawModuleKernel:
    """The kernel compiled by NVRTC; picks shared or global memory as the launcher does."""

    def __init__(self):
        names = [f"msopt_cuda::DampedInverseKernel<{t}, {s}>" for t in ("float", "double")
                 for s in ("true", "false")]
        with open(SOURCE) as f:
            self.module = cp.RawModule(code=f.read(), options=("-std=c++17",
                                                               "-DMSOPT_KERNELS_ONLY"),
                                       name_expressions=names)
        self.name = "CuPy RawModule"
        self.shared_limit = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]

    def __call__(self, matrices, damping, inverse, ok):
        batch, n = matrices.shape[0], matrices.shape[-1]
        dtype = np.dtype(matrices.dtype)
        type_name = "float" if dtype == np.float32 else "double"
        shared = (n * n + 2 * n) * dtype.itemsize
        use_shared = shared <= self.shared_limit
        kernel = self.module.get_function(
            f"msopt_cuda::DampedInverseKernel<{type_name}, {'true' if use_shared else 'false'}>")
        workspace = cp.empty(max(1, 2 * n * batch), dtype)
        if use_shared:
            kernel.max_dynamic_shared_size_bytes = shared
        kernel((batch,), THREADS, (matrices, dtype.type(damping), np.int32(n), inverse, ok,
                                   workspace), shared_mem=shared if use_shared else 0)

    def close(self):
        pass


def spd_blocks(batch, n, dtype, seed=0):
    x = np.random.default_rng(seed).normal(size=(batch, n, 2 * n))
    return (x @ x.transpose(0, 2, 1) / (2 * n)).astype(dtype)


def run(kernel, host_matrices, damping=DAMPING):
    matrices = cp.asarray(host_matrices)
    inverse = cp.empty_like(matrices)
    ok = cp.empty(matrices.shape[0], cp.bool_)
    kernel(matrices, damping, inverse, ok)
    return cp.asnumpy(inverse), cp.asnumpy(ok)


def check_numbers(kernel):
    failures, worst = [], {}
    cases = [(np.float32, n, b) for n in (1, 7, 64, 128, 200) for b in (1, 16, 64)]
    cases += [(np.float64, 128, 16), (np.float64, 300, 2)]
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
    matrices = spd_blocks(4, 50, np.float32)
    matrices[1, 3, 0] = np.nan
    matrices[2] -= 3 * np.eye(50, dtype=np.float32)
    inverse, ok = run(kernel, matrices)
    if ok.tolist() != [True, False, False, True] or np.any(inverse[1:3]):
        failures.append(f"failed blocks not flagged/zeroed: ok={ok.tolist()}")
    return failures, worst


def time_gpu(function, repeats):
    function()  # warm up (and compile, for library routes)
    cp.cuda.get_current_stream().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / repeats  # ms


def timings(kernel, batch, n, repeats):
    host = spd_blocks(batch, n, np.float32)
    matrices = cp.asarray(host)
    damped = matrices + DAMPING * cp.eye(n, dtype=cp.float32)
    inverse, ok = cp.empty_like(matrices), cp.empty(batch, cp.bool_)
    results = {"kernel": time_gpu(lambda: kernel(matrices, DAMPING, inverse, ok), repeats),
               "cupy_linalg_inv": time_gpu(lambda: cp.linalg.inv(damped), repeats)}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        t_damped = torch.as_tensor(cp.asnumpy(damped), device="cuda")
        results["torch_cholesky_inverse"] = time_gpu(
            lambda: torch.cholesky_inverse(torch.linalg.cholesky(t_damped)), repeats)
        results["torch_linalg_inv"] = time_gpu(lambda: torch.linalg.inv(t_damped), repeats)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--nvrtc", action="store_true", help="use CuPy RawModule even with nvcc")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()

    device = cp.cuda.Device()
    arch = "".join(map(str, device.compute_capability)) if isinstance(
        device.compute_capability, tuple) else device.compute_capability
    nvcc = shutil.which("nvcc")
    kernel = LauncherKernel(nvcc, arch) if nvcc and not args.nvrtc else RawModuleKernel()
    name = cp.cuda.runtime.getDeviceProperties(device.id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"GPU {name} (sm_{arch}), kernel via {kernel.name}")
    try:
        failures, errors = check_numbers(kernel)
        for key, error in errors.items():
            print(f"  {key:<28} max rel error {error:.2e}")
        print("numbers:", "OK" if not failures else "FAILED\n  " + "\n  ".join(failures))
        speed = {}
        print(f"{'blocks':>7}{'case':>26}{'ms':>10}{'kernel speed-up':>17}")
        for batch in args.batches:
            medians = timings(kernel, batch, args.size, args.repeats)
            for case, ms in medians.items():
                print(f"{batch:>7}{case:>26}{ms:>10.4f}{ms / medians['kernel']:>16.2f}x")
            best = min(v for k, v in medians.items() if k != "kernel")
            speed[str(batch)] = {"ms": {k: round(v, 4) for k, v in medians.items()},
                                 "speedup_vs_best_library": round(best / medians["kernel"], 3)}
    finally:
        kernel.close()
    emit({"benchmark": "thor_inverse_cuda", "gpu": name, "arch": f"sm_{arch}",
          "kernel_build": kernel.name, "size": args.size, "checks_passed": not failures,
          "max_rel_error": errors, "batches": speed}, args.out)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
