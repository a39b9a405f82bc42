"""What several block families share: the Kronecker block of a kernel and the input shape
a layer was built for."""
import math


def _kernel_block(cls, layer, kernel):
    shape = tuple(kernel.shape)
    return cls(layer.name, (kernel.name,), math.prod(shape[:-1]), shape[-1])


def _built_input_shape(layer):
    """The input shape ``layer`` was built for (None if unknown)."""
    return (layer.get_build_config() or {}).get("input_shape")


def _built_rank(layer):
    """The rank of the input ``layer`` was built for (0 if unknown)."""
    shape = _built_input_shape(layer)
    return 0 if shape is None else len(shape)
