"""What runs on a parameter server: its variables, optimizer slots and update counters (``state``), and the
methods of the ``kubeps.ParameterServer`` service that read and change them: the variables' (``methods``), a
training step's pushes and lookups (``push``), the dynamic embedding tables' (``dynamic``); which rows of a variable changed since a save, for incremental
checkpoints (``changes``); and how many bytes of answers one client may have it build at
once (``budget``).

Rule: task-side code. Only the server package (the composition root) imports it; the chief's code
(:mod:`kubeps.runtime.coordinator`) never does.
"""
