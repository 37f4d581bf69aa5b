"""The children of a ``PSTrainingJob``: their names, labels, ``TF_CONFIG`` and the pod, Service and Secret bodies.

Pure functions of the job (a dict as the API server returns it) and a :class:`PlanConfig`: no I/O, no clock. The
state machine that decides *when* to create or delete them is :mod:`kubeps.operator.core.planner`; this module says
*what* they are (as training-operator keeps TF_CONFIG in ``tensorflow.go`` beside its reconcile engine).

* Per replica one pod and one headless Service named ``<job>-<type>-<index>``; one Secret per job holding the
  job token and (:mod:`kubeps.runtime.certs`) the job's CA and task certificate. Pods carry the labels below, the
  chief its epoch annotation, and every pod ``restartPolicy: Never``.
* With ``spec.security.tls.mode: MutualTLS`` (the default) the main container mounts the Secret's ``ca.crt``,
  ``tls.crt`` and ``tls.key`` (never ``ca.key``) at :data:`~kubeps.runtime.contract.TLS_MOUNT_PATH` and gets the
  ``KUBEPS_TLS_*_FILE`` variables naming them.
* The main container gets ``KUBEPS_CHECKPOINT_ROOT`` (:func:`checkpoint_root`): a parameter server reads and writes
  checkpoint shards only below its ``KUBEPS_CHECKPOINT_DIR`` and the data volumes it mounts; a template that sets
  the variable keeps its own.
* A main container that asks for ``nvidia.com/gpu`` (:data:`GPU_RESOURCE`, in its limits or requests) gets
  ``KUBEPS_DEVICE=gpu`` unless its template sets the variable: the task computes on the GPU it was given or fails
  at start with the reason, never silently on the CPU (:func:`gpu_device`).
* The task settings the operator decides (TF_CONFIG, the checkpoint root, the TLS files, the device) are a
  :class:`kubeps.runtime.settings.TaskSettings` rendered by its ``to_env``, as ``kubeps local`` renders them: the
  names and formats are the ones a task parses.
* Every container gets the ``restricted`` Pod Security Standard's settings where the template leaves them unset
  (:func:`restricted_defaults`); what the template sets is kept.
* With ``spec.security.networkPolicy.mode: SameJob`` (or the operator's default) a NetworkPolicy ``<job>-kubeps``
  lets the job's pods accept traffic from the job's pods only.
* ``TF_CONFIG`` lists every task as ``<job>-<type>-<index>.<namespace>.svc[.<cluster domain>]:<port>``, built
  with :class:`kubeps.runtime.cluster.TFConfig` (the one TF_CONFIG model both halves share).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Mapping

from kubeps.runtime import certs
from kubeps.runtime.cluster import Membership, TaskSpec, TFConfig
from kubeps.runtime.contract import (CHECKPOINT_DIR_ENV, CHECKPOINT_ROOT_ENV, DEVICE_ENV, JOB_TOKEN_ENV,
                                     MEMBERSHIP_FILE_ENV, METRICS_PORT_ENV, TF_CONFIG_ENV,
                                     TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV, TLS_MOUNT_PATH, VERSION)
from kubeps.runtime.settings import TaskSettings

from kubeps.operator.api import models
from kubeps.operator.api.models import GangScheduler, NetworkPolicyMode, PSTrainingJobSpec, ReplicaType, TLSMode

#: The runtime image of containers that name none (``--default-image`` / ``KUBEPS_DEFAULT_IMAGE`` override it).
DEFAULT_IMAGE = f"ghcr.io/kubeps/kubeps-runtime:{VERSION}"

LABEL_JOB = "kubeps.dev/job-name"
LABEL_TYPE = "kubeps.dev/replica-type"
LABEL_INDEX = "kubeps.dev/replica-index"
LABEL_ROLE = "kubeps.dev/job-role"
ANNOTATION_EPOCH = "kubeps.dev/chief-epoch"
#: on the chief pod: the membership generation the operator last wrote. Changing it makes the kubelet sync the pod,
#: which refreshes the mounted membership ConfigMap at once instead of at its next periodic sync (about a minute)
ANNOTATION_MEMBERSHIP = "kubeps.dev/membership-generation"
#: on the job's Secret: how many Worker indices the task certificate's names cover (scale-up beyond: re-issued)
ANNOTATION_TLS_WORKERS = "kubeps.dev/tls-workers"
#: how many PS indices the task certificate names (a ps count raised on a running job needs a new one)
ANNOTATION_TLS_PS = "kubeps.dev/tls-ps"
MAIN_CONTAINER_NAMES = ("kubeps", "tensorflow")
TOKEN_KEY = "token"
TLS_VOLUME = "kubeps-tls"
#: the Secret's keys a pod mounts (the CA's key stays in the Secret: only the operator issues certificates)
TLS_MOUNTED_KEYS = {TLS_CA_FILE_ENV: certs.CA_CERT_KEY, TLS_CERT_FILE_ENV: certs.TLS_CERT_KEY,
                    TLS_KEY_FILE_ENV: certs.TLS_KEY_KEY}
#: the chief mounts the job's membership ConfigMap here (optional: a chief started before it exists waits for nothing)
MEMBERSHIP_VOLUME = "kubeps-membership"
MEMBERSHIP_MOUNT_PATH = "/var/run/kubeps/membership"
#: the ConfigMap's key holding the membership document (:class:`kubeps.runtime.cluster.Membership`, JSON)
MEMBERSHIP_KEY = "membership.json"
#: volume sources that hold configuration, not data: their mounts are never part of a checkpoint root
CONFIG_VOLUME_SOURCES = ("configMap", "secret", "downwardAPI", "projected")
#: the checkpoint root of a task that mounts no data volume and names no ``KUBEPS_CHECKPOINT_DIR``: the container's
#: scratch directory (a checkpoint there does not outlive the pod, so a job that keeps checkpoints mounts a volume)
SCRATCH_CHECKPOINT_ROOT = "/tmp"


@dataclass(frozen=True)
class PlanConfig:
    """What the child bodies take from the operator's settings."""

    default_image: str = DEFAULT_IMAGE
    #: Appended to ``<svc>.<namespace>.svc`` in TF_CONFIG hosts when set (e.g. ``cluster.local``).
    cluster_domain: str | None = None
    #: The NetworkPolicy of a job whose spec sets no ``security.networkPolicy.mode``.
    network_policy: NetworkPolicyMode = NetworkPolicyMode.NONE
    #: Kueue integration on: jobs labelled ``kueue.x-k8s.io/queue-name`` wait for their Workload's admission.
    kueue: bool = False
    #: The gang scheduling backend (:mod:`.gang`), and the ``schedulerName`` of the gang's pods ("": the backend's).
    gang_scheduler: GangScheduler = GangScheduler.NONE
    gang_scheduler_name: str = ""


