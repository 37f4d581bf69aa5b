"""Array math: the kernels with their numpy/CuPy switch (``kernels``), the optimizers (``optimizers``) and
learning-rate schedules (``schedules``) whose math runs on the parameter servers, either rebuilt from its config
by ``hyperparams``, layers (``nn``) and losses (``losses``) with explicit forward and backward, and the pooling of
multi-hot features (``combiners``: sum, mean, sqrtn), which ``nn``, the Keras layer and the JAX path share.

Rule: pure computation on arrays; the only way out is ``Optimizer.apply_gradients`` and ``nn``'s variable
handles, which go through :mod:`kubeps.runtime.variables`.
"""
