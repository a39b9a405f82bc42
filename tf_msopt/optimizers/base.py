"""What every MindSpore-style optimizer of the package shares, written once.

- :func:`resolve_learning_rate`: MindSpore's learning-rate forms (number, 0-D or
  1-D tensor/array indexed by step, iterable) and Keras' (``LearningRateSchedule``,
  zero-argument callable), with MindSpore's checks.
- :func:`make_variable_filter` / :func:`serialize_filter`: ``lars_filter`` and
  ``decay_filter`` as a callable on ``keras.Variable`` or a list of regular
  expressions of variable paths to exclude.
- :class:`WrapperOfOptimizer`: ``set_weights`` and ``exclude_from_weight_decay``
  of an optimizer that wraps another (LARS, LossScaleOptimizer).
- :class:`MindSporeOptimizer`: a ``keras.optimizers.Optimizer`` with the
  optimizer-level ``jit_compile`` switch and a ``from_config`` that restores
  every serialized Keras object in the config (schedules, registered filters).
"""
import numbers
import re
from collections.abc import Iterable

import keras
import numpy as np
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import entry_point, in_xla_context, tf_variable
from tf_msopt._validation import check_bool, type_name
from tf_msopt.schedules import PerStepSchedule, Schedule

__all__ = [
    "AcceptsEmptyGradients",
    "BuildsOnceEveryReplicaIsReady",
    "MindSporeOptimizer",
    "WrapperOfOptimizer",
    "check_filter",
    "default_name",
    "make_variable_filter",
    "resolve_learning_rate",
    "serialize_filter",
    "slot_name",
    "variable_path",
]


class _UntrackedDict(dict):
    """A dict that TensorFlow's attribute tracking leaves alone (it wraps plain dicts only),
    so cached tf.functions never end up in checkpoints or SavedModels."""


def _check_non_negative_values(values, arg, owner):
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(
            f"For '{owner}', the '{arg}' must be finite and >= 0, but got {values.tolist()}."
        )


def resolve_learning_rate(value, owner, arg="learning_rate"):
    """Turns a MindSpore or Keras learning-rate form into what Keras accepts.

    Returns a ``float`` (number, 0-D tensor/array), a :class:`PerStepSchedule`
    (1-D tensor/array or iterable: entry ``i`` at step ``i``), or the given
    ``LearningRateSchedule`` / zero-argument callable unchanged.

    Raises:
        TypeError: for any other type (strings, booleans, non-float arrays).
        ValueError: for a negative or non-finite value, or an array of rank > 1.
    """
    if isinstance(value, Schedule):
        return value
    # A layer or model is callable, but never a learning rate (mso.AddSign(model)).
    if isinstance(value, (bool, str, bytes, keras.layers.Layer)):
        raise _learning_rate_type_error(value, arg, owner)
    if isinstance(value, numbers.Real):
        _check_non_negative_values(np.asarray(float(value)), arg, owner)
        return float(value)
    if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, keras.Variable)):
        array = np.asarray(value)
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise TypeError(
                f"For '{owner}', the '{arg}' tensor must have a float or int dtype, "
                f"but got {array.dtype}."
            )
        if array.ndim > 1:
            raise ValueError(
                f"For '{owner}', the '{arg}' tensor must be 0-D (a fixed value) or 1-D "
                f"(a value per step), but got shape {array.shape}."
            )
        array = array.astype(np.float64)
        _check_non_negative_values(array, arg, owner)
        return float(array) if array.ndim == 0 else PerStepSchedule(array)
    if callable(value):
        return value
    if isinstance(value, Iterable):
        array = np.asarray(list(value))
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.number) or array.dtype == bool:
            raise TypeError(
                f"For '{owner}', an iterable '{arg}' must hold numbers (one per step), "
                f"but got {array.tolist()!r}."
            )
        array = array.astype(np.float64)
        _check_non_negative_values(array, arg, owner)
        return PerStepSchedule(array)
    raise _learning_rate_type_error(value, arg, owner)


def _learning_rate_type_error(value, arg, owner):
    return TypeError(
        f"For '{owner}', the '{arg}' must be a float, int, 0-D or 1-D Tensor/array, Iterable or "
        f"LearningRateSchedule, but got type '{type_name(value)}'."
    )


def variable_path(variable):
    """The path filters match: ``keras.Variable.path``, or a plain ``tf.Variable``'s name
    without its ``:0`` suffix (Keras' optimizers accept both kinds of variable)."""
    path = getattr(variable, "path", None)
    if path is not None:
        return path
    name = str(variable.name)
    return name[:-2] if name.endswith(":0") else name


def slot_name(variable, slot):
    """Keras' name for an optimizer slot of ``variable``: ``<path with _>_<slot>``."""
    return f"{variable_path(variable).replace('/', '_').replace(':', '_')}_{slot}"