# -- names and labels ------------------------------------------------------------------------------------------
def child_name(job: str, replica_type: ReplicaType | str, index: int) -> str:
    rt = replica_type if isinstance(replica_type, ReplicaType) else ReplicaType(replica_type)
    return f"{job}-{rt.task_type}-{index}"


def secret_name(job: str) -> str:
    return f"{job}-kubeps-token"


def network_policy_name(job: str) -> str:
    return f"{job}-kubeps"


def membership_name(job: str) -> str:
    return f"{job}-kubeps-membership"


def worker_selector(job: str) -> str:
    """The label selector of the job's Worker pods (the ``scale`` subresource's, for an HPA)."""
    return f"{LABEL_JOB}={job},{LABEL_TYPE}={ReplicaType.WORKER.task_type}"


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
    return {task_type: list(addresses) for task_type, addresses in _cluster(job, spec, config)}


def _cluster(job: Mapping[str, Any], spec: PSTrainingJobSpec,
             config: PlanConfig) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """:func:`cluster_addresses` as tuples, made once per job shape: every pod's TF_CONFIG lists every address, and
    formatting them again for each pod cost O(pods^2) per job (5.4 ms per pod body at 1,000 workers + 50 ps)."""
    replica_specs = job["spec"]["replicaSpecs"]
    shape = []
    for rt in models.REPLICA_TYPES:
        replica_spec = spec.replicaSpecs.get(rt)
        if replica_spec is not None and replica_spec.replicas:
            shape.append((rt, replica_spec.replicas, task_port(replica_specs[rt.value].get("template") or {})))
    return _formatted_cluster(job["metadata"]["name"], job["metadata"]["namespace"], config.cluster_domain,
                              tuple(shape))


