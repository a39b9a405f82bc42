"""AddSign optimizer."""
from tf_msopt._common import register
from tf_msopt.optimizers.sign import SignOptimizer


@register
class AddSign(SignOptimizer):
    """AddSign (Bello et al. 2017), with MindSpore's ``ops.ApplyAddSign`` semantics.

    Each step, with ``f(t)`` the sign decay at step ``t``::

        m   = beta * m + (1 - beta) * g
        var = var - lr * (alpha + f(t) * sign(g) * sign(m)) * g

    ``sign(m)`` uses the new ``m``; ``sign(0) = 0``. The step runs TensorFlow's
    fused ``ResourceApplyAddSign`` kernel where the dtype and device have one.

    Args:
        learning_rate: a float, a 0-D/1-D tensor or array (entry i at step i), an
            iterable, or a ``keras.optimizers.schedules.LearningRateSchedule``.
        alpha: the constant term (1.0 in the paper).
        beta: decay of the moving average ``m``, in [0, 1].
        sign_decay: a float, or a schedule of the step such as
            ``tf_msopt.schedules.LinearSignDecay``.
        jit_compile: run each variable's update as an XLA-compiled function
            (default off: the fused kernel measured as fast).
        name, **kwargs: the usual ``keras.optimizers.Optimizer`` arguments.

    Reference:
        Bello, Zoph, Vasudevan, Le. Neural Optimizer Search with Reinforcement
        Learning. ICML 2017. arXiv:1709.07417.
    """

    default_name_stem = "addsign"
    _rule = "add_sign"
    _coefficient = "alpha"

    def __init__(self, learning_rate=0.01, alpha=1.0, beta=0.9, sign_decay=1.0, name=None,
                 jit_compile=None, **kwargs):
        super().__init__(learning_rate, alpha, beta, sign_decay, name=name,
                         jit_compile=jit_compile, **kwargs)
