"""Every private Keras and TensorFlow name tf_msopt uses, in one place.

Keras and TensorFlow promise nothing about these names. Each one is checked when
tf_msopt is imported (it exists, and a method still takes the parameters the
package passes), so a release that renames or reshapes one makes ``import
tf_msopt`` fail with the name and the version, never train with wrong numbers. The
import also fails, saying so, where Keras runs on another backend than TensorFlow.

The rest of the package goes through the functions and base classes below: the
base classes turn Keras' private optimizer hooks into methods with package names.
"""
import functools
import inspect
import linecache
import re

import keras
import tensorflow as tf
from keras.src.backend.common import masking
from keras.src.backend.tensorflow.trainer import TFEpochIterator
from tensorflow.python.eager import record as tape_record
from tensorflow.python.framework import kernels
from tensorflow.python.ops import control_flow_util, resource_variable_ops
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.util import _pywrap_util_port

__all__ = ["KerasCompatibilityError", "LossScaleOptimizer", "Optimizer", "SYMBOLIC_BUILD",
           "check", "distribution_strategy", "flatten_layers", "gradient_may_be_recorded",
           "in_xla_context", "keras_mask", "merge_call", "onednn_enabled",
           "optimizer_own_variables", "overwrites_with_gradient", "own_iterations",
           "own_trainable_variables", "registered_kernel_devices",
           "resource_variable", "runs_every_stateful_op", "strategy_supports_no_merge_call",
           "symbolic_build", "tracked_index", "trainable_variables", "uses_weight_decay",
           "variable_index"]


class KerasCompatibilityError(ImportError):
    """Keras runs on another backend than TensorFlow, or a private Keras/TensorFlow name
    tf_msopt relies on is gone or has changed."""


# (owner, name, the parameters the package passes, after self)
_METHODS = (
    (keras.optimizers.Optimizer, "_backend_update_step",
     ("grads", "trainable_variables", "learning_rate")),
    (keras.optimizers.Optimizer, "_distributed_tf_update_step",
     ("distribution", "grads_and_vars", "learning_rate")),
    (keras.optimizers.Optimizer, "_apply_weight_decay", ("variables",)),
    (keras.optimizers.Optimizer, "_backend_increment_gradient_accumulators",
     ("grads", "acc_grads")),
    (keras.optimizers.Optimizer, "_use_weight_decay", ("variable",)),
    (keras.optimizers.Optimizer, "_get_variable_index", ("variable",)),
    (keras.optimizers.Optimizer, "_var_key", ("variable",)),
    (keras.optimizers.Optimizer, "_overwrite_variable_with_gradient", ("variable",)),
    (keras.optimizers.LossScaleOptimizer, "_tf_apply", ("grads", "trainable_variables")),
    (keras.optimizers.LossScaleOptimizer, "_common_apply", ("grads", "trainable_variables")),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_finite_grads",
     ("grads", "trainable_variables")),
    (keras.optimizers.LossScaleOptimizer, "_stateful_handle_non_finite_grads", ()),
    (keras.layers.Layer, "_flatten_layers", ("include_self", "recursive")),
    (keras.Model, "_maybe_symbolic_build", ("iterator", "data_batch")),
    (keras.Model, "_symbolic_build", ("iterator", "data_batch")),
    (trackable_base.Trackable, "_trackable_children", ("save_type",)),
)
# (owner, attributes its __init__ or build assigns on self)
_INSTANCE_ATTRIBUTES = (
    (keras.optimizers.Optimizer, ("_iterations", "_variables", "_trainable_variables",
                                  "_trainable_variables_indices", "_distribution_strategy")),
    (keras.layers.Layer, ("_trainable_variables",)),
    (keras.Model, ("_distribute_strategy",)),
    (TFEpochIterator, ("_distributed_dataset",)),
    (tf.Graph, ("experimental_acd_manager",)),
)
# (owner, method, a statement its source must hold: behaviour the package relies on)
_STATEMENTS = (
    # Optimizer.wrapped_by_loss_scale_optimizer (below) learns of the wrapping from it.
    (keras.optimizers.LossScaleOptimizer, "__init__",
     "self.inner_optimizer.loss_scale_factor = None"),
)
# (module, dotted name, parameters)
_FUNCTIONS = (
    (tf.__internal__.distribute, "strategy_supports_no_merge_call", ()),
    (tf.__internal__.distribute, "interim.maybe_merge_call", ("fn", "strategy")),
    (control_flow_util, "GraphOrParentsInXlaContext", ("graph",)),
    (kernels, "get_registered_kernels_for_op", ("name",)),
    (resource_variable_ops, "ResourceVariable", ()),
    (tape_record, "could_possibly_record", ()),
    (masking, "get_keras_mask", ("x",)),
    (_pywrap_util_port, "IsMklEnabled", ()),
)


