"""Test setup shared by every test module.

Two logical CPU devices are configured before TensorFlow runs any op, so
``MirroredStrategy(["/cpu:0", "/cpu:1"])`` gives real per-replica behaviour on a
CPU-only machine (and stands for "device" vs "host" in placement tests).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from helpers import two_cpu_mirrored_strategy  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

from tf_msopt import _keras_compat as compat  # noqa: E402
from tf_msopt.compare import without_data_autotuning  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _datasets_without_autotuning():
    """Freeing an iterator that an earlier fit or evaluate left behind waited for its
    autotuning thread, 18 s to 5 minutes with both cores idle, in a test that happened to
    collect the garbage."""
    with without_data_autotuning():
        yield


#: Modules whose tests run code that differs without the compiled custom ops and do not
#: switch the op path themselves (test_ops_inverse, test_thor_numerics, test_adam_offload*,
#: test_ops_lars and test_ops_loader run both paths in one pass). The kill-switch pass of
#: ``make test-all`` runs the tests marked ``ops_path`` (these modules, and the contract cases
#: marked in ``tests/contract``) and those marked ``cpu_arithmetic``. THOR's only compiled op is the inverse: its NumPy reference tests run
#: both inverse back-ends in one pass and its contract case (training, resume, mirrored, XLA)
#: runs in both passes, so its other modules run once.
_OPS_PATH_MODULES = frozenset({"test_sign_optimizers", "test_ops_sign"})

#: Tests whose float32 results depend on the CPU's instruction set: the NumPy-reference and
#: golden-value checks, the files written on another machine, the contract's equivalences
#: and the short trainings against a level. ``make test-all`` runs them again with oneDNN capped
#: at AVX2, with and without its kernels (and the compiled ops), as a machine without
#: AVX-512 computes them. Not the contract's loss-scaled cases: their scale is a power of
#: two (exact), so under the caps they compute what their unscaled cases do.
_CPU_ARITHMETIC_PATHS = ("contract/", "test_thor_numerics.py", "test_thor_legacy_files.py",
                         "test_thor_training.py")
#: The tests of those paths that compute nothing, count traces, raise, or compare a run with a
#: rerun of the same kernels (resumed, restored, saved and loaded, exported and served:
#: docs/architecture.md's exact class, whatever the CPU): not rerun under the caps.
_SAME_ON_EVERY_CPU = frozenset({
    "test_keras_files_load_in_one_fresh_process_safe_mode_and_resume_exactly",
    "test_inference_exports_serve_predict_without_tf_msopt",
    "test_training_savedmodel_trains_on_after_import_tf_msopt",
    "test_config_round_trips_and_keras_get", "test_default_instances_get_distinct_names",
    "test_set_weights_refuses_a_wrong_number_of_values",
    "test_set_weights_on_an_unbuilt_optimizer_fails_as_keras_does",
    "test_empty_gradient_list_is_a_no_op", "test_checkpoint_restores_and_resumes_exactly",
    "test_set_weights_transfers_the_whole_state",
    "test_plain_tf_variables_train_like_keras_variables",
    "test_wrapper_thor_cannot_find_raises", "test_statistics_only_on_thor_steps",
    "test_thor_models_build_before_tracing_their_train_step",
    "test_thor_build_before_tracing_starts_no_extra_data_iterator",
    "test_inversion_graph_traced_once_when_a_custom_step_is_traced_twice", "test_example_runs"})


#: oneDNN caps (``ONEDNN_MAX_CPU_ISA``) that keep the instructions of float16 and bfloat16.
_HALF_PRECISION_CAPS = ("ALL", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                        "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16")


def _capped_below_half_precision():
    """Why TensorFlow's float16/bfloat16 kernels crash here, or None: they follow the CPU's
    own features (AVX-512 FP16 and BF16, AMX), which a lower ``ONEDNN_MAX_CPU_ISA`` hides from
    oneDNN alone. A CPU without those features (a real AVX2 one) never takes those kernels,
    and with oneDNN's kernels off (``TF_ENABLE_ONEDNN_OPTS=0``, or TensorFlow's default on such
    a CPU) Eigen's run instead."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if cap in _HALF_PRECISION_CAPS or not compat.onednn_enabled():
        return None
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return None
    features = sorted(flags & {"avx512_fp16", "avx512_bf16", "amx_bf16", "amx_fp16"})
    if not features:
        return None
    return (f"oneDNN is capped at {cap} on a CPU with {', '.join(features)}: TensorFlow still "
            f"takes its half-precision kernels, which then crash")


def _loss_scaled_contract_case(item):
    case = getattr(item, "callspec", None) and item.callspec.params.get("case")
    return isinstance(case, str) and case.startswith("lso_")


def pytest_collection_modifyitems(config, items):
    tests = os.path.dirname(os.path.abspath(__file__))
    half_precision_crash = _capped_below_half_precision()
    for item in items:
        if item.module.__name__ in _OPS_PATH_MODULES:
            item.add_marker(pytest.mark.ops_path)
        if (os.path.relpath(str(item.path), tests).startswith(_CPU_ARITHMETIC_PATHS)
                and item.originalname not in _SAME_ON_EVERY_CPU
                and not _loss_scaled_contract_case(item)):
            item.add_marker(pytest.mark.cpu_arithmetic)
        if half_precision_crash and "half_precision" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=half_precision_crash))


@pytest.fixture
def two_cpu_strategy():
    """MirroredStrategy over two logical CPUs (:func:`helpers.two_cpu_mirrored_strategy`)."""
    return two_cpu_mirrored_strategy()


@pytest.fixture(autouse=True)
def _seeded():
    keras.utils.set_random_seed(1234)
    yield
    # Without Python's full garbage collection (0.2-0.8 s per test, most of a small test's
    # time); the automatic collector still runs.
    keras.backend.clear_session(free_memory=False)
