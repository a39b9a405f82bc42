"""mso.ops.damped_inverse: the MsOptDampedInverse op and its tf.linalg fallbacks against NumPy."""
import glob
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from helpers import REPO_ROOT
from tf_msopt.ops import _loader
from tf_msopt.ops.inverse import (OP_NAME, RETRY_OP_NAME, damped_inverse_with_retry,
                                  damped_inverse_with_status, inverse_backend)

SOURCE = os.path.join(REPO_ROOT, "custom_ops", "damped_inverse.cc")
CUDA_SOURCE = os.path.join(REPO_ROOT, "custom_ops", "damped_inverse.cu")
DAMPING = 0.1


@pytest.fixture
def op_library():
    """The package's compiled library (`make test` builds it)."""
    return _loader.LIBRARY_PATH


@pytest.fixture(params=["custom_op", "tf_linalg"])
def backend(request, monkeypatch):
    """Runs a test with the compiled op loaded, then with TF_MSOPT_DISABLE_CUSTOM_OPS=1."""
    if request.param == "custom_op":
        # The package's own build (`make test` compiles it), even in the kill-switch run.
        monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
        assert inverse_backend() == "custom op (CPU)", mso.ops.custom_ops_status()
    else:
        monkeypatch.setenv(_loader.DISABLE_ENV, "1")
        assert inverse_backend() == "tf.linalg (custom op not loaded)"
    return request.param


def spd_blocks(batch_shape, n, dtype=np.float32, seed=0):
    """Well-conditioned SPD blocks X X^T / (2n), X of shape [n, 2n]."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(*batch_shape, n, 2 * n))
    return (x @ np.swapaxes(x, -1, -2) / (2 * n)).astype(dtype)


def numpy_inverse(matrices, damping=DAMPING):
    m = np.asarray(matrices, np.float64)
    return np.linalg.inv(m + damping * np.eye(m.shape[-1]))


def assert_close(actual, expected, rel):
    """max |actual - expected| <= rel * max |expected| (relative to the blocks' scale)."""
    actual = np.asarray(actual, np.float64)
    scale = max(np.abs(expected).max(), 1e-30) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rel * scale)


@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("n", [1, 7, 64, 128, 200])
def test_matches_numpy_float32(backend, batch, n):
    matrices = spd_blocks([batch], n)
    expected = numpy_inverse(matrices)
    inverses, ok = damped_inverse_with_status(matrices, DAMPING)
    assert inverses.dtype == tf.float32 and inverses.shape == (batch, n, n)
    assert ok.shape == (batch,) and bool(tf.reduce_all(ok))
    assert_close(inverses, expected, 1e-5)
    assert_close(mso.ops.damped_inverse(matrices, DAMPING), expected, 1e-5)


@pytest.mark.parametrize("n", [1, 7, 9, 64, 130])
def test_matches_numpy_float64(backend, n):
    matrices = spd_blocks([3], n, np.float64)
    inverses = mso.ops.damped_inverse(matrices, tf.constant(DAMPING, tf.float64))
    assert inverses.dtype == tf.float64
    assert_close(inverses, numpy_inverse(matrices), 1e-12)


def test_batch_shapes_and_symmetric_result(backend):
    matrices = spd_blocks([2, 3], 20)
    inverses, ok = damped_inverse_with_status(matrices, DAMPING)
    assert inverses.shape == (2, 3, 20, 20) and ok.shape == (2, 3)
    np.testing.assert_array_equal(inverses.numpy(), np.swapaxes(inverses.numpy(), -1, -2))
    single, single_ok = damped_inverse_with_status(matrices[1, 2], DAMPING)
    assert single.shape == (20, 20) and single_ok.shape == () and bool(single_ok)
    assert_close(single, numpy_inverse(matrices[1, 2]), 1e-5)


def test_reads_only_the_lower_triangle(backend):
    matrices = spd_blocks([4], 40)
    upper = np.triu(np.ones((40, 40), np.float32), k=1)
    noisy = matrices + 5.0 * upper  # not symmetric any more; the lower triangle is unchanged
    assert_close(mso.ops.damped_inverse(noisy, DAMPING), numpy_inverse(matrices), 1e-5)


@pytest.mark.parametrize("shape", [(0, 5, 5), (3, 0, 0)])
def test_empty_batches_and_blocks(backend, shape):
    inverses, ok = damped_inverse_with_status(np.zeros(shape, np.float32), DAMPING)
    assert inverses.shape == shape and ok.shape == shape[:1]
    assert bool(tf.reduce_all(ok))


def _blocks_with_failures(n):
    """Blocks 1 (NaN), 2 (Inf in the upper triangle) and 4 (indefinite) fail; 0 and 3 are SPD."""
    matrices = spd_blocks([5], n)
    matrices[1, n - 1, 0] = np.nan
    matrices[2, 0, n - 1] = np.inf
    matrices[4] -= 3.0 * np.eye(n, dtype=np.float32)
    return matrices, np.array([True, False, False, True, False])


