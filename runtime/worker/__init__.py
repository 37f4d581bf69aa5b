"""What runs on a worker: the resources it holds between closures and the ``kubeps.Worker`` service's methods
that run the chief's pickled functions (``state``).

Rule: task-side code. Only the server package (the composition root) imports it; the chief's code
(:mod:`kubeps.runtime.coordinator`) never does.
"""
