"""Helpers with no knowledge of training: nested structures (``nest``), the CPUs a task may use and its math
thread pools (``threads``), thread-safe ``.npy`` headers (``npyfiles``), local and fsspec storage (``storage``).

Rule: imports nothing of kubeps but :mod:`kubeps.runtime.errors` and :mod:`kubeps.runtime.contract`; no grpc.
"""
