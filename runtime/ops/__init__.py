"""Array math: the kernels with their numpy/CuPy switch (``kernels``), the optimizers and learning-rate schedules
whose math runs on the parameter servers (``optimizers``), layers and losses with explicit forward and backward
(``nn``).

Rule: pure computation on arrays; the only way out is ``Optimizer.apply_gradients`` and ``nn``'s variable
handles, which go through :mod:`kubeps.runtime.variables`.
"""
