"""Array math: the kernels with their numpy/CuPy switch (``kernels``), the optimizers (``optimizers``) and
learning-rate schedules (``schedules``) whose math runs on the parameter servers, either rebuilt from its config
by ``hyperparams``, and layers (``nn``) and losses (``losses``) with explicit forward and backward.

Rule: pure computation on arrays; the only way out is ``Optimizer.apply_gradients`` and ``nn``'s variable
handles, which go through :mod:`kubeps.runtime.variables`.
"""
