"""``Monitor``: THOR's health in ``fit`` logs."""
import numbers

import keras
import tensorflow as tf

from tf_msopt._validation import type_name
from tf_msopt.thor.model_link import wrapped_optimizers
from tf_msopt.thor.optimizer import wrapped_thor

__all__ = ["Monitor", "thor_state"]

#: The names of the values it logs, in the order ``compare`` prints them.
LOGGED = ("thor_kl_factor", "thor_damping", "thor_refreshes", "thor_bases_recomputed",
          "thor_bases_kept", "thor_damping_retries", "thor_failed_inverses")


def thor_state(thor):
    """``{log name: Python number}``: ``thor``'s health after its last update (counts as
    ints); empty before it is built."""
    if not thor.built:
        return {}
    state = {}
    if thor.options.kl_clip is not None:
        state["thor_kl_factor"] = thor.kl_factor
    step = keras.ops.convert_to_tensor(thor.iterations)
    damping = thor.readings.damping_at(tf.maximum(step - 1, 0))
    if damping is not None:
        state["thor_damping"] = damping
    state["thor_refreshes"] = thor.readings.refresh_count
    state["thor_bases_recomputed"], state["thor_bases_kept"] = thor.readings.refreshed_bases()
    state["thor_damping_retries"] = thor.damping_retries
    state["thor_failed_inverses"] = thor.failed_inverses
    return {name: keras.ops.convert_to_numpy(value).item() for name, value in state.items()}


class Monitor(keras.callbacks.Callback):
    """Adds the health of the model's THOR to ``fit`` logs, so the progress bar,
    ``History``, ``keras.callbacks.CSVLogger`` and ``keras.callbacks.TensorBoard`` (listed
    after this callback) show and keep it.

    At the end of each epoch (and, with ``update_freq=N``, of every ``N``-th batch) the logs
    gain, after THOR's last update:

    - ``thor_kl_factor``: the KL clip's factor ``nu`` of the last step, 1 where it did not
      shorten the step (with ``kl_clip``);
    - ``thor_damping``: ``lambda`` at the last step (where a step reads it: MindSpore's
      inverses, the LayerNorm rule or the trace rule);
    - ``thor_refreshes``: how many updates refreshed the preconditioner (steps 0, F, 2F, ...);
    - ``thor_bases_recomputed``, ``thor_bases_kept``: how many factors (a layer's ``A`` and
      ``G``) the last refresh computed anew (eigenbases, or MindSpore's inverses) and how
      many it left as they were (the eigenbasis still held, the trace rule reused it, the
      layer saw no rows);
    - ``thor_damping_retries``, ``thor_failed_inverses``: the blocks whose factorisation was
      retried with more damping, and that kept their previous state, since the start.

    The refresh count follows ``iterations`` and the two counts of blocks are optimizer
    state, so all three survive a resume. THOR counts the factors of a refresh only once
    asked (``optimizer.readings.count_refreshed_bases()``, which the monitor calls at the
    start of ``fit``; without it the step traces no operation for the count): those two
    read 0 until the first refresh of a ``fit`` with a monitor, are not saved, and read 0
    again after a resume until its first refresh.

    The values are read only where they are logged: on TensorFlow, Keras runs the
    callbacks of a batch on the training thread once its step has run, so the other
    batches wait for nothing more than without the monitor. It finds THOR inside a
    LossScaleOptimizer (Keras' or ``tf_msopt``'s) and works under a ``tf.distribute``
    strategy.

    Args:
        update_freq: ``"epoch"`` (logs at the end of each epoch); an int ``N`` (also at the end
            of every ``N``-th batch since ``fit`` began, those that
            ``keras.callbacks.TensorBoard(update_freq=N)`` writes) or ``"batch"`` (every
            batch).

    Raises:
        ValueError: at the start of ``fit``, where the model's optimizer is not THOR and
            wraps none (it names the optimizer).

    Listed before the callbacks that keep the logs::

        model.compile(optimizer=tf_msopt.thor(model), loss=...)
        model.fit(x, y, callbacks=[tf_msopt.thor.Monitor(),
                                   keras.callbacks.TensorBoard("logs")])

    It follows :class:`tf_msopt.loss_scale.LossScaleMonitor`, which does the same for the loss
    scale; :meth:`tf_msopt.THOR.report` says which layers get which rule, and docs/thor_monitor.md
    how to read the values.
    """

    def __init__(self, update_freq="epoch"):
        super().__init__()
        if update_freq not in ("epoch", "batch") and not (
                isinstance(update_freq, numbers.Integral) and not isinstance(update_freq, bool)
                and update_freq >= 1):
            raise ValueError(f"For 'Monitor', the 'update_freq' must be \"epoch\", \"batch\" "
                             f"or an int >= 1, but got {update_freq!r}.")
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self._thor, self._batches = None, 0

    def on_train_begin(self, logs=None):
        self._thor = wrapped_thor(self.model.optimizer)
        if self._thor is None:
            found = " around ".join(f"'{type_name(o)}'" for o in
                                    wrapped_optimizers(self.model.optimizer))
            raise ValueError(
                f"tf_msopt.thor.Monitor needs a model compiled with THOR "
                f"(tf_msopt.thor(model)), or a LossScaleOptimizer around it, but the "
                f"optimizer is {found}.")
        if self._thor.readings.count_refreshed_bases():
            # fit made its train function before this call; one traced without the count
            # (an earlier fit's) would keep it at 0: trace it again.
            self.model.make_train_function(force=True)
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "epoch":
            return
        self._batches += 1
        if self._batches % self.update_freq == 0:
            self._add_state(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._add_state(logs)

    def _add_state(self, logs):
        if logs is not None:
            logs.update(thor_state(self._thor))