@pytest.mark.parametrize("n", [3, 50])
@pytest.mark.parametrize("compiled", [False, True])
def test_failed_blocks_are_flagged_and_zeroed(backend, n, compiled):
    matrices, expected_ok = _blocks_with_failures(n)
    run = tf.function(damped_inverse_with_status, jit_compile=True) if compiled else \
        damped_inverse_with_status
    inverses, ok = run(matrices, DAMPING)
    np.testing.assert_array_equal(ok.numpy(), expected_ok)
    np.testing.assert_array_equal(inverses.numpy()[~expected_ok], 0.0)
    assert_close(inverses.numpy()[expected_ok], numpy_inverse(matrices[expected_ok]), 1e-5)


def test_non_finite_or_negative_damping_fails_every_block(backend):
    matrices = spd_blocks([3], 10)
    for damping in (np.nan, np.inf, -50.0):
        inverses, ok = damped_inverse_with_status(matrices, damping)
        assert not np.any(ok.numpy()) and not np.any(inverses.numpy())


def test_overflowing_inverse_is_a_failure(backend):
    tiny = np.full((1, 1, 1), 1e-45, np.float32)  # PD, but 1 / 1e-45 overflows float32
    inverses, ok = damped_inverse_with_status(tiny, 0.0)
    assert not bool(ok[0]) and inverses.numpy()[0, 0, 0] == 0.0


def test_damped_inverse_raises_for_failed_blocks(backend):
    matrices, _ = _blocks_with_failures(8)
    message = "must be finite and positive definite"
    for bad in (matrices[1:2], matrices[4:5]):
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            mso.ops.damped_inverse(bad, DAMPING)
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            tf.function(mso.ops.damped_inverse)(bad, DAMPING)


def test_damped_inverse_under_xla_gives_nan_blocks(backend):
    matrices, expected_ok = _blocks_with_failures(8)
    inverses = tf.function(mso.ops.damped_inverse, jit_compile=True)(matrices, DAMPING).numpy()
    assert np.isnan(inverses[~expected_ok]).all()
    assert_close(inverses[expected_ok], numpy_inverse(matrices[expected_ok]), 1e-5)


def test_graph_uses_the_op_and_xla_uses_tf_linalg(backend):
    matrices = tf.constant(spd_blocks([4], 16))
    seen = []

    def step(m):
        seen.append(inverse_backend())
        return damped_inverse_with_status(m, DAMPING)

    graph = tf.function(step).get_concrete_function(matrices).graph
    op_types = {op.type for op in graph.get_operations()}
    assert (OP_NAME in op_types) == (backend == "custom_op")
    xla_result, _ = tf.function(step, jit_compile=True)(matrices)
    assert seen[-1] == "tf.linalg (XLA)"
    assert_close(xla_result, numpy_inverse(matrices.numpy()), 1e-5)


def test_mirrored_strategy_replica_and_cross_replica(backend, two_cpu_strategy):
    matrices = spd_blocks([2, 3], 12)
    with two_cpu_strategy.scope():
        per_replica = two_cpu_strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(matrices[context.replica_id_in_sync_group]))
        step = tf.function(lambda m: damped_inverse_with_status(m, DAMPING))
        results = two_cpu_strategy.run(step, args=(per_replica,))
        cross_replica, _ = damped_inverse_with_status(matrices, DAMPING)
    for replica, (inverses, ok) in enumerate(zip(*(two_cpu_strategy.experimental_local_results(r)
                                                   for r in results))):
        assert bool(tf.reduce_all(ok))
        assert_close(inverses, numpy_inverse(matrices[replica]), 1e-5)
    assert_close(cross_replica, numpy_inverse(matrices), 1e-5)


def numpy_retry_damping(matrix, damping):
    diagonal = np.diag(matrix).astype(np.float64)
    finite = np.abs(diagonal[np.isfinite(diagonal)])
    return max(10.0 * damping, 1e-4 * (finite.mean() if finite.size else 0.0)) + 1e-6


def _blocks_for_retry(n):
    """0: SPD; 1: singular (fails with damping 0, not with the retry's); 2: indefinite
    beyond any retry; 3: NaN on the diagonal; 4: SPD."""
    matrices = spd_blocks([5], n).astype(np.float64)
    matrices[1] = np.diag(np.r_[np.arange(1.0, n), 0.0])
    matrices[2] -= 1e3 * np.eye(n)
    matrices[3, 0, 0] = np.nan
    dampings = np.array([DAMPING, 0.0, DAMPING, DAMPING, 0.3])
    return matrices.astype(np.float32), dampings.astype(np.float32)