def default_name(stem):
    """``stem``, ``stem_1``, ``stem_2``, ... : Keras' automatic names for default instances
    (two ``Adam()`` are ``adam`` and ``adam_1``), from Keras' public uid counter."""
    uid = keras.backend.get_uid(stem)
    return stem if uid == 1 else f"{stem}_{uid - 1}"


def make_variable_filter(spec, default_excludes, arg, owner):
    """Returns ``predicate(keras_variable) -> bool``: True where the rule applies.

    Args:
        spec: ``None`` (exclude ``default_excludes``), a list of regular
            expressions searched in ``variable.path`` (matching variables are
            excluded), or a callable ``f(variable) -> bool``.
        default_excludes: the regular expressions used when ``spec`` is None.
        arg, owner: names for error messages.
    """
    if callable(spec):
        return lambda variable: bool(spec(variable))
    patterns = _compile_patterns(default_excludes if spec is None else spec, arg, owner)
    return lambda variable: not any(p.search(variable_path(variable)) for p in patterns)


def _compile_patterns(patterns, arg, owner):
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)) or not all(
            isinstance(p, str) for p in patterns):
        raise TypeError(
            f"For '{owner}', the '{arg}' must be None, a callable taking a keras.Variable, or a "
            f"list of regular expressions (str), but got {patterns!r}."
        )
    try:
        return [re.compile(p) for p in patterns]
    except re.error as err:
        raise ValueError(f"For '{owner}', the '{arg}' holds an invalid regular expression: {err}.")


def check_filter(spec, arg, owner):
    """Validates a filter spec at construction (so bad input fails early)."""
    if spec is not None and not callable(spec):
        _compile_patterns(spec, arg, owner)
    return spec


def serialize_filter(spec, arg, owner):
    """The config form of a filter: ``None``, the regex list, or a registered function.

    A lambda or unregistered function cannot be saved in a form that
    ``load_model(safe_mode=True)`` accepts, so saving says so instead of
    writing a file that cannot be loaded.
    """
    if spec is None or not callable(spec):
        return None if spec is None else list(spec)
    registered = keras.saving.get_registered_name(spec)
    if keras.saving.get_registered_object(registered) is not spec:
        raise ValueError(
            f"For '{owner}', the '{arg}' is the Python callable {spec!r}, which cannot be saved. "
            f"Pass a list of regular expressions of variable paths to exclude, or decorate the "
            f"function with @keras.saving.register_keras_serializable()."
        )
    return keras.saving.serialize_keras_object(spec)


