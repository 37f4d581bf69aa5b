"""The kopf shell: what kopf calls, and the reconciler that observes, plans and applies.

* :mod:`.handlers`: the kopf handlers (``kopf run -m kubeps.operator.controller.handlers`` works);
* :mod:`.reconciler`: :class:`~.reconciler.Reconciler`, kopf's memo, the sum of the parts below (as Kubeflow's
  ``JobController`` names its collaborators as fields);
* :mod:`.cache`: the latest job bodies and slim copies of their children;
* :mod:`.queue`: one reconcile per job at a time, triggers coalesced, timers;
* :mod:`.scope`: the watches behind the jobs of a namespace (or the cluster), started and retired with its jobs;
* :mod:`.control`: the actuator: creates and deletes pods, Services and jobs, and carries out a plan with its
  parts: :mod:`.credentials` (the token Secret, its certificate, the NetworkPolicy), :mod:`.membership` (the
  membership ConfigMap) and :mod:`.scheduling` (the PodGroup, Kueue's Workload, the PodDisruptionBudget), which
  share :mod:`.writes` (retry delays, bounded concurrency, the API server's message of a refusal);
* :mod:`.nodes`: the watch of Nodes and their Leases, a timer per node for a Lease going stale;
* :mod:`.progress`: reads the running jobs' chiefs' metrics and membership acks into ``status.progress`` and
  ``status.membershipAck`` (and ``PSImbalance`` Events);
* :mod:`.kopf_namespaces`: a fix for kopf's namespace patterns missing a namespace created at start;
* :mod:`.recorder`: Events (one summary per reason), status transitions counted, metrics observed;
* :mod:`.settings`, :mod:`.metrics`: the operator's settings (environment and flags) and Prometheus metrics.

Rule: the only layer that imports kopf and runs the clock. It decides nothing about a job itself: every decision is
:func:`kubeps.operator.core.planner.plan`'s; it talks to the API server through :mod:`kubeps.operator.kube`.
"""
