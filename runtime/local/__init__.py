"""``kubeps local``: a whole cluster of processes on one machine, restarted as the operator would restart pods,
scaled while it runs.

- ``launcher``: :class:`LocalCluster`, the supervisor the command runs, and ``run_local``; the sum of the parts below
- ``spec``: ``LocalJobSpec``, the job as the command's flags (or the keyword arguments) ask for it, checked once
- ``environment``: what each task is told (TF_CONFIG, metrics port, the job's settings rendered with ``to_env``)
- ``credentials``: the throw-away CA and certificate of a run's mutual TLS
- ``ports``: free ports below the kernel's ephemeral range, or consecutive ones from a base
- ``processes``: the tasks' processes, started, pumped, signalled and reaped
- ``console``: the tasks' prefixed lines and the launcher's messages
- ``scaler``: workers added and removed through the chief's membership document and its ack
- ``scaling``: the scale requests of ``kubeps local scale`` and the run directory's files
- ``restarting``: ``kubeps local --restart``, with the pure decision table in ``policy``
- ``errors``: ``LauncherError`` and ``LauncherArgumentError``

Rule: starts processes and reads their exit statuses; imports the runtime only for the TF_CONFIG model and the
membership document, the task settings, the validation dialect, the job's certificates, a health ``Ping``, the GPU
probe and the atomic write of a document.
"""