@pytest.mark.parametrize("n", [2, 40])
@pytest.mark.parametrize("compiled", [False, True])
def test_retry_matches_numpy(backend, n, compiled):
    """A failed block is inverted again with max(10 d, 1e-4 mean|diag|) + 1e-6; blocks
    failing both tries come back zero and not ok."""
    matrices, dampings = _blocks_for_retry(n)
    run = tf.function(damped_inverse_with_retry, jit_compile=True) if compiled else \
        damped_inverse_with_retry
    inverses, retried, ok = (t.numpy() for t in run(matrices, dampings))
    np.testing.assert_array_equal(retried, [False, True, True, True, False])
    np.testing.assert_array_equal(ok, [True, True, False, False, True])
    for block in (0, 4):
        assert_close(inverses[block], numpy_inverse(matrices[block], dampings[block]), 1e-5)
    retry = numpy_retry_damping(matrices[1], 0.0)
    assert retry > 2e-6                     # the mean diagonal term, not only the floor
    assert_close(inverses[1], numpy_inverse(matrices[1], retry), 1e-5)
    np.testing.assert_array_equal(inverses[2:4], 0.0)


def test_retry_takes_a_scalar_damping_and_float64(backend):
    matrices = spd_blocks([3], 9, np.float64)
    inverses, retried, ok = damped_inverse_with_retry(matrices, DAMPING)
    assert inverses.dtype == tf.float64 and not np.any(retried) and np.all(ok)
    assert_close(inverses, numpy_inverse(matrices), 1e-12)


def test_retry_refuses_a_damping_of_another_shape(backend):
    with pytest.raises(ValueError, match="'damping' must be a scalar or have the batch shape"):
        damped_inverse_with_retry(spd_blocks([3], 4), np.ones(2, np.float32))


def test_retry_is_one_op_in_a_cpu_graph(backend):
    """With the compiled library the retry happens inside MsOptDampedInverseRetry; without
    it, in the graph around the inverse."""
    matrices, dampings = _blocks_for_retry(6)
    graph = tf.function(damped_inverse_with_retry).get_concrete_function(
        tf.constant(matrices), tf.constant(dampings)).graph
    op_types = {op.type for op in graph.get_operations()}
    assert (RETRY_OP_NAME in op_types) == (backend == "custom_op")
    assert ("TensorScatterUpdate" in op_types) == (backend != "custom_op")


