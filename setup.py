"""Builds tf_msopt and, when TensorFlow is importable, its optional custom ops.

The C++/CUDA sources live in ``custom_ops/``; they are compiled with the flags of
the installed TensorFlow (``tf.sysconfig``) into ``tf_msopt/ops/_msopt_ops.so``.
A failed or skipped build is not an error: every feature has a pure-TensorFlow
path, and ``tf_msopt.ops.custom_ops_available()`` reports which one is in use.
Set ``TF_MSOPT_BUILD_CUSTOM_OPS=0`` to skip the build.
"""
import glob
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(glob.glob(os.path.join("custom_ops", "*.cc")))


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
        command = ["g++", "-std=c++17", "-shared", "-fPIC", "-O3", "-Wno-deprecated-declarations",
                   "-Wno-interference-size", *ext.sources, "-o", out,
                   *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
        try:
            subprocess.check_call(command)
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"tf_msopt: custom ops not built ({err}); the pure-TensorFlow path will be used",
                  file=sys.stderr)

    def get_ext_filename(self, ext_name):
        # A plain name without the CPython ABI tag: the library is loaded with tf.load_op_library.
        return os.path.join(*ext_name.split(".")) + ".so"


build_ops = SOURCES and os.environ.get("TF_MSOPT_BUILD_CUSTOM_OPS", "1") != "0"
setup(
    ext_modules=[Extension("tf_msopt.ops._msopt_ops", SOURCES)] if build_ops else [],
    cmdclass={"build_ext": TensorFlowBuildExt},
)
