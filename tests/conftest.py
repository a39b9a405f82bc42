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

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


@pytest.fixture
def two_cpu_strategy():
    """MirroredStrategy over two logical CPUs (2 replicas), with collective keys of its own.

    TensorFlow caches each collective instance (its shape) by group and instance
    key for the whole process, and every MirroredStrategy starts from the same
    keys, so without the bump a later strategy's all-reduce can be matched
    against a shape left by an earlier test ("Shape mismatch in the collective
    instance").
    """
    tf.distribute.MirroredStrategy._collective_key_base += 1000
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture(autouse=True)
def _seeded():
    keras.utils.set_random_seed(1234)
    yield
    keras.backend.clear_session()
