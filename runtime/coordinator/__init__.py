"""The chief's code: ``ParameterServerStrategy`` (``strategy``), ``ClusterCoordinator`` and its dispatch threads
(``cluster_coordinator``), the closure queue (``closure_queue``), per-worker values and datasets (``values``),
the failure detector (``failure``), the membership watcher (``membership``), the hot-ps detector (``hotspots``), the progress watchdog (``watchdog``) and the chief's exit-status contract
(``supervisor``).

Rule: never imports task-side code (:mod:`kubeps.runtime.ps`, :mod:`kubeps.runtime.worker`,
:mod:`kubeps.runtime.server`); it talks to tasks through :mod:`kubeps.runtime.rpc` alone.
"""
