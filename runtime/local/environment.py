"""What each task of a local job is told: its ``TF_CONFIG``, its metrics port, the job's settings, rendered into
its environment with :meth:`~kubeps.runtime.settings.TaskSettings.to_env` over the rest of the launcher's.

:func:`job_settings` decides the settings every task shares from the user's (:attr:`LocalJobSpec.settings`,
read once where the job was built): a job token, the bind address, the checkpoint roots, each task's CPU share, the
GPU's share, the TLS files. :class:`JobEnvironment` holds the job's addresses and metrics ports (the scaler changes
the workers') and renders one task's settings and environment.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from typing import Any, Mapping

from kubeps.runtime.cluster import TFConfig
from kubeps.runtime.local.ports import bracketed
from kubeps.runtime.local.spec import LocalJobSpec
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.util.threads import cpu_budget

__all__ = ["START_ORDER", "JobEnvironment", "job_settings", "task_keys"]

#: Start order: servers first, so the chief finds them listening (it retries anyway).
START_ORDER = ("ps", "worker", "evaluator", "chief")


def task_keys(cluster: Mapping[str, list[str]]) -> list[tuple[str, int]]:
    """Every ``(type, index)`` of ``cluster``, in start order."""
    return [(t, i) for t in START_ORDER for i in range(len(cluster.get(t, [])))]


def job_settings(spec: LocalJobSpec, gpu: bool, tls: Mapping[str, str | None]) -> TaskSettings:
    """The settings every task of ``spec`` is told (TF_CONFIG and the metrics port apart): the user's, and what
    they leave unset decided for this machine. ``gpu``: the workers share this machine's GPU; ``tls``: the TLS
    fields (:func:`kubeps.runtime.local.credentials.tls_settings`)."""
    given = spec.settings
    decided: dict[str, Any] = {"metrics_port": None, **tls}
    if gpu and given.gpu_tasks == 1 and spec.num_workers > 1:
        # the workers (KUBEPS_DEVICE=gpu, or unset: they take the GPU they see) share this machine's GPU: each
        # gets its share of the memory
        decided["gpu_tasks"] = spec.num_workers
    if given.job_token is None and given.job_token_file is None:
        decided["job_token"] = secrets.token_hex(24)
    if given.bind_host is None:
        decided["bind_host"] = spec.host
    if not given.checkpoint_root:
        # the parameter servers write checkpoint shards only below these: the directory kubeps local runs in and
        # the temporary directory (where the examples write); set KUBEPS_CHECKPOINT_ROOT to choose others
        decided["checkpoint_root"] = (os.getcwd(), tempfile.gettempdir())
    if given.cpus is None:
        # the machine's CPUs shared by the tasks that compute (ps and workers): math thread pools sized to
        # one task's share instead of every task starting one thread per core (see kubeps.runtime.util.threads)
        decided["cpus"] = max(1, int(cpu_budget(given)) // (spec.num_ps + spec.num_workers))
    if spec.ps_processes is not None:
        decided["ps_processes"] = spec.ps_processes
    return given.model_copy(update=decided)


class JobEnvironment:
    """The job's ``cluster`` (addresses by task type), each task's ``metrics_ports`` and the ``settings`` every
    task shares; renders a task's settings (for the chief, with its membership document and ack file,
    ``membership``) over ``environ``, the launcher's environment without its task settings."""

    def __init__(self, settings: TaskSettings, environ: Mapping[str, str], host: str,
                 cluster: dict[str, list[str]], metrics_ports: dict[tuple[str, int], int],
                 membership: tuple[str, str]):
        self.settings = settings
        self.host = host
        self.cluster = cluster
        self.metrics_ports = metrics_ports
        self._membership = membership
        # the rest of the environment passes through; the task's settings are only ever the rendered ones
        variables = set(TaskSettings.variables().values())
        self._base_env = {k: v for k, v in environ.items() if k not in variables}
        self._base_env["PYTHONUNBUFFERED"] = "1"

    def task_keys(self) -> list[tuple[str, int]]:
        """Every ``(type, index)`` of the job, in start order."""
        return task_keys(self.cluster)

    def tf_config(self, task_type: str, index: int) -> str:
        """The TF_CONFIG JSON of one task (the evaluator's cluster is just itself)."""
        return TFConfig.for_task(self.cluster, task_type, index).to_json()

    def task_settings(self, task_type: str, index: int) -> TaskSettings:
        """The settings of one task: the job's, with the task's TF_CONFIG and metrics port (and for the chief, its
        membership document and ack file)."""
        update: dict[str, Any] = {"tf_config": self.tf_config(task_type, index),
                                  "metrics_port": self.metrics_ports.get((task_type, index))}
        if task_type == "chief":
            update.update(membership_file=self._membership[0], membership_ack_file=self._membership[1])
        return self.settings.model_copy(update=update)

    def task_env(self, task_type: str, index: int) -> dict[str, str]:
        """The environment of one task: the launcher's, its settings rendered over it."""
        return {**self._base_env, **self.task_settings(task_type, index).to_env()}

    def metrics_url(self, task_type: str, index: int) -> str | None:
        """``http://host:port/metrics`` of one task, None without metrics."""
        port = self.metrics_ports.get((task_type, index))
        return f"http://{bracketed(self.host)}:{port}/metrics" if port else None

    def add_workers(self, addresses: list[str], metrics_ports: list[int]) -> range:
        """Workers at ``addresses`` (with these metrics ports, if the job has metrics) after the last: their
        indexes."""
        old = len(self.cluster["worker"])
        self.cluster["worker"].extend(addresses)
        if self.metrics_ports:
            self.metrics_ports.update(zip((("worker", i) for i in range(old, old + len(addresses))), metrics_ports))
        return range(old, old + len(addresses))

    def keep_workers(self, count: int) -> None:
        """Only the first ``count`` workers from now on."""
        for index in range(count, len(self.cluster["worker"])):
            self.metrics_ports.pop(("worker", index), None)
        del self.cluster["worker"][count:]
