"""``LossScaleMonitor``: the loss-scale state in ``fit`` logs."""
import keras

from tf_msopt._validation import type_name
from tf_msopt.loss_scale.optimizer import LossScaleOptimizer

__all__ = ["LossScaleMonitor"]



class LossScaleMonitor(keras.callbacks.Callback):
    """Adds the loss-scale state of the model's :class:`LossScaleOptimizer` to ``fit`` logs.

    After every batch and epoch, ``logs`` gains ``loss_scale``,
    ``last_step_skipped`` and ``skipped_steps``, so the progress bar,
    ``History`` and ``keras.callbacks.TensorBoard`` (listed after this callback)
    show them.
    """

    def on_train_begin(self, logs=None):
        if not isinstance(self.model.optimizer, LossScaleOptimizer):
            raise ValueError(
                f"LossScaleMonitor needs a model compiled with tf_msopt.LossScaleOptimizer, but "
                f"the optimizer is '{type_name(self.model.optimizer)}'."
            )

    def on_train_batch_end(self, batch, logs=None):
        self._add_state(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._add_state(logs)

    def _add_state(self, logs):
        optimizer = self.model.optimizer
        if logs is None or not optimizer.built:
            return
        logs["loss_scale"] = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        logs["last_step_skipped"] = int(keras.ops.convert_to_numpy(optimizer.last_step_skipped))
        logs["skipped_steps"] = int(keras.ops.convert_to_numpy(optimizer.skipped_steps))
