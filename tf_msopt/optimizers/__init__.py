"""The package's optimizers, one module each, on the shared base in ``base.py``."""
from tf_msopt.optimizers.adam_offload import AdamOffload
from tf_msopt.optimizers.add_sign import AddSign
from tf_msopt.optimizers.lars import LARS
from tf_msopt.optimizers.power_sign import PowerSign

__all__ = ["AdamOffload", "AddSign", "LARS", "PowerSign"]
