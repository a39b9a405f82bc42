"""The link from THOR to a ``keras.optimizers.LossScaleOptimizer`` that applies it.

``G`` is built from the gradient of the loss THOR's model computes; under a loss-scale
wrapper that loss carries the wrapper's scale, squared in ``G``, so THOR needs the
wrapper to undo it. :class:`LossScaleLink` is the part of THOR that knows it.
"""
import weakref

import keras
import tensorflow as tf

from tf_msopt._validation import type_name

__all__ = ["LossScaleLink"]


class LossScaleLink:
    """Mixin of THOR: finds and remembers the LossScaleOptimizer that applies it.

    Keras' wrapper sets its inner optimizer's ``loss_scale_factor`` to None when it
    wraps it (``_keras_compat`` checks that it still does): from then on the gradients
    THOR gets are unscaled, but ``G`` still carries the squared scale. The hook below
    notices; the wrapper itself is then linked (``tf_msopt.LossScaleOptimizer`` links
    itself) or found on the model.
    """

    def __setattr__(self, name, value):
        if name == "loss_scale_factor" and value is None and self.__dict__.get(
                "_loss_scale_link_ready"):
            self.__dict__["_thor_wrapped"] = True
        super().__setattr__(name, value)

    def _watch_loss_scale_wrapper(self):
        """Called at the end of ``__init__``: from now on a wrapper that wraps this optimizer
        is noticed."""
        self.__dict__["_loss_scale_link_ready"] = True

    def link_loss_scale_optimizer(self, optimizer):
        """Tells THOR which ``keras.optimizers.LossScaleOptimizer`` (``tf_msopt``'s
        included) applies it, so that ``G`` is divided by the square of its scale.

        ``tf_msopt.LossScaleOptimizer`` calls it itself, and a wrapper that is
        ``model.optimizer`` (or wraps it) is found without it; call it for Keras'
        class in a custom loop whose model is not compiled with the wrapper.
        """
        if not (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
                and optimizer.inner_optimizer is self):
            raise ValueError(
                f"For '{type(self).__name__}', link_loss_scale_optimizer needs the "
                f"LossScaleOptimizer whose inner_optimizer is this THOR, but got "
                f"'{type_name(optimizer)}'.")
        self._set_wrapper(optimizer)

    def _set_wrapper(self, optimizer):
        # A weak reference outside Keras' attribute tracking: the wrapper already tracks
        # THOR, and a reference back would make the two each other's dependency.
        self.__dict__["_thor_wrapper"] = weakref.ref(optimizer)
        self.__dict__["_thor_wrapped"] = True

    def scale_on_loss(self, model):
        """Every scale on the loss: ``loss_scale``, Keras' ``loss_scale_factor`` and the scale
        of the LossScaleOptimizer applying this one, if any."""
        scale = tf.constant(self.options.loss_scale * (self.loss_scale_factor or 1.0), tf.float32)
        outer = self.wrapping_loss_scale_optimizer(model)
        if outer is not None:
            scale *= tf.cast(tf.convert_to_tensor(outer.dynamic_scale), tf.float32)
        return scale

    def wrapping_loss_scale_optimizer(self, model):
        """The LossScaleOptimizer that applies this optimizer, None if there is none; looked
        for on ``model.optimizer`` when it is not linked. Raises when the optimizer is
        wrapped by one it cannot find (``G`` would keep the squared loss scale)."""
        linked = self.__dict__.get("_thor_wrapper")
        if linked is not None or not self.__dict__.get("_thor_wrapped"):
            return linked and linked()
        outer = getattr(model, "optimizer", None)
        while outer is not None and outer is not self:
            if (isinstance(outer, keras.optimizers.LossScaleOptimizer)
                    and outer.inner_optimizer is self):
                self._set_wrapper(outer)
                return outer
            outer = getattr(outer, "inner_optimizer", None)
        raise RuntimeError(
            f"This {type(self).__name__} optimizer is wrapped in a "
            f"keras.optimizers.LossScaleOptimizer that it cannot find, so it cannot undo the "
            f"loss scale in its curvature statistics. Compile the model with the wrapper "
            f"(model.compile(optimizer=wrapper)), use tf_msopt.LossScaleOptimizer, or call "
            f"thor_optimizer.link_loss_scale_optimizer(wrapper) before training.")
