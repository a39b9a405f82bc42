"""MindSpore's loss-scale managers (``amp``): a scale on the host and the cell to update it."""
import numpy as np

from tf_msopt._common import register
from tf_msopt._validation import check_bool
from tf_msopt.loss_scale.update_cells import (DynamicLossScaleUpdateCell,
                                              FixedLossScaleUpdateCell, check_loss_scale,
                                              check_scale_factor, check_scale_window)

__all__ = ["DynamicLossScaleManager", "FixedLossScaleManager"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)
#: MindSpore's host-side manager gives up after this many consecutive overflows.
_MAX_CONSECUTIVE_OVERFLOWS = 1000



@register
class FixedLossScaleManager:
    """MindSpore's ``amp.FixedLossScaleManager``: a constant loss scale.

    With ``drop_overflow_update=True`` a step whose gradients are not finite is
    skipped; with ``False`` the gradients are never checked and every step is
    applied (MindSpore then trains with a plain ``TrainOneStepCell``).

    Args:
        loss_scale: the scale, a finite number >= 1.
        drop_overflow_update: whether to skip steps that overflow.

    Reference:
        MindSpore ``mindspore.amp.FixedLossScaleManager``.
    """

    def __init__(self, loss_scale=128.0, drop_overflow_update=True):
        owner = type(self).__name__
        self.loss_scale = check_loss_scale(loss_scale, "loss_scale", owner)
        self.drop_overflow_update = check_bool(drop_overflow_update, "drop_overflow_update",
                                               owner)

    def get_loss_scale(self):
        return self.loss_scale

    def get_drop_overflow_update(self):
        return self.drop_overflow_update

    def update_loss_scale(self, overflow):
        """Host-side update: a fixed scale never changes."""

    def get_update_cell(self):
        """A :class:`FixedLossScaleUpdateCell`, or ``None`` when overflows are not dropped."""
        if not self.drop_overflow_update:
            return None
        return FixedLossScaleUpdateCell(self.loss_scale)

    def get_config(self):
        return {"loss_scale": self.loss_scale, "drop_overflow_update": self.drop_overflow_update}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@register
class DynamicLossScaleManager:
    """MindSpore's ``amp.DynamicLossScaleManager``: the dynamic rule, host side.

    ``get_update_cell()`` returns a :class:`DynamicLossScaleUpdateCell` that
    starts from the manager's current scale; that is what
    :class:`LossScaleOptimizer` uses. ``update_loss_scale(overflow)`` runs the
    same rule on the host (Python floats)::

        if overflow: scale = max(scale / scale_factor, 1)
        elif (cur_iter - last_overflow_iter) % scale_window == 0: scale *= scale_factor

    and raises ``RuntimeError`` on the 1001st consecutive overflow. Deviation:
    a growth past float32's largest value keeps the scale.

    Args:
        init_loss_scale: the initial scale, a finite number >= 1.
        scale_factor: the factor of each growth and each decrease, > 0.
        scale_window: the number of consecutive clean steps before a growth, an
            int >= 1.

    Reference:
        MindSpore ``mindspore.amp.DynamicLossScaleManager``.
    """

    def __init__(self, init_loss_scale=2**24, scale_factor=2, scale_window=2000):
        owner = type(self).__name__
        self.init_loss_scale = check_loss_scale(init_loss_scale, "init_loss_scale", owner)
        self.scale_window = check_scale_window(scale_window, owner)
        self.scale_factor = check_scale_factor(scale_factor, owner)
        self.loss_scale = self.init_loss_scale
        self.cur_iter = 1
        self.last_overflow_iter = 0
        self.bad_step = 0

    def get_loss_scale(self):
        return self.loss_scale

    def get_drop_overflow_update(self):
        return True

    def update_loss_scale(self, overflow):
        """Host-side update of :meth:`get_loss_scale` after a step."""
        if overflow:
            self.loss_scale = max(self.loss_scale / self.scale_factor, 1.0)
            self.last_overflow_iter = self.cur_iter
            self.bad_step += 1
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                grown = self.loss_scale * self.scale_factor
                if grown <= _FLOAT32_MAX:
                    self.loss_scale = grown
            self.bad_step = 0
        if self.bad_step > _MAX_CONSECUTIVE_OVERFLOWS:
            raise RuntimeError(
                f"Dynamic loss scale: {self.bad_step} consecutive overflows, more than the "
                f"maximum of {_MAX_CONSECUTIVE_OVERFLOWS}. The loss or its gradients are not "
                f"finite even at scale {self.loss_scale}."
            )
        self.cur_iter += 1

    def get_update_cell(self):
        """A :class:`DynamicLossScaleUpdateCell` starting from the current scale."""
        return DynamicLossScaleUpdateCell(self.loss_scale, self.scale_factor, self.scale_window)

    def get_config(self):
        return {"init_loss_scale": self.init_loss_scale, "scale_factor": self.scale_factor,
                "scale_window": self.scale_window}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

