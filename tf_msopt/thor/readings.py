"""What THOR's refreshes did, read between steps (for :class:`~tf_msopt.thor.monitor.Monitor`).

One job: :class:`RefreshReadings`, the object THOR holds as ``optimizer.readings``: how many
updates refreshed, the damping a step read, and, once asked for
(:meth:`~RefreshReadings.count_refreshed_bases`), how many factors the last refresh computed
anew.
"""
__all__ = ["RefreshReadings"]


class RefreshReadings:
    """THOR's readings of its refreshes.

    Args:
        schedule: THOR's :class:`~tf_msopt.thor.step.StepSchedule` (its step counter and
            frequency, the damping at a step).
        uses_damping: whether any step of THOR reads its damping.
    """

    def __init__(self, schedule, uses_damping):
        self.schedule, self.uses_damping = schedule, uses_damping
        #: THOR's :class:`~tf_msopt.thor.curvature_estimator.CurvatureEstimator`, once built.
        self.estimator = None
        #: Whether the steps traced from now on count the factors each refresh computes
        #: anew (:meth:`count_refreshed_bases`).
        self.counts_refreshed_bases = False

    def attach(self, estimator):
        """Reads ``estimator`` (THOR's ``build`` calls it after the counters exist)."""
        self.estimator = estimator
        if self.counts_refreshed_bases:
            estimator.count_refreshed_bases()

    @property
    def refresh_count(self):
        """How many of the updates so far refreshed the preconditioner (steps 0, F, 2F, ...
        of ``iterations``, ``F`` the frequency): read from ``iterations``, so it survives a
        resume."""
        return self.schedule.refreshes(self.schedule.step())

    def count_refreshed_bases(self):
        """Has the steps traced from now on count the factors each refresh computes anew,
        which :meth:`refreshed_bases` reads (:class:`~tf_msopt.thor.monitor.Monitor` asks for
        it at the start of ``fit``). Off until asked: without it the step traces no
        operation for the count. Returns whether it was off, so a step traced before counts
        nothing until it is traced again (``model.make_train_function(force=True)``)."""
        if self.counts_refreshed_bases:
            return False
        self.counts_refreshed_bases = True
        if self.estimator is not None:    # else ``attach`` switches it on
            self.estimator.count_refreshed_bases()
        return True

    def refreshed_bases(self):
        """``(recomputed, kept)``: how many factors (a factored layer's ``A`` and ``G``) the
        last refresh computed anew (their eigenbases, or MindSpore's inverses) and how many
        it left as they were (the eigenbasis still held, the trace rule reused it, the layer
        saw no rows), int64 tensors. Counted only after :meth:`count_refreshed_bases` and
        no part of the saved state: ``(0, 0)`` before the first refresh that counted them
        since THOR was built or loaded."""
        return self.estimator.refreshed_bases() if self.estimator is not None else (0, 0)

    def damping_at(self, step):
        """``lambda`` at ``step`` as the step reads it; None where no step reads it."""
        return self.schedule.damping(step) if self.uses_damping else None
