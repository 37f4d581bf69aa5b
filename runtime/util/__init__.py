"""Helpers with no knowledge of training: nested structures (``nest``), the CPUs a task may use and its math
thread pools (``threads``), the GIL switch interval a chief holds while it runs (``gil``), thread-safe ``.npy`` headers (``npyfiles``), documents written atomically (``files``), local and fsspec storage (``storage``), local storage confined to a root by file descriptor (``confined``), stable 64-bit hashing of embedding keys (``keyhash``) and a numpy
open-addressing key -> row index (``key_index``).

Rule: imports nothing of kubeps but :mod:`kubeps.runtime.errors` and :mod:`kubeps.runtime.contract`; no grpc.
"""
