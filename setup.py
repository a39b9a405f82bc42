"""Builds tf_msopt and, when TensorFlow is importable, its optional custom ops.

The C++/CUDA sources live in ``custom_ops/``; they are compiled with the flags of
the installed TensorFlow (``tf.sysconfig``) into ``tf_msopt/ops/_msopt_ops.so``.
pyproject.toml lists TensorFlow among the build requirements, so pip's isolated
build environment has it; ``pip install --no-build-isolation .`` builds against the
TensorFlow already installed instead.
A failed or skipped build is not an error: every feature has a pure-TensorFlow
path, and ``tf_msopt.ops.custom_ops_available()`` reports which one is in use.
Set ``TF_MSOPT_BUILD_CUSTOM_OPS=0`` to skip the build.

GPU kernels: with ``TF_MSOPT_BUILD_CUDA=1`` and ``nvcc`` on the PATH (or at
``$CUDA_HOME/bin/nvcc``), every ``custom_ops/*.cu`` is compiled for
``TF_MSOPT_CUDA_ARCHS`` (default ``75;80;86;89;90``, CUDA 13 supports sm_75 and
newer) and linked into the same library, whose sources then see
``TF_MSOPT_WITH_CUDA``. If any CUDA step fails the CPU-only library is built.

The library carries the version of the TensorFlow it was compiled against
(``custom_ops/build_info.cc``); the loader reads it from the file and does not load a
library of another TensorFlow release, whose ABI differs.

``TF_MSOPT_BUILD_CACHE=DIR`` keeps each compiled C++ object in ``DIR`` under a hash of
its command, source and the ``custom_ops`` headers, and reuses it when they have not
changed (``make`` sets it to a folder of its virtualenv, so a rebuild against the same
TensorFlow links the objects it already has).
"""
import concurrent.futures
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:   # setuptools < 70.1, in a build without isolation: default wheel tags
    bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(glob.glob(os.path.join("custom_ops", "*.cc")))
CUDA_SOURCES = sorted(glob.glob(os.path.join("custom_ops", "*.cu")))
DEFAULT_CUDA_ARCHS = "75;80;86;89;90"


def find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    return candidate if candidate and os.path.exists(candidate) else shutil.which("nvcc")


def nvcc_command(nvcc, source, output, archs=None):
    """nvcc compile-only command for one plain-CUDA source (no TensorFlow headers)."""
    archs = archs or os.environ.get("TF_MSOPT_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
    gencode = []
    for arch in filter(None, (a.strip() for a in archs.split(";"))):
        gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return [nvcc, "-std=c++17", "-O3", "-c", source, "-o", output, "-Xcompiler", "-fPIC",
            *gencode]


def build_cuda_objects(tf, build_dir):
    """Compiles the .cu sources: (objects, extra compile flags), or None to build CPU-only."""
    if os.environ.get("TF_MSOPT_BUILD_CUDA", "0") in ("", "0") or not CUDA_SOURCES:
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        print("tf_msopt: TF_MSOPT_BUILD_CUDA is set but nvcc was not found; building CPU-only",
              file=sys.stderr)
        return None
    objects = []
    for source in CUDA_SOURCES:
        output = os.path.join(build_dir, os.path.basename(source) + ".o")
        try:
            subprocess.check_call(nvcc_command(nvcc, source, output))
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"tf_msopt: CUDA kernels not built ({err}); building CPU-only", file=sys.stderr)
            return None
        objects.append(output)
    # The CUDA runtime headers TensorFlow ships; the runtime itself resolves to
    # libtensorflow_framework's CUDA shim at load time.
    cuda_include = os.path.join(tf.sysconfig.get_include(), "third_party", "gpus", "cuda",
                                "include")
    return objects, ["-DTF_MSOPT_WITH_CUDA=1", f"-I{cuda_include}"]


def compile_cached(command, source, output):
    """Runs the compiler ``command`` (which writes ``output``), or copies the object a
    previous identical compilation left in ``$TF_MSOPT_BUILD_CACHE``."""
    cache = os.environ.get("TF_MSOPT_BUILD_CACHE")
    if not cache:
        subprocess.check_call(command)
        return
    key = hashlib.sha256(repr([part for part in command if part != output]).encode())
    for path in [source, *sorted(glob.glob(os.path.join(HERE, "custom_ops", "*.h")))]:
        with open(path, "rb") as f:
            key.update(f.read())
    cached = os.path.join(cache, key.hexdigest() + ".o")
    if not os.path.exists(cached):
        subprocess.check_call(command)
        os.makedirs(cache, exist_ok=True)
        partial = f"{cached}.{os.getpid()}.tmp"
        shutil.copyfile(output, partial)
        os.replace(partial, cached)   # atomic: concurrent builds may share the cache
    shutil.copyfile(cached, output)


class TensorFlowBuildExt(build_ext):
    """Compiles op libraries with g++ and TensorFlow's own compile/link flags."""

    def build_extension(self, ext):
        try:
            import tensorflow as tf
        except ImportError:
            print("tf_msopt: TensorFlow is not importable; skipping custom ops", file=sys.stderr)
            return
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)

        compile_flags = ["-std=c++17", "-fPIC", "-O3", "-Wno-deprecated-declarations",
                         "-Wno-interference-size", *tf.sysconfig.get_compile_flags(),
                         f'-DTF_MSOPT_TENSORFLOW_VERSION="{tf.__version__}"']

        def build(build_dir, objects=(), flags=()):
            # One g++ per source, run together (each takes ~10 s of TensorFlow headers), then
            # one link.
            outputs = [os.path.join(build_dir, os.path.basename(source) + ".o")
                       for source in ext.sources]
            with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                list(pool.map(compile_cached,
                              [["g++", *compile_flags, *flags, "-c", source, "-o", output]
                               for source, output in zip(ext.sources, outputs)],
                              ext.sources, outputs))
            subprocess.check_call(["g++", "-shared", *outputs, *objects, "-o", out,
                                   *tf.sysconfig.get_link_flags()])

        with tempfile.TemporaryDirectory() as build_dir:
            cuda = build_cuda_objects(tf, build_dir)
            if cuda is not None:
                try:
                    build(build_dir, *cuda)
                    return
                except (OSError, subprocess.CalledProcessError) as err:
                    print(f"tf_msopt: building with the CUDA kernels failed ({err}); building CPU-only",
                          file=sys.stderr)
            try:
                build(build_dir)
            except (OSError, subprocess.CalledProcessError) as err:
                print(f"tf_msopt: custom ops not built ({err}); the pure-TensorFlow path will be "
                      f"used", file=sys.stderr)

    def get_ext_filename(self, ext_name):
        # A plain name without the CPython ABI tag: the library is loaded with tf.load_op_library.
        return os.path.join(*ext_name.split(".")) + ".so"


class OpLibraryWheel(bdist_wheel or object):
    """A wheel for every Python 3 the pinned TensorFlow supports: the op library is loaded by
    ``tf.load_op_library`` and links TensorFlow's framework library, not Python's."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


build_ops = SOURCES and os.environ.get("TF_MSOPT_BUILD_CUSTOM_OPS", "1") != "0"
setup(
    # optional: a skipped or failed build (TensorFlow not importable, as in a build without
    # isolation before TensorFlow is installed; no compiler) leaves no library, and setuptools
    # must not try to copy one.
    ext_modules=[Extension("tf_msopt.ops._msopt_ops", SOURCES, optional=True)] if build_ops else [],
    cmdclass={"build_ext": TensorFlowBuildExt,
              **({"bdist_wheel": OpLibraryWheel} if bdist_wheel else {})},
)
