"""The chief's code: ``ParameterServerStrategy`` (``strategy``); ``ClusterCoordinator``, the facade that wires the
parts below (``cluster_coordinator``); its options, validated once (``options``); the worker set, each worker with
its dispatch thread, and the failure handling (``workers``); what is pickled for the workers (``shipping``); the
closure queue (``closure_queue``); the exactly-once datasets' shards, leased to workers and committed
(``leases``); per-worker values and datasets (``values``); the failure detector (``failure``);
the membership controller: workers joining and leaving, resharding, checkpoint requests (``membership_controller``)
and the membership file watcher (``membership``); the hot-ps detector (``hotspots``), the progress watchdog
(``watchdog``) and the chief's exit-status contract (``supervisor``).

Rule: never imports task-side code (:mod:`kubeps.runtime.ps`, :mod:`kubeps.runtime.worker`,
:mod:`kubeps.runtime.server`); it talks to tasks through :mod:`kubeps.runtime.rpc` alone.
"""
