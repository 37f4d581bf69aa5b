"""What runs on a parameter server: its variables, optimizer slots and update counters (``state``), the
methods of the ``kubeps.ParameterServer`` service that read and change them (``methods``), and this ps's shard of
every dynamic embedding table with the methods that create, look up, update and export them (``dynamic``).

Rule: task-side code. Only the server package (the composition root) imports it; the chief's code
(:mod:`kubeps.runtime.coordinator`) never does.
"""
