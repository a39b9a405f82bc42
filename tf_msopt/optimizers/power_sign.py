"""PowerSign optimizer."""
import math

from tf_msopt._common import register
from tf_msopt.optimizers.sign import SignOptimizer


@register
class PowerSign(SignOptimizer):
    """PowerSign (Bello et al. 2017), with MindSpore's ``ops.ApplyPowerSign`` semantics.

    Each step, with ``f(t)`` the sign decay at step ``t``::

        m   = beta * m + (1 - beta) * g
        var = var - lr * exp(logbase * f(t) * sign(g) * sign(m)) * g

    ``logbase`` is the natural log of the paper's base: the gradient is scaled by
    ``e**logbase`` where its sign agrees with ``m`` and by ``e**-logbase`` where
    it does not. The default ``logbase = e`` follows MindSpore's examples; the
    paper's base ``e`` is ``logbase = 1.0``.

    Args:
        learning_rate: as for :class:`tf_msopt.AddSign`.
        logbase: natural log of the base.
        beta: decay of the moving average ``m``, in [0, 1].
        sign_decay: a float or a schedule of the step.
        jit_compile: run each variable's update as an XLA-compiled function
            (default off: the package's one-pass kernel is faster).
        name, **kwargs: the usual ``keras.optimizers.Optimizer`` arguments.

    Reference:
        Bello, Zoph, Vasudevan, Le. Neural Optimizer Search with Reinforcement
        Learning. ICML 2017. arXiv:1709.07417.
    """

    default_name_stem = "powersign"
    _rule = "power_sign"
    _coefficient = "logbase"
    # The one-pass custom kernel beats XLA's fused update on CPU (benchmarks/update_step.py);
    # XLA cannot call it, so a jit-compiled update would give that speed away.
    default_jit_compile = False

    def __init__(self, learning_rate=0.01, logbase=math.e, beta=0.9, sign_decay=1.0,
                 name=None, jit_compile=None, **kwargs):
        super().__init__(learning_rate, logbase, beta, sign_decay, name=name,
                         jit_compile=jit_compile, **kwargs)
