"""What a training program holds and changes: ``Variable`` and ``ShardedVariable`` (``variable``), how they are
split (``partitioners``), row-sparse gradients (``indexed_slices``), the strategy scope and the closure context of
a function running on a worker (``context``), the one-round-trip push of a step's gradients (``push``), a variable's optimizer slots keyed
by optimizer class (``slots``), a worker's cache of a table's hottest rows (``hot_rows``), and dynamic embedding tables: ``DynamicEmbedding`` (``dynamic``), hash-sharded
over the ps, and the rows of one table held in one place (``dynamic_table``).

Rule: the client side of a parameter server, used by the chief and by workers alike; reaches the ps through
:mod:`kubeps.runtime.rpc` only, never imports the ps, worker, server or coordinator packages.
"""