def test_retry_op_contract_without_the_wrapper(op_library):
    module = tf.load_op_library(op_library)
    matrices = spd_blocks([3], 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="'damping' must have the batch"):
        module.ms_opt_damped_inverse_retry(matrices, np.ones(2, np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"shape \[\.\.\., n, n\]"):
        module.ms_opt_damped_inverse_retry(np.ones((2, 3), np.float32), np.ones(2, np.float32))
    concrete = tf.function(module.ms_opt_damped_inverse_retry).get_concrete_function(
        tf.TensorSpec([None, 5, None], tf.float32), tf.TensorSpec([None], tf.float32))
    assert [o.shape.as_list() for o in concrete.structured_outputs] == [[None, 5, 5], [None],
                                                                        [None]]
    nan_damping = np.array([DAMPING, np.nan, DAMPING], np.float32)
    _, retried, ok = module.ms_opt_damped_inverse_retry(matrices, nan_damping)
    np.testing.assert_array_equal(retried.numpy(), [False, True, False])
    np.testing.assert_array_equal(ok.numpy(), [True, False, True])


@pytest.mark.parametrize("matrices, damping, error, match", [
    (np.ones(4, np.float32), 0.1, ValueError, "'matrices' must have rank >= 2"),
    (np.ones((2, 3, 4), np.float32), 0.1, ValueError, "'matrices' must be square"),
    (np.ones((2, 2), np.int32), 0.1, TypeError, "'matrices' must be a float32 or float64"),
    (np.ones((2, 2), np.float16), 0.1, TypeError, "'matrices' must be a float32 or float64"),
    (np.eye(2, dtype=np.float32), True, TypeError, "'damping' must be a real number"),
    (np.eye(2, dtype=np.float32), "0.1", TypeError, "'damping' must be a real number"),
    (np.eye(2, dtype=np.float32), np.ones(2), ValueError, "'damping' must be a scalar"),
])
def test_malformed_arguments_name_the_argument(backend, matrices, damping, error, match):
    for function in (mso.ops.damped_inverse, damped_inverse_with_status):
        with pytest.raises(error, match=match):
            function(matrices, damping)


def test_op_contract_without_the_wrapper(op_library):
    module = tf.load_op_library(op_library)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"shape \[\.\.\., n, n\]"):
        module.ms_opt_damped_inverse(np.ones((2, 3), np.float32), np.float32(0.1))
    with pytest.raises(ValueError, match="must be equal|Dimensions"):  # the shape function
        tf.function(module.ms_opt_damped_inverse).get_concrete_function(
            tf.TensorSpec([None, 3, 4], tf.float32), tf.TensorSpec([], tf.float32))
    concrete = tf.function(module.ms_opt_damped_inverse).get_concrete_function(
        tf.TensorSpec([None, 5, None], tf.float32), tf.TensorSpec([], tf.float32))
    assert [o.shape.as_list() for o in concrete.structured_outputs] == [[None, 5, 5], [None]]


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize("dtype, rel", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_every_cpu_code_path_gives_the_same_numbers(op_library, monkeypatch, isa, dtype, rel):
    """The AVX-512 / AVX2 / baseline builds of the tiled kernel, capped by TF_MSOPT_INVERSE_ISA."""
    module = tf.load_op_library(op_library)
    matrices = spd_blocks([6], 70, dtype)
    monkeypatch.setenv("TF_MSOPT_INVERSE_ISA", isa)
    inverses, ok = module.ms_opt_damped_inverse(matrices, dtype(DAMPING))
    assert bool(tf.reduce_all(ok))
    assert_close(inverses, numpy_inverse(matrices), rel)


def _nvcc():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        # CI sets TF_MSOPT_REQUIRE_NVCC=1: there a broken CUDA file must fail, never skip.
        assert not os.environ.get("TF_MSOPT_REQUIRE_NVCC"), "nvcc is required but not on PATH"
        pytest.skip("nvcc is not installed")
    return nvcc


@pytest.mark.slow
def test_nvcc_compiles_the_cuda_kernel(tmp_path):
    """CI has no GPU: compile-only for the oldest and the newest targets CUDA 13 supports here."""
    result = subprocess.run(
        [_nvcc(), "-std=c++17", "-O3", "-c", CUDA_SOURCE, "-o", str(tmp_path / "kernel.o"),
         "-Xcompiler", "-fPIC", "-gencode", "arch=compute_75,code=sm_75",
         "-gencode", "arch=compute_90,code=sm_90"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "kernel.o").stat().st_size > 0


@pytest.mark.slow
def test_setup_builds_cpu_only_when_the_cuda_build_fails(tmp_path):
    """A failing nvcc (an architecture CUDA 13 dropped) must not fail the build."""
    _nvcc()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(REPO_ROOT, name), tmp_path)
    (tmp_path / "custom_ops").mkdir()
    for source in glob.glob(os.path.join(REPO_ROOT, "custom_ops", "damped_inverse*")):
        shutil.copy(source, tmp_path / "custom_ops")
    (tmp_path / "tf_msopt" / "ops").mkdir(parents=True)
    env = dict(os.environ, TF_MSOPT_BUILD_CUDA="1", TF_MSOPT_CUDA_ARCHS="70")
    result = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", "out"],
                            cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "building CPU-only" in result.stderr
    library = tmp_path / "out" / "tf_msopt" / "ops" / "_msopt_ops.so"
    symbols = subprocess.run(["nm", "-D", str(library)], capture_output=True, text=True).stdout
    assert "msopt_damped_inverse_f32" not in symbols  # no GPU kernel linked in
    assert "MsOptDampedInverse" in open(library, "rb").read().decode("latin-1")


def _setup_function(name):
    """A function of setup.py, without running setup() (its module level)."""
    import ast
    with open(os.path.join(REPO_ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"os": os, "glob": glob, "hashlib": __import__("hashlib"), "shutil": shutil,
                 "subprocess": subprocess, "HERE": REPO_ROOT}
    exec(compile(ast.Module([node], []), "setup.py", "exec"), namespace)
    return namespace[name]


def test_build_cache_reuses_an_object_only_for_the_same_command_and_source(tmp_path,
                                                                          monkeypatch):
    compile_cached = _setup_function("compile_cached")
    monkeypatch.setenv("TF_MSOPT_BUILD_CACHE", str(tmp_path / "cache"))
    source, output, runs = tmp_path / "op.cc", tmp_path / "op.o", tmp_path / "runs"
    # A stand-in compiler: writes the source's text to the object, counts its runs.
    compiler = [sys.executable, "-c",
                "import sys; open(sys.argv[2], 'w').write(open(sys.argv[1]).read()); "
                "open(sys.argv[3], 'a').write('x')", str(source), str(output), str(runs)]

    def build(text, flag="-O3"):
        source.write_text(text)
        output.unlink(missing_ok=True)
        compile_cached([*compiler, flag], str(source), str(output))
        return output.read_text(), len(runs.read_text())

    assert build("v1") == ("v1", 1)
    assert build("v1") == ("v1", 1)           # same command and source: the cached object
    assert build("v2") == ("v2", 2)           # the source changed
    assert build("v2", flag="-O2") == ("v2", 3)   # the command changed
    assert build("v1") == ("v1", 3)
