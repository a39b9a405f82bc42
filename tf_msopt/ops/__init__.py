"""Low-level ops: MindSpore-contract update ops and the optional compiled kernels."""
from tf_msopt.ops._loader import custom_ops_available, custom_ops_status, load_custom_ops
from tf_msopt.ops.adam import adam_offload_step, adam_offload_steps
from tf_msopt.ops.inverse import damped_inverse
from tf_msopt.ops.sign import apply_add_sign, apply_power_sign

__all__ = ["adam_offload_step", "adam_offload_steps", "apply_add_sign", "apply_power_sign",
           "custom_ops_available", "custom_ops_status", "damped_inverse"]

# Registers the ops now: a SavedModel that applies an optimizer through them loads after
# `import tf_msopt` alone.
load_custom_ops()
