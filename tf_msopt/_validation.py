"""Argument checks with MindSpore's exception types and message shape.

MindSpore raises ``TypeError`` for a value of the wrong type and ``ValueError``
for a value of the right type outside its range, and names the component and the
argument: ``For 'LARS', the type of 'epsilon' should be 'float', but got type
'int'.`` Every check here returns the (possibly converted) value so callers can
write ``self.beta = check_float(beta, "beta", owner)``.
"""
import numbers

__all__ = [
    "check_bool",
    "check_float",
    "check_int",
    "check_number_range",
    "type_name",
]


def type_name(value):
    return type(value).__name__


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_bool(value, arg, owner):
    if not isinstance(value, bool):
        raise TypeError(
            f"For '{owner}', the type of '{arg}' should be 'bool', but got type '{type_name(value)}'."
        )
    return value


def check_int(value, arg, owner, min_value=None, max_value=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"For '{owner}', the type of '{arg}' should be 'int', but got type '{type_name(value)}'."
        )
    if min_value is not None and value < min_value:
        raise ValueError(
            f"For '{owner}', the argument '{arg}' must be at least {min_value}, but got {value}."
        )
    if max_value is not None and value > max_value:
        raise ValueError(
            f"For '{owner}', the argument '{arg}' must be at most {max_value}, but got {value}."
        )
    return int(value)


def check_float(value, arg, owner, allow_int=True):
    """A Python/NumPy real number, returned as ``float``.

    ``allow_int=False`` mirrors MindSpore arguments that reject ``1`` where
    ``1.0`` is meant (LARS ``epsilon``/``coefficient``, THOR ``momentum``).
    """
    is_int = isinstance(value, numbers.Integral)
    if not _is_real(value) or (is_int and not allow_int):
        raise TypeError(
            f"For '{owner}', the type of '{arg}' should be 'float', but got type '{type_name(value)}'."
        )
    return float(value)


def check_number_range(value, arg, owner, low=None, high=None, low_inclusive=True,
                       high_inclusive=True):
    """``ValueError`` unless ``low (<|<=) value (<|<=) high``; ``None`` bounds are open. NaN fails."""
    is_nan = value != value
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if is_nan or too_low or too_high:
        left = "[" if low_inclusive else "("
        right = "]" if high_inclusive else ")"
        low_text = "-inf" if low is None else float(low)
        high_text = "inf" if high is None else float(high)
        raise ValueError(
            f"For '{owner}', the '{arg}' must be in range of {left}{low_text}, {high_text}{right}, "
            f"but got {value}."
        )
    return value


def check_choice(value, arg, owner, choices):
    """``value`` if it is one of ``choices``, else a ``ValueError`` naming ``arg``."""
    if value not in choices:
        raise ValueError(f"For '{owner}', the '{arg}' must be one of {list(choices)}, "
                         f"but got {value!r}.")
    return value