def _versions():
    return f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def _missing(what, detail):
    return KerasCompatibilityError(
        f"tf_msopt cannot run on {_versions()}: it relies on {what}, which {detail}. "
        f"tf_msopt is tested with TensorFlow 2.21 and Keras 3.15; install those, or a "
        f"tf_msopt release that supports this version.")


def _check_parameters(function, what, parameters):
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return
    if names and names[0] == "self":
        names = names[1:]
    if names[:len(parameters)] != list(parameters):
        raise _missing(what, f"now takes ({', '.join(names)}) instead of "
                             f"({', '.join(parameters)})")


@functools.lru_cache(maxsize=None)
def _class_source(cls):
    """The source of ``cls`` ("" where it has none), read once: inspect parses the whole
    module for each class, and the checks below read the same base classes many times."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


@functools.lru_cache(maxsize=None)
def _methods_source(cls):
    """The lines of the functions defined in ``cls`` (methods, static and class methods,
    properties), read by their code's line numbers: far cheaper than :func:`_class_source`
    (Keras' Layer: milliseconds against a tenth of a second), and a subset of it."""
    parts = []
    for member in vars(cls).values():
        functions = ([member.fget, member.fset, member.fdel] if isinstance(member, property)
                     else [getattr(member, "__func__", member)])
        for function in functions:
            # Only functions: other class attributes (lazy modules, descriptors) may run code
            # when asked for attributes.
            code = (getattr(inspect.unwrap(function), "__code__", None)
                    if inspect.isfunction(function) else None)
            if code is None:
                continue
            last = max((line for _, _, line in code.co_lines() if line), default=0)
            parts += linecache.getlines(code.co_filename)[code.co_firstlineno - 1:last]
    return "".join(parts)


def _assignment(attribute):
    """The pattern of ``self.<attribute> = ...`` (or with an annotation) in source."""
    return re.compile(rf"self\.{re.escape(attribute)}\s*(:[^=]*)?=")


def _assigned_in_source(owner, attribute):
    pattern = _assignment(attribute)
    return (any(pattern.search(_methods_source(cls)) for cls in owner.__mro__)
            or any(pattern.search(_class_source(cls)) for cls in owner.__mro__))


def check():
    """Raises :class:`KerasCompatibilityError` if Keras runs on another backend, or naming
    the first private name that is gone or changed; called when tf_msopt is imported."""
    if keras.backend.backend() != "tensorflow":
        # Checked first: on another backend the private names below belong to other
        # classes, and the first one missing would blame the versions.
        raise KerasCompatibilityError(
            f"tf_msopt runs on Keras' TensorFlow backend, but Keras was loaded with the "
            f"'{keras.backend.backend()}' backend (the KERAS_BACKEND environment variable, or "
            f"\"backend\" in keras.json under KERAS_HOME or ~/.keras): set "
            f"KERAS_BACKEND=tensorflow before Keras is first imported.")
    for owner, name, parameters in _METHODS:
        what = f"{owner.__module__}.{owner.__qualname__}.{name}"
        method = getattr(owner, name, None)
        if not callable(method):
            raise _missing(what, "does not exist")
        _check_parameters(method, what, parameters)
    for owner, attributes in _INSTANCE_ATTRIBUTES:
        for attribute in attributes:
            if not _assigned_in_source(owner, attribute):
                raise _missing(f"{owner.__qualname__}.{attribute}",
                               "is no longer set by the class")
    for owner, method, statement in _STATEMENTS:
        try:
            source = inspect.getsource(getattr(owner, method))
        except (OSError, TypeError):
            continue
        if statement not in source:
            raise _missing(f"{owner.__qualname__}.{method} running `{statement}`",
                           "it no longer does")
    for module, dotted, parameters in _FUNCTIONS:
        what = f"{module.__name__}.{dotted}"
        target = module
        for part in dotted.split("."):
            target = getattr(target, part, None)
        if not callable(target):
            raise _missing(what, "does not exist")
        _check_parameters(target, what, parameters)


check()


# ----------------------------------------------------------------------- accessors


def flatten_layers(model):
    """Every layer inside ``model`` (nested models, wrappers and sub-layers), depth first."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def own_trainable_variables(layer):
    """The trainable variables ``layer`` itself creates (not its sub-layers')."""
    return [v for v in layer._trainable_variables if v.trainable]


def distribution_strategy(optimizer):
    """The strategy ``optimizer`` was created under."""
    return optimizer._distribution_strategy


def trainable_variables(optimizer):
    """The variables ``optimizer`` was built for, in order."""
    return optimizer._trainable_variables


def own_iterations(optimizer):
    """``optimizer``'s own step counter (a wrapper's ``iterations`` may forward elsewhere)."""
    return optimizer._iterations


def optimizer_own_variables(optimizer):
    """``optimizer``'s own variables (a wrapper's, without its inner optimizer's)."""
    return optimizer._variables


def variable_index(optimizer, variable):
    """The position of ``variable`` among the variables ``optimizer`` was built for."""
    return optimizer._get_variable_index(variable)


def tracked_index(optimizer, variable):
    """Like :func:`variable_index`, or None for a variable the optimizer does not track."""
    return optimizer._trainable_variables_indices.get(optimizer._var_key(variable))


def uses_weight_decay(optimizer, variable):
    """False where ``exclude_from_weight_decay`` excludes ``variable``."""
    return optimizer._use_weight_decay(variable)


def overwrites_with_gradient(optimizer, variable):
    """True for a variable whose "gradient" is its new value (``overwrite_with_gradient``)."""
    return optimizer._overwrite_variable_with_gradient(variable)


def run_once_a_step_state(optimizer, learning_rate):
    """Runs what ``optimizer`` updates once a step around its per-variable ``update_step``
    (Keras' Nadam: its ``u_product``, in its own ``_backend_update_step``), over no
    variables: for a wrapper that calls that ``update_step`` itself."""
    step = type(optimizer)._backend_update_step
    if step not in (keras.optimizers.Optimizer._backend_update_step,
                    Optimizer._backend_update_step):
        step(optimizer, [], [], learning_rate)


def merge_call(fn, strategy, *args):
    """``fn(strategy, *args)`` in cross-replica context, from replica context."""
    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def strategy_supports_no_merge_call():
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def registered_kernel_devices(op_name):
    """The device types (``"CPU"``, ``"GPU"``) with a kernel registered for ``op_name``."""
    return {kernel.device_type for kernel in kernels.get_registered_kernels_for_op(op_name).kernel}


def resource_variable(**kwargs):
    """A plain ``tf.Variable`` created without the variable creators of the current scope's
    strategy (the caller passes ``next_creator``'s keyword arguments)."""
    return resource_variable_ops.ResourceVariable(**kwargs)


# The model method fit, evaluate, train_on_batch and test_on_batch call with their data
# before they trace a step; it builds the model's state (layers, compiled metrics and loss,
# optimizer) from one batch, but only under a distribution strategy.
SYMBOLIC_BUILD = "_maybe_symbolic_build"


def symbolic_build(model, original, iterator=None, data_batch=None):
    """What ``original`` (``model``'s own :data:`SYMBOLIC_BUILD`) does under a strategy,
    done without one too: the step is then traced once. Without a strategy Keras builds
    inside the first trace, and a ``tf.function`` whose first trace creates variables
    (the compiled metrics', the optimizer's) is traced a second time.

    The build needs only the batch's structure, shapes and dtypes, so they are read from
    the epoch iterator's dataset: pulling a batch would start an iterator that fit and
    evaluate tear down right after, while its prefetch stops."""
    if model._distribute_strategy is not None:
        return original(iterator=iterator, data_batch=data_batch)
    if iterator is not None:
        data_batch = iterator._distributed_dataset.element_spec
    if data_batch is None:
        return original(iterator=iterator, data_batch=data_batch)
    return model._symbolic_build(data_batch=data_batch)


def runs_every_stateful_op():
    """True when eager, or while tracing under ``tf.function``'s automatic control
    dependencies: a stateful op traced now runs even if nothing depends on it, after the
    ops traced before it that touch the same resources and before those traced after."""
    return tf.executing_eagerly() or (
        tf.compat.v1.get_default_graph().experimental_acd_manager is not None)


def gradient_may_be_recorded():
    """True where a gradient tape may record what runs or is traced now: a tape is active
    in this thread (also one outside the ``tf.function`` being traced). False in
    ``predict``, ``evaluate`` and the functions ``model.export`` or
    ``tf.saved_model.save`` trace for serving."""
    return tape_record.could_possibly_record()


def keras_mask(tensor):
    """The mask Keras attached to ``tensor`` (``Embedding(mask_zero=True)``, ``Masking``),
    or None."""
    return masking.get_keras_mask(tensor)


def in_xla_context():
    """True while tracing inside a ``jit_compile=True`` function."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def onednn_enabled():
    """Whether TensorFlow runs oneDNN's CPU kernels in this process: as
    ``TF_ENABLE_ONEDNN_OPTS`` says where it is set, else TensorFlow's choice for the CPU, on
    only where it has AVX-512 VNNI or BF16, AVX-VNNI or AMX (off on an AVX2 AMD Zen 3)."""
    return bool(_pywrap_util_port.IsMklEnabled())


# ------------------------------------------------------------------------- hooks


class Optimizer(keras.optimizers.Optimizer):
    """``keras.optimizers.Optimizer`` with its private hooks under package names.

    Subclasses override :meth:`update_variables` (all variables of a step),
    :meth:`distributed_update` (the same, in cross-replica context), :meth:`decay_weights`
    (decoupled weight decay), :meth:`accumulate_gradients` (a step of gradient
    accumulation that does not update) and :meth:`wrapped_by_loss_scale_optimizer` instead
    of Keras' private methods and behaviour.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__["_compat_initialized"] = True

    def __setattr__(self, name, value):
        # Keras' LossScaleOptimizer turns its inner optimizer's own scaling off by assigning
        # ``loss_scale_factor = None`` (a statement checked above); Keras' tracking skips an
        # assignment of the value an attribute already holds, so it is seen here, before.
        if (name == "loss_scale_factor" and value is None
                and self.__dict__.get("_compat_initialized")):
            self.wrapped_by_loss_scale_optimizer()
        super().__setattr__(name, value)

    def wrapped_by_loss_scale_optimizer(self):
        """A ``keras.optimizers.LossScaleOptimizer`` has wrapped this optimizer: from now on
        its gradients arrive unscaled. Nothing by default."""

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        return self.update_variables(grads, trainable_variables, learning_rate)

    def update_variables(self, grads, trainable_variables, learning_rate):
        return keras.optimizers.Optimizer._backend_update_step(
            self, grads, trainable_variables, learning_rate)

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        return self.distributed_update(distribution, grads_and_vars, learning_rate)

    def distributed_update(self, distribution, grads_and_vars, learning_rate):
        return keras.optimizers.Optimizer._distributed_tf_update_step(
            self, distribution, grads_and_vars, learning_rate)

    def _apply_weight_decay(self, variables):
        return self.decay_weights(variables)

    def _backend_increment_gradient_accumulators(self, grads, acc_grads):
        return self.accumulate_gradients(grads, acc_grads)

    def accumulate_gradients(self, grads, acc_grads):
        """With ``gradient_accumulation_steps``: adds ``grads`` to their accumulators on
        the steps that do not update."""
        return keras.optimizers.Optimizer._backend_increment_gradient_accumulators(
            self, grads, acc_grads)

    def decay_weights(self, variables):
        return keras.optimizers.Optimizer._apply_weight_decay(self, variables)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":
            children.update(self.savedmodel_only_children())
        return children

    def savedmodel_only_children(self):
        """``{name: trackable}`` that a SavedModel holds beside the optimizer's variables but
        a checkpoint does not: state that functions traced from the optimizer capture and
        that is no part of the optimizer's saved state."""
        return {}


class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """``keras.optimizers.LossScaleOptimizer`` with its private hooks under package names:
    :meth:`apply_in_context` (``apply`` on TensorFlow), :meth:`apply_checked` (finite
    check, then one of the next two), :meth:`apply_finite` and :meth:`skip_non_finite`."""

    def _tf_apply(self, grads, trainable_variables=None):
        return self.apply_in_context(grads, trainable_variables)

    def apply_in_context(self, grads, trainable_variables=None):
        return keras.optimizers.LossScaleOptimizer._tf_apply(self, grads, trainable_variables)

    def apply_checked(self, grads, trainable_variables=None):
        return self._common_apply(grads, trainable_variables)

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        return self.apply_finite(grads, trainable_variables)

    def apply_finite(self, grads, trainable_variables):
        return keras.optimizers.LossScaleOptimizer._stateful_handle_finite_grads(
            self, grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self):
        return self.skip_non_finite()

    def skip_non_finite(self):
        return keras.optimizers.LossScaleOptimizer._stateful_handle_non_finite_grads(self)
