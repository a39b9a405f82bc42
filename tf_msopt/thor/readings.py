"""What THOR's refreshes did, read between steps (for :class:`~tf_msopt.thor.monitor.Monitor`).

One job: :class:`RefreshReadings`, mixed into :class:`~tf_msopt.thor.optimizer.THOR`: how
many updates refreshed, the damping a step read, and, once asked for
(:meth:`~RefreshReadings.count_refreshed_bases`), how many factors the last refresh computed
anew. Kept out of the optimizer's module, which holds its lifecycle.
"""
import keras

__all__ = ["RefreshReadings"]


class RefreshReadings:
    """THOR's readings of its refreshes, and the counts they read; reads the optimizer's
    ``iterations``, ``_schedule`` (:class:`~tf_msopt.thor.step.StepSchedule`) and
    ``_estimator`` (:class:`~tf_msopt.thor.curvature_estimator.CurvatureEstimator`, None
    until built)."""

    #: Whether the steps traced from now on count the factors each refresh computes anew
    #: (:meth:`count_refreshed_bases`).
    counts_refreshed_bases = False

    @property
    def refresh_count(self):
        """How many of the updates so far refreshed the preconditioner (steps 0, F, 2F, ...
        of ``iterations``, ``F`` the frequency): read from ``iterations``, so it survives a
        resume."""
        return self._schedule.refreshes(self.iterations)

    def count_refreshed_bases(self):
        """Has the steps traced from now on count the factors each refresh computes anew,
        which :meth:`refreshed_bases` reads (:class:`~tf_msopt.thor.monitor.Monitor` asks for
        it at the start of ``fit``). Off until asked: without it the step traces no
        operation for the count. Returns whether it was off, so a step traced before counts
        nothing until it is traced again (``model.make_train_function(force=True)``)."""
        if self.counts_refreshed_bases:
            return False
        self.counts_refreshed_bases = True
        if self._estimator is not None:    # else ``build`` switches it on
            self._estimator.count_refreshed_bases()
        return True

    def refreshed_bases(self):
        """``(recomputed, kept)``: how many factors (a factored layer's ``A`` and ``G``) the
        last refresh computed anew (their eigenbases, or MindSpore's inverses) and how many
        it left as they were (the eigenbasis still held, the trace rule reused it, the layer
        saw no rows), int64 tensors. Counted only after :meth:`count_refreshed_bases` and
        no part of the saved state: ``(0, 0)`` before the first refresh that counted them
        since THOR was built or loaded."""
        return self._estimator.refreshed_bases() if self._estimator is not None else (0, 0)

    def damping_at(self, step):
        """``lambda`` at ``step`` as the step reads it; None where no step reads it."""
        return self._schedule.damping(step) if self.uses_damping else None

    def _build_counters(self):
        """The estimator's counts (after the optimizer's own variables, as checkpoints hold
        them), the bases among them where they were asked for before the build."""
        self._estimator.build_counters(self._add_state_variable, self._add_transient_variable)
        if self.counts_refreshed_bases:
            self._estimator.count_refreshed_bases()
        self.damping_retries = self._estimator.damping_retries
        self.failed_inverses = self._estimator.failed_inverses

    def _add_transient_variable(self, shape, initializer, name, dtype="float32"):
        # Made as add_variable makes the optimizer's state, but not tracked: not saved.
        with keras.name_scope(self.name, caller=self):
            return keras.Variable(initializer, shape=shape, dtype=dtype, trainable=False,
                                  name=name)
