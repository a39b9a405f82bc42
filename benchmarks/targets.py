"""When a validation metric meets a convergence target (shared by convergence.py and
kfac_jax_baseline.py)."""

# Keras reports accuracy as a float32: 900 of 1000 correct is 0.8999999762 and 950 of 1000
# is 0.9499999881, below targets of 0.9 and 0.95 written as Python floats. A tolerance far
# below one example's share of any validation set (1e-3 here) counts them as met.
TOLERANCE = 1e-6


def reaches(value, target, metric="val_accuracy"):
    """Whether a value of ``metric`` meets ``target``: a loss at or below it, an accuracy at
    or above it (both to within :data:`TOLERANCE`)."""
    if metric == "val_loss":
        return value <= target + TOLERANCE
    return value >= target - TOLERANCE