@functools.lru_cache(maxsize=64)
def _formatted_cluster(name: str, namespace: str, cluster_domain: str | None,
                       shape: tuple[tuple[ReplicaType, int, int], ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    suffix = f".{namespace}.svc" + (f".{cluster_domain}" if cluster_domain else "")
    return tuple((rt.task_type, tuple(f"{child_name(name, rt, i)}{suffix}:{port}" for i in range(count)))
                 for rt, count, port in shape)


def tls_hosts(job: Mapping[str, Any], spec: PSTrainingJobSpec, config: PlanConfig,
              workers: int | None = None) -> list[str]:
    """The names the job's task certificate is valid for: every task's Service as ``<svc>.<namespace>.svc``
    (and with the cluster domain, when configured); ``workers`` Worker indices (default: the spec's replicas)."""
    name = job["metadata"]["name"]
    namespace = job["metadata"]["namespace"]
    hosts = []
    for rt in models.REPLICA_TYPES:
        replica_spec = spec.replicaSpecs.get(rt)
        if replica_spec is None:
            continue
        count = workers if rt is ReplicaType.WORKER and workers is not None else replica_spec.replicas
        for i in range(count):
            host = f"{child_name(name, rt, i)}.{namespace}.svc"
            hosts.append(host)
            if config.cluster_domain:
                hosts.append(f"{host}.{config.cluster_domain}")
    return hosts


def tls_enabled(spec: PSTrainingJobSpec) -> bool:
    return spec.security.tls.mode is TLSMode.MUTUAL


def network_policy_mode(spec: PSTrainingJobSpec, config: PlanConfig) -> NetworkPolicyMode:
    """The job's NetworkPolicy mode: its spec's, else the operator's default."""
    return spec.security.networkPolicy.mode or config.network_policy


def restricted_defaults(pod_spec: dict[str, Any]) -> None:
    """Fill in what the ``restricted`` Pod Security Standard requires where the template leaves it unset: the pod
    runs as non-root with the RuntimeDefault seccomp profile; no container may escalate privileges, and each drops
    every capability. A value the template sets (pod or container level) is kept, even one that fails the standard."""
    pod_context = pod_spec.setdefault("securityContext", {})
    containers = [c for key in ("initContainers", "containers") for c in pod_spec.get(key) or []]
    if "runAsNonRoot" not in pod_context and not any(
            "runAsNonRoot" in (c.get("securityContext") or {}) for c in containers):
        pod_context["runAsNonRoot"] = True
    if "seccompProfile" not in pod_context and not any(
            "seccompProfile" in (c.get("securityContext") or {}) for c in containers):
        pod_context["seccompProfile"] = {"type": "RuntimeDefault"}
    for container in containers:
        context = container.setdefault("securityContext", {})
        context.setdefault("allowPrivilegeEscalation", False)
        capabilities = context.setdefault("capabilities", {})
        capabilities.setdefault("drop", ["ALL"])


def _mount_tls(pod_spec: dict[str, Any], main: dict[str, Any], secret: str) -> None:
    _mount(pod_spec, main, TLS_VOLUME, TLS_MOUNT_PATH, {"secret": {
        "secretName": secret,
        "items": [{"key": key, "path": key} for key in TLS_MOUNTED_KEYS.values()],
    }})


def _mount(pod_spec: dict[str, Any], main: dict[str, Any], volume: str, path: str, source: dict[str, Any]) -> None:
    """Mount ``source`` read-only at ``path`` in the main container (a template's volume of the name is replaced)."""
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") != volume]
    volumes.append({"name": volume, **source})
    pod_spec["volumes"] = volumes
    mounts = [m for m in main.get("volumeMounts") or [] if m.get("name") != volume]
    mounts.append({"name": volume, "mountPath": path, "readOnly": True})
    main["volumeMounts"] = mounts


def checkpoint_root(pod_spec: Mapping[str, Any], main: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The ``KUBEPS_CHECKPOINT_ROOT`` the operator gives a task (the parameter servers confine ``SaveShards`` and
    ``RestoreShards`` to it, :func:`kubeps.runtime.util.storage.confine`), or None when the template sets the
    variable itself. The roots: the container's ``KUBEPS_CHECKPOINT_DIR`` (a path or URL; one set
    by ``valueFrom`` as ``$(KUBEPS_CHECKPOINT_DIR)``, which the kubelet expands) and the mount paths of its data
    volumes (every volume but configMap, secret, downwardAPI, projected and the operator's TLS volume); neither:
    :data:`SCRATCH_CHECKPOINT_ROOT`."""
    env = {e.get("name"): e for e in main.get("env") or []}
    if CHECKPOINT_ROOT_ENV in env:
        return None
    roots: list[str] = []
    directory = env.get(CHECKPOINT_DIR_ENV) or {}
    if directory.get("value"):
        roots.append(directory["value"])
    elif directory.get("valueFrom"):  # the kubelet expands it (variables defined earlier in `env`)
        roots.append(f"$({CHECKPOINT_DIR_ENV})")
    config = {v.get("name") for v in pod_spec.get("volumes") or [] if any(k in v for k in CONFIG_VOLUME_SOURCES)}
    for mount in main.get("volumeMounts") or []:
        path = mount.get("mountPath")
        if path and mount.get("name") != TLS_VOLUME and mount.get("name") not in config and path not in roots:
            roots.append(path)
    return tuple(roots) or (SCRATCH_CHECKPOINT_ROOT,)


#: the extended resource NVIDIA's device plugin advertises: a container that asks for it computes on a GPU
GPU_RESOURCE = "nvidia.com/gpu"


def gpu_device(main: Mapping[str, Any]) -> str | None:
    """``"gpu"`` when the main container asks for :data:`GPU_RESOURCE` (a count above zero in its limits or requests)
    and its env does not set ``KUBEPS_DEVICE`` itself; else None (nothing injected)."""
    if any(e.get("name") == DEVICE_ENV for e in main.get("env") or []):
        return None
    resources = main.get("resources") or {}
    asked = [(resources.get(kind) or {}).get(GPU_RESOURCE) for kind in ("limits", "requests")]
    return "gpu" if any(str(n).strip() not in ("", "0", "None") for n in asked if n is not None) else None


def tf_config_json(job: Mapping[str, Any], spec: PSTrainingJobSpec, replica_type: ReplicaType, index: int,
                   config: PlanConfig) -> str:
    cluster = _cluster(job, spec, config)
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
    metrics = next((p for p in ports if p.get("name") == models.METRICS_PORT_NAME), None)
    if metrics is None:  # every task serves Prometheus metrics on the port named "metrics" (the template's, if any)
        metrics = {"name": models.METRICS_PORT_NAME, "containerPort": models.DEFAULT_METRICS_PORT, "protocol": "TCP"}
        ports.append(metrics)
    tls = tls_enabled(job_spec)
    task = TaskSettings.model_validate({  # by variable name; what is left unset is not rendered
        METRICS_PORT_ENV: int(metrics["containerPort"]),
        TF_CONFIG_ENV: tf_config_json(job, job_spec, replica_type, index, config),
        CHECKPOINT_ROOT_ENV: checkpoint_root(spec, main) or (),  # None: the template's own variable stays
        **({env_name: f"{TLS_MOUNT_PATH}/{key}" for env_name, key in TLS_MOUNTED_KEYS.items()} if tls else {}),
        **({DEVICE_ENV: device} if (device := gpu_device(main)) else {}),
        **({MEMBERSHIP_FILE_ENV: f"{MEMBERSHIP_MOUNT_PATH}/{MEMBERSHIP_KEY}"} if replica_type is ReplicaType.CHIEF
           else {}),
    }).to_env()
    injected = {
        TF_CONFIG_ENV: {"name": TF_CONFIG_ENV, "value": task.pop(TF_CONFIG_ENV)},
        JOB_TOKEN_ENV: {
            "name": JOB_TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": TOKEN_KEY}},
        },
        "GRPC_FAIL_FAST": {"name": "GRPC_FAIL_FAST", "value": "use_caller"},
        **{env_name: {"name": env_name, "value": value} for env_name, value in task.items()},
    }
    if replica_type is ReplicaType.CHIEF:
        _mount(spec, main, MEMBERSHIP_VOLUME, MEMBERSHIP_MOUNT_PATH, {"configMap": {
            "name": membership_name(name), "optional": True, "items": [{"key": MEMBERSHIP_KEY, "path": MEMBERSHIP_KEY}],
        }})
    if tls:
        _mount_tls(spec, main, secret_name(name))
    else:  # plaintext, as the spec asks: a template's own TLS variables would make the tasks disagree
        for env_name in TLS_MOUNTED_KEYS:
            injected[env_name] = {"name": env_name, "value": ""}
    restricted_defaults(spec)
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


def _job_object_metadata(job: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Metadata of an object that belongs to the whole job (not to one replica): labelled with the job, owned by it."""
    return {
        "name": name,
        "namespace": job["metadata"]["namespace"],
        "labels": {LABEL_JOB: job["metadata"]["name"]},
        "ownerReferences": [owner_reference(job)],
    }


def network_policy_body(job: Mapping[str, Any]) -> dict[str, Any]:
    """Ingress to the job's pods from the job's pods (any port: the tasks, and what the user runs beside), and to
    the port named ``metrics`` from any pod of the cluster: the operator reads the chief's progress there, and
    Prometheus scrapes every task (metrics are read-only; the tasks' own ports stay the job's)."""
    name = job["metadata"]["name"]
    own = {"matchLabels": {LABEL_JOB: name}}
    metrics = {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": models.METRICS_PORT_NAME}]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _job_object_metadata(job, network_policy_name(name)),
        "spec": {"podSelector": own, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": own}]}, metrics]},
    }


def membership_body(job: Mapping[str, Any], membership: Membership) -> dict[str, Any]:
    """The job's membership ConfigMap: the document the chief watches (mounted at :data:`MEMBERSHIP_MOUNT_PATH`)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _job_object_metadata(job, membership_name(job["metadata"]["name"])),
        "data": {MEMBERSHIP_KEY: membership.to_json()},
    }


def membership_of(config_map: Mapping[str, Any]) -> Membership | None:
    """The document a membership ConfigMap holds; None when it holds none that parses (it is then rewritten)."""
    text = (config_map.get("data") or {}).get(MEMBERSHIP_KEY)
    if not isinstance(text, str):
        return None
    try:
        return Membership.parse(text)
    except ValueError:
        return None


def secret_body(job: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _job_object_metadata(job, secret_name(job["metadata"]["name"])),
    }
