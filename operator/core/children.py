"""The children of a ``PSTrainingJob``: their names, labels, ``TF_CONFIG`` and the pod, Service and Secret bodies.

Pure functions of the job (a dict as the API server returns it) and a :class:`PlanConfig`: no I/O, no clock. The
state machine that decides *when* to create or delete them is :mod:`kubeps.operator.core.planner`; this module says
*what* they are (as training-operator keeps TF_CONFIG in ``tensorflow.go`` beside its reconcile engine).

* Per replica one pod and one headless Service named ``<job>-<type>-<index>``; one Secret per job holding the
  job token. Pods carry the labels below, the chief its epoch annotation, and every pod ``restartPolicy: Never``.
* ``TF_CONFIG`` lists every task as ``<job>-<type>-<index>.<namespace>.svc[.<cluster domain>]:<port>``, built
  with :class:`kubeps.runtime.cluster.TFConfig` (the one TF_CONFIG model both halves share).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Mapping

from kubeps.runtime.cluster import TaskSpec, TFConfig
from kubeps.runtime.contract import JOB_TOKEN_ENV, TF_CONFIG_ENV

from kubeps.operator.api import models
from kubeps.operator.api.models import PSTrainingJobSpec, ReplicaType

#: The runtime image of containers that name none (``--default-image`` / ``KUBEPS_DEFAULT_IMAGE`` override it).
DEFAULT_IMAGE = "ghcr.io/kubeps/kubeps-runtime:0.1.0"

LABEL_JOB = "kubeps.dev/job-name"
LABEL_TYPE = "kubeps.dev/replica-type"
LABEL_INDEX = "kubeps.dev/replica-index"
LABEL_ROLE = "kubeps.dev/job-role"
ANNOTATION_EPOCH = "kubeps.dev/chief-epoch"
MAIN_CONTAINER_NAMES = ("kubeps", "tensorflow")
TOKEN_KEY = "token"


@dataclass(frozen=True)
class PlanConfig:
    """What the child bodies take from the operator's settings."""

    default_image: str = DEFAULT_IMAGE
    #: Appended to ``<svc>.<namespace>.svc`` in TF_CONFIG hosts when set (e.g. ``cluster.local``).
    cluster_domain: str | None = None


# -- names and labels ------------------------------------------------------------------------------------------
def child_name(job: str, replica_type: ReplicaType | str, index: int) -> str:
    rt = replica_type if isinstance(replica_type, ReplicaType) else ReplicaType(replica_type)
    return f"{job}-{rt.task_type}-{index}"


def secret_name(job: str) -> str:
    return f"{job}-kubeps-token"


def selector_labels(job: str, replica_type: ReplicaType, index: int) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_TYPE: replica_type.task_type, LABEL_INDEX: str(index)}


