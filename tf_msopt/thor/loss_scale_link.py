"""The link from THOR to a ``keras.optimizers.LossScaleOptimizer`` that applies it.

``G`` is built from the gradient of the loss THOR's model computes; under a loss-scale
wrapper that loss carries the wrapper's scale, squared in ``G``, so THOR needs the
wrapper to undo it. :class:`LossScaleLink` is the object THOR holds that knows it.
"""
import weakref

import keras
import tensorflow as tf

from tf_msopt._validation import type_name

__all__ = ["LossScaleLink"]


class LossScaleLink:
    """Finds and remembers the LossScaleOptimizer that applies a THOR (its ``inner``).

    Keras' wrapper sets its inner optimizer's ``loss_scale_factor`` to None when it wraps
    it (``_keras_compat`` checks that it still does): from then on the gradients THOR gets
    are unscaled, but ``G`` still carries the squared scale. THOR calls :meth:`wrapped`
    then (``wrapped_by_loss_scale_optimizer``); the wrapper itself is then linked
    (``tf_msopt.LossScaleOptimizer`` links itself) or found on the model.
    """

    def __init__(self):
        self._wrapper = None     # a weak reference to the wrapper, once known
        self._wrapped = False    # whether a wrapper has wrapped THOR

    def wrapped(self):
        """A LossScaleOptimizer has wrapped THOR (which one is found later)."""
        self._wrapped = True

    def link(self, optimizer, inner):
        """Links ``optimizer``, which must be a LossScaleOptimizer whose inner optimizer is
        ``inner``."""
        if not (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
                and optimizer.inner_optimizer is inner):
            raise ValueError(
                f"For '{type(inner).__name__}', link_loss_scale_optimizer needs the "
                f"LossScaleOptimizer whose inner_optimizer is this THOR, but got "
                f"'{type_name(optimizer)}'.")
        self._set_wrapper(optimizer)

    def _set_wrapper(self, optimizer):
        # A weak reference: the wrapper already tracks THOR, and a reference back would make
        # the two each other's dependency.
        self._wrapper = weakref.ref(optimizer)
        self._wrapped = True

    def scale_on_loss(self, model, inner, own_scale):
        """Every scale on the loss: ``own_scale`` (``inner``'s ``loss_scale`` times Keras'
        ``loss_scale_factor``) and the scale of the LossScaleOptimizer applying ``inner``,
        if any."""
        scale = tf.constant(own_scale, tf.float32)
        outer = self.wrapper(model, inner)
        if outer is not None:
            scale *= tf.cast(tf.convert_to_tensor(outer.dynamic_scale), tf.float32)
        return scale

    def wrapper(self, model, inner):
        """The LossScaleOptimizer that applies ``inner``, None if there is none; looked for on
        ``model.optimizer`` when it is not linked. Raises when ``inner`` is wrapped by one it
        cannot find (``G`` would keep the squared loss scale)."""
        if self._wrapper is not None or not self._wrapped:
            return self._wrapper and self._wrapper()
        outer = getattr(model, "optimizer", None)
        while outer is not None and outer is not inner:
            if (isinstance(outer, keras.optimizers.LossScaleOptimizer)
                    and outer.inner_optimizer is inner):
                self._set_wrapper(outer)
                return outer
            outer = getattr(outer, "inner_optimizer", None)
        raise RuntimeError(
            f"This {type(inner).__name__} optimizer is wrapped in a "
            f"keras.optimizers.LossScaleOptimizer that it cannot find, so it cannot undo the "
            f"loss scale in its curvature statistics. Compile the model with the wrapper "
            f"(model.compile(optimizer=wrapper)), use tf_msopt.LossScaleOptimizer, or call "
            f"thor_optimizer.link_loss_scale_optimizer(wrapper) before training.")
