"""The user's model code: how a model written with a well-kept library computes its gradients on the workers.

``autodiff`` is the custom-training-loop path (TensorFlow's ``GradientTape``) with JAX: the user writes the forward
pass and the loss with ``jax.numpy``; kubeps pulls the dense variables, gathers only the batch's embedding rows,
runs ``jax.value_and_grad`` (jit-compiled) and hands dense and row-sparse gradients to ``optimizer.apply_gradients``.
``xla`` creates jax's CPU backend with its thread pool sized to the task's CPU budget.

Rule: sits on top of :mod:`kubeps.runtime.variables` and :mod:`kubeps.runtime.ops` (what a model reads and pushes)
and below the task processes (``ps``, ``worker``, ``server``, ``coordinator``), which never need it. jax (and any
other model library) is imported lazily, inside the functions that use it, so ``import kubeps.runtime`` -- and every
ps, chief or numpy-only worker -- never loads it.
"""