def child_labels(job: str, replica_type: ReplicaType, index: int) -> dict[str, str]:
    return {**selector_labels(job, replica_type, index), LABEL_ROLE: replica_type.task_type}


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "apiVersion": job.get("apiVersion", models.API_VERSION),
        "kind": job.get("kind", models.KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def main_container(containers: list[dict[str, Any]]) -> dict[str, Any]:
    """The container that gets TF_CONFIG: named ``kubeps``, else ``tensorflow`` (TFJob's), else the first."""
    for wanted in MAIN_CONTAINER_NAMES:
        for container in containers:
            if container.get("name") == wanted:
                return container
    return containers[0]


def task_port(template: Mapping[str, Any]) -> int:
    """The port of a replica type: the main container's ``kubeps-port`` (or ``tfjob-port``), else 2222."""
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        return models.DEFAULT_PORT
    for port in main_container(containers).get("ports") or []:
        if port.get("name") in (models.PORT_NAME, models.TFJOB_PORT_NAME):
            return int(port["containerPort"])
    return models.DEFAULT_PORT


# -- bodies ---------------------------------------------------------------------------------------------------
def cluster_addresses(job: Mapping[str, Any], spec: PSTrainingJobSpec, config: PlanConfig) -> dict[str, list[str]]:
    """Every task's address by task type. The counts are the parsed spec's (its defaults, as the planner's); the
    ports are read from the templates as written."""
    name = job["metadata"]["name"]
    namespace = job["metadata"]["namespace"]
    suffix = f".{namespace}.svc" + (f".{config.cluster_domain}" if config.cluster_domain else "")
    replica_specs = job["spec"]["replicaSpecs"]
    cluster: dict[str, list[str]] = {}
    for rt in models.REPLICA_TYPES:
        replica_spec = spec.replicaSpecs.get(rt)
        if replica_spec is None:
            continue
        count = replica_spec.replicas
        port = task_port(replica_specs[rt.value].get("template") or {})
        if count:
            cluster[rt.task_type] = [f"{child_name(name, rt, i)}{suffix}:{port}" for i in range(count)]
    return cluster


def tf_config_json(job: Mapping[str, Any], spec: PSTrainingJobSpec, replica_type: ReplicaType, index: int,
                   config: PlanConfig) -> str:
    addresses = cluster_addresses(job, spec, config)
    cluster = tuple((task_type, tuple(task_addresses)) for task_type, task_addresses in addresses.items())
    task = TaskSpec(type=replica_type.task_type, index=index)
    return _validated(cluster, replica_type.task_type).model_copy(update={"task": task}).to_json()


@functools.lru_cache(maxsize=64)
def _validated(cluster: tuple[tuple[str, tuple[str, ...]], ...], task_type: str) -> TFConfig:
    """The TF_CONFIG of a job's first task of ``task_type``, validated once: every address of the cluster was
    checked again for each of its pods (O(N^2) per job), now once per job and task type."""
    return TFConfig.for_task({t: list(a) for t, a in cluster}, task_type, 0)


def pod_body(job: Mapping[str, Any], job_spec: PSTrainingJobSpec, replica_type: ReplicaType, index: int, epoch: int,
             config: PlanConfig) -> dict[str, Any]:
    """The pod of one replica, from its template plus everything the operator owns (``job_spec`` is the job's
    ``spec`` parsed, :func:`kubeps.operator.api.models.parse_spec`)."""
    name = job["metadata"]["name"]
    namespace = job["metadata"]["namespace"]
    template = copy.deepcopy(job["spec"]["replicaSpecs"][replica_type.value]["template"])
    tmeta = template.get("metadata") or {}
    spec = template.get("spec") or {}
    pod_name = child_name(name, replica_type, index)
    labels = {**(tmeta.get("labels") or {}), **child_labels(name, replica_type, index)}
    annotations = dict(tmeta.get("annotations") or {})
    if replica_type is ReplicaType.CHIEF:
        annotations[ANNOTATION_EPOCH] = str(epoch)
    metadata = {
        "name": pod_name,
        "namespace": namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(job)],
    }
    if annotations:
        metadata["annotations"] = annotations
    spec["restartPolicy"] = "Never"
    containers = spec["containers"]
    for container in containers:
        if not container.get("image"):
            container["image"] = config.default_image
    main = main_container(containers)
    ports = main.setdefault("ports", [])
    if not any(p.get("name") in (models.PORT_NAME, models.TFJOB_PORT_NAME) for p in ports):
        ports.append({"name": models.PORT_NAME, "containerPort": models.DEFAULT_PORT, "protocol": "TCP"})
    injected = {
        TF_CONFIG_ENV: {"name": TF_CONFIG_ENV, "value": tf_config_json(job, job_spec, replica_type, index, config)},
        JOB_TOKEN_ENV: {
            "name": JOB_TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": TOKEN_KEY}},
        },
        "GRPC_FAIL_FAST": {"name": "GRPC_FAIL_FAST", "value": "use_caller"},
    }
    env = [e for e in main.get("env") or [] if e.get("name") not in injected]
    main["env"] = env + list(injected.values())
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def service_body(job: Mapping[str, Any], replica_type: ReplicaType, index: int) -> dict[str, Any]:
    name = job["metadata"]["name"]
    port = task_port(job["spec"]["replicaSpecs"][replica_type.value].get("template") or {})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": child_name(name, replica_type, index),
            "namespace": job["metadata"]["namespace"],
            "labels": child_labels(name, replica_type, index),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(name, replica_type, index),
            "ports": [{"name": models.PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def secret_body(job: Mapping[str, Any]) -> dict[str, Any]:
    name = job["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name(name),
            "namespace": job["metadata"]["namespace"],
            "labels": {LABEL_JOB: name},
            "ownerReferences": [owner_reference(job)],
        },
    }
