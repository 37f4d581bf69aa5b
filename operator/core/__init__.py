"""The operator's functional core: what a job's children are, and the state machine that decides what to do.

``plan(observed) -> Plan(actions, status)``:

* :mod:`.children`: the children's names, labels, ``TF_CONFIG`` and pod, Service and Secret bodies;
* :mod:`.observed`: the projection of an observed pod that the planner reads (:class:`~.observed.ObservedPod`);
* :mod:`.actions`: what a plan asks of the shell (create or delete a child, post an Event) and the plan itself;
* :mod:`.status`: the job's status as a reconcile rewrites it (conditions and their reasons, counts);
* :mod:`.nodes`: lost nodes, and what becomes of a job's pods on them;
* :mod:`.kueue`: the Kueue Workload protocol of a queued job;
* :mod:`.gang`: the job's PodGroup for the operator's gang scheduler, and how a pod joins it;
* :mod:`.disruption`: the job's PodDisruptionBudget over the chief and the parameter servers;
* :mod:`.progress`: a job's training progress read from its chief's metrics text (the step, examples/s) and its
  membership ack;
* :mod:`.flow`: the job state table: every move between the job's phases and its elastic waits, with its reason
  and whether it counts against backoffLimit (the waits' deadlines as data);
* :mod:`.state`: :class:`~.state.Observed`, everything one reconcile decides from, built once by the shell;
* :mod:`.draft`: :class:`~.draft.Draft`, the working state the rules share while one plan is drafted;
* :mod:`.restarts`, :mod:`.timeline`, :mod:`.security`, :mod:`.scale`: the rules, one module per concern (the
  replicas' lifecycle; suspension, Kueue, deadline, PodGroup, cleanup and TTL; the Secret, certificate and
  NetworkPolicy; templates, scale-down, Services and the status's counts);
* :mod:`.planner`: the state machine, which runs those rules in order (each move between states a row of
  :mod:`.flow`).

Rule: purely data-manipulative. No I/O, no clock (the time is :attr:`.state.Observed.now`), no randomness (the shell adds
the token); no kopf, no Kubernetes client, no aiohttp, nothing of the shell (:mod:`kubeps.operator.kube`,
:mod:`kubeps.operator.controller`). It may import :mod:`kubeps.operator.api` and, of the runtime, the TF_CONFIG
model (:mod:`kubeps.runtime.cluster`), the pod contract (:mod:`kubeps.runtime.contract`), the lifecycle table
(:mod:`kubeps.runtime.lifecycle`), the validation dialect (:mod:`kubeps.runtime.checks`) and the task settings
(:mod:`kubeps.runtime.settings`, to render a pod's environment). Table-tested in
``tests/operator/test_planner.py`` without an API server.
"""
