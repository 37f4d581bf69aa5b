"""The user's model code on top of :mod:`kubeps.runtime.variables` and :mod:`kubeps.runtime.ops`: Keras 3 models
(JAX backend) trained through a ``fit``-style entry point (``keras_fit``, with the ``keras_layers`` and
``keras_callbacks`` it uses).

Rule: jax and keras are imported only by the modules that need them (the ``keras*`` modules), so
``import kubeps.runtime`` never loads them; nothing below this package imports it.
"""