class AcceptsEmptyGradients:
    """Mixin: ``apply_gradients([])`` is a no-op, as Keras' optimizer tests expect (Keras'
    own version fails to unpack an empty list)."""

    @entry_point
    def apply_gradients(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        return super().apply_gradients(grads_and_vars)


def _strategy_name(strategy):
    """The strategy's class name; "none" for TensorFlow's default (outside any scope)."""
    name = type(strategy).__name__
    return "none" if name.startswith("_") else name


class BuildsOnceEveryReplicaIsReady:
    """Mixin: first applied from ``strategy.run`` with several replicas, the optimizer
    builds in the cross-replica merge, once every replica has reached its first
    ``apply``. What each replica configures before that (``exclude_from_weight_decay``,
    say, as Keras' distributed tests do) is then in place for the build, whichever replica
    gets there first. Elsewhere Keras' ``apply`` builds as usual."""

    @entry_point
    def apply(self, grads, trainable_variables=None):
        context = tf.distribute.get_replica_context()
        if (not self.built and trainable_variables is not None and len(grads)
                and context is not None and context.num_replicas_in_sync > 1):
            trainable_variables = list(trainable_variables)
            context.merge_call(lambda strategy: self._build_in_merge(trainable_variables))
        return super().apply(grads, trainable_variables)

    def _build_in_merge(self, trainable_variables):
        with keras.name_scope(self.name, caller=self):
            self.build(trainable_variables)
        self.built = True     # as Keras' apply marks it


class WrapperOfOptimizer:
    """Mixin of the optimizers that wrap another (``inner_optimizer``: LARS,
    LossScaleOptimizer): their state includes the wrapped optimizer's, which owns the
    weight decay."""

    def set_weights(self, weights):
        """Sets every value of :attr:`variables`: the wrapper's own and then the wrapped
        optimizer's (Keras' version sets the wrapper's own only)."""
        variables = self.variables
        weights = list(weights)
        owner = type(self).__name__
        if not self.built:
            # Keras' message first: code that matches Keras' error matches this one.
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not yet been built. "
                "Please call `optimizer.build(trainable_variables)` to create the optimizer "
                "weights before calling `set_weights()`. "
                f"For '{owner}', that also builds its inner optimizer.")
        if len(weights) != len(variables):
            raise ValueError(
                f"For '{owner}', set_weights() got {len(weights)} values for "
                f"{len(variables)} variables (its own and its inner optimizer's)."
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(
                    f"For '{owner}', the optimizer variable '{variable.path}' "
                    f"has shape {tuple(variable.shape)}, but set_weights() got shape "
                    f"{tuple(np.shape(weight))}."
                )
            variable.assign(weight)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from weight decay, recorded in the wrapped optimizer."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)


class MindSporeOptimizer(BuildsOnceEveryReplicaIsReady, AcceptsEmptyGradients,
                         compat.Optimizer):
    """Base of the package's optimizers.

    Subclasses implement :meth:`_update` (the per-variable math, writing through
    ``self.assign*``) instead of ``update_step``. With ``jit_compile=True`` that
    math runs as one XLA-compiled function per variable, even when the train step
    around it is not compiled (e.g. under ``MirroredStrategy``); inside an
    XLA-compiled train step it is simply inlined.

    Args:
        learning_rate: any form accepted by :func:`resolve_learning_rate`.
        jit_compile: bool, or None for the optimizer's measured default
            (``default_jit_compile``).
        name: the optimizer's name.
        **kwargs: the usual ``keras.optimizers.Optimizer`` arguments.
    """

    #: Set per subclass from ``benchmarks/update_step.py``.
    default_jit_compile = False
    #: The name of a default instance; later ones get ``_1``, ``_2``, ... as in Keras.
    default_name_stem = None

    def __init__(self, learning_rate, name=None, jit_compile=None, **kwargs):
        owner = type(self).__name__
        if name is None:
            name = default_name(self.default_name_stem or owner.lower())
        super().__init__(learning_rate=resolve_learning_rate(learning_rate, owner), name=name,
                         **kwargs)
        self.jit_compile = (self.default_jit_compile if jit_compile is None
                            else check_bool(jit_compile, "jit_compile", owner))
        self._compiled_updates = _UntrackedDict()
        self._decay_exclusion_ids = frozenset()
        self._decay_exclusion_patterns = ()

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from weight decay: Keras' method, for every kind of decay.

        ``var_list`` names variables by object; ``var_names`` are regular
        expressions searched in each variable's path. Call it before the
        optimizer is built (Keras' rule).
        """
        if self.built:
            raise ValueError(
                f"For '{type(self).__name__}', exclude_from_weight_decay() can only be called "
                f"before the optimizer is built."
            )
        super().exclude_from_weight_decay(var_list=var_list, var_names=var_names)
        self._decay_exclusion_ids = frozenset(
            id(x) for v in var_list or () for x in (v, tf_variable(v)))
        self._decay_exclusion_patterns = tuple(var_names or ())

    def excluded_from_weight_decay(self, variable):
        """True when :meth:`exclude_from_weight_decay` excluded ``variable``."""
        if id(variable) in self._decay_exclusion_ids or id(
                tf_variable(variable)) in self._decay_exclusion_ids:
            return True
        path = variable_path(variable)
        return any(re.search(p, path) for p in self._decay_exclusion_patterns)

    def build(self, var_list):
        self._check_strategy()
        super().build(var_list)

    def _check_strategy(self):
        """Refuses to build under another strategy than the one the optimizer was created
        under: TensorFlow's own error names two strategy objects, not the fix."""
        created, current = compat.distribution_strategy(self), tf.distribute.get_strategy()
        if current is not created:
            raise RuntimeError(
                f"For '{type(self).__name__}', the optimizer was created under one "
                f"distribution strategy ({_strategy_name(created)}) and is built under "
                f"another ({_strategy_name(current)}): create it inside the same `with "
                f"strategy.scope():` as the model (tf_msopt.thor(model) included).")

    def update_step(self, gradient, variable, learning_rate):
        if self.jit_compile and not in_xla_context():
            learning_rate = tf.convert_to_tensor(learning_rate)
            # One XLA function per variable (per device component under a strategy),
            # closing over the variable so `_get_variable_index` sees the real object.
            return self._compiled(id(variable), lambda gradient, learning_rate: self._update(
                gradient, variable, learning_rate))(gradient, learning_rate)
        return self._update(gradient, variable, learning_rate)

    def _compiled(self, key, fn):
        """``fn`` as one XLA function, made once per ``key``."""
        if key not in self._compiled_updates:
            self._compiled_updates[key] = tf.function(fn, jit_compile=True, autograph=False)
        return self._compiled_updates[key]

    def _update(self, gradient, variable, learning_rate):
        raise NotImplementedError(f"{type(self).__name__} must implement _update")

    def get_config(self):
        config = super().get_config()
        config["jit_compile"] = self.jit_compile
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key, value in config.items():
            if isinstance(value, dict) and "class_name" in value:
                config[key] = keras.saving.deserialize_keras_object(
                    value, custom_objects=custom_objects)
        return cls(**config)
