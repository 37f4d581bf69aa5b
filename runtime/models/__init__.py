"""The user's model code: how a model written with a well-kept library computes its gradients on the workers.

``autodiff`` is the custom-training-loop path (TensorFlow's ``GradientTape``) with JAX: the user writes the forward
pass and the loss with ``jax.numpy``; kubeps pulls the dense variables, gathers only the batch's embedding rows,
runs ``jax.value_and_grad`` (jit-compiled) and hands dense and row-sparse gradients to ``optimizer.apply_gradients``.
``xla`` creates jax's CPU backend with its thread pool sized to the task's CPU budget.

``keras_fit`` trains Keras 3 models (JAX backend) through a ``fit``-style entry point, with ``keras_layers``
(``KubepsEmbedding``: tables on the ps), ``keras_callbacks`` (``ModelCheckpoint``, ``BackupAndRestore``,
``TensorBoard``; Keras's own callbacks are called through their protocol) and ``keras_metrics`` (Keras metrics summed
from the workers' states, validation on the chief).
``export`` turns a checkpoint into a ``.keras`` file and an ONNX model for serving (``kubeps export``).

Rule: sits on top of :mod:`kubeps.runtime.variables`, :mod:`kubeps.runtime.ops` and
:mod:`kubeps.runtime.checkpoint` (what a model reads, pushes and saves) and below the task processes (``ps``,
``worker``, ``server``, ``coordinator``), which never need it but to size XLA's pool. jax and keras are imported
only by the modules and functions that use them, so ``import kubeps.runtime`` -- and every ps, chief or
numpy-only worker -- never loads them.
"""
