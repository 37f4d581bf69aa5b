"""A ps or worker task's process: the gRPC ``Server`` (``service``), the table of methods each service offers,
composed here from the ps, worker and checkpoint packages (``methods``, the composition root), what the task's
state tells Prometheus at each scrape (``metrics``), the other server processes of a ps task that runs several
(``processes``), and ``python -m kubeps.runtime.server`` (``__main__``).

Rule: the only package that imports task-side code (:mod:`kubeps.runtime.ps`, :mod:`kubeps.runtime.worker`);
the chief's code never imports it.
"""

from kubeps.runtime.server.service import Server, main, register_ps_method, register_worker_method

__all__ = ["Server", "main", "register_ps_method", "register_worker_method"]
