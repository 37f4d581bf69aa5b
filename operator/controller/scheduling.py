"""The objects other schedulers read of a job, as the actuator writes them: the gang's PodGroup (read once, then
remembered: not watched), Kueue's Workload, and the PodDisruptionBudget over the chief and the ps. A refusal no
retry can fix (400, 422 of a PodGroup or a Workload) fails the job, as a refused pod does."""

from __future__ import annotations

from kubeps.operator.core import disruption, kueue
from kubeps.operator.core.actions import (ApplyWorkloadStatus, CreatePodGroup, CreateWorkload, DeletePodGroup,
                                          DeleteWorkload, PatchWorkload)
from kubeps.operator.core.observed import controlled_by
from kubeps.operator.kube.client import ApiError

from .cache import Body, Key
from .writes import RETRY_CREATE_AFTER, RETRY_SECRET_AFTER, ControlPart, api_message


class SchedulingControl(ControlPart):
    """Creates and deletes the job's PodGroup, its Kueue Workload and its PodDisruptionBudget."""

    async def read_own_pod_group(self, key: Key, uid: str | None, api_version: str) -> Body | None:
        """The job's PodGroup if it exists and belongs to this job, else None; read once, then remembered (PodGroups
        are not watched: the operator makes and deletes them itself)."""
        known = self.cache.pod_groups.get(key)
        if known is not None and known[0] == uid:
            return {"metadata": {"name": key[1]}} if known[1] else None
        group = await self.kube.read_pod_group(api_version, key[0], key[1])
        if group is not None and (group.get("metadata") or {}).get("deletionTimestamp"):
            # Being deleted (Kubernetes keeps a native PodGroup until no running pod uses it): no pod may join it,
            # and a new one can be made only once it is gone. Read again next time.
            self.cache.pod_groups.pop(key, None)
            return None
        mine = group is not None and controlled_by(group, uid)
        self.cache.pod_groups[key] = (uid, mine)
        return group if mine else None

    async def create_pod_group(self, key: Key, job: Body, action: CreatePodGroup) -> bool:
        """Create the job's PodGroup; returns whether the job's own PodGroup exists now (else no pod is made)."""
        uid = job["metadata"]["uid"]
        api_version = action.body["apiVersion"]
        try:
            await self.kube.create_pod_group(key[0], action.body)
        except ApiError as err:
            if err.status == 409:
                self.cache.pod_groups.pop(key, None)
                if await self.read_own_pod_group(key, uid, api_version) is not None:
                    return True
                if key in self.cache.pod_groups:  # not being deleted: someone else's
                    self.recorder.event(job, "Warning", "PodGroupConflict",
                                        f"PodGroup {action.name} exists but belongs to another owner; waiting for "
                                        f"it to be removed before creating pods")
                else:  # e.g. the job's previous one, kept by Kubernetes until its last pod has stopped
                    self.recorder.event(job, "Normal", "PodGroupTerminating",
                                        f"PodGroup {action.name} is being deleted; waiting for it to be gone before "
                                        f"creating pods")
                self.retry(key, RETRY_SECRET_AFTER)
                return False
            self.recorder.api_error("create-podgroup", err.status)
            message = f"Could not create {api_version} PodGroup {action.name}: {api_message(err)}"
            if err.status in (400, 422):
                await self.fail(key, "InvalidPodGroup", f"The API server rejected the {api_version} PodGroup "
                                                        f"{action.name}: {api_message(err)}")
                return False
            if err.status == 404:
                message += (" (is the gang scheduler's PodGroup CRD installed? The operator's --gang-scheduler "
                            "names its backend)")
            self.recorder.event(job, "Warning", "PodGroupCreateFailed", message + "; retrying")
            self.retry(key, RETRY_CREATE_AFTER)
            return False
        self.cache.pod_groups[key] = (uid, True)
        self.recorder.pod_group_created()
        self.recorder.event(job, "Normal", "PodGroupCreated", f"Created {api_version} PodGroup {action.name}")
        return True

    async def delete_pod_group(self, key: Key, job: Body, action: DeletePodGroup) -> tuple[str, str] | None:
        try:
            await self.kube.delete_pod_group(action.api_version, key[0], action.name)
        except ApiError as err:
            if err.status != 404:
                self.recorder.api_error("delete-podgroup", err.status)
                raise
            self.cache.pod_groups[key] = (job["metadata"].get("uid"), False)
            return None
        self.cache.pod_groups[key] = (job["metadata"].get("uid"), False)
        self.recorder.pod_group_deleted()
        return "PodGroupDeleted", f"{action.name} ({action.reason})"

    async def workload(self, key: Key, job: Body,
                       action: CreateWorkload | PatchWorkload | ApplyWorkloadStatus | DeleteWorkload) -> None:
        """Create, patch, apply the status of, or delete the job's Kueue Workload. A create that finds it there
        and a delete that finds it gone are no-ops; a conflict or a refusal that may pass is retried (Warning);
        a Workload Kueue's webhooks refuse (400, 422) fails the job, as a refused pod does."""
        what = type(action).__name__
        try:
            if isinstance(action, CreateWorkload):
                await self.kube.create_workload(key[0], action.body)
            elif isinstance(action, PatchWorkload):
                await self.kube.patch_workload(key[0], action.name, action.patch)
            elif isinstance(action, ApplyWorkloadStatus):
                await self.kube.apply_workload_status(key[0], action.name, action.status, kueue.FIELD_MANAGER)
            else:
                await self.kube.delete_workload(key[0], action.name, action.uid)
        except ApiError as err:
            if (err.status == 409 and isinstance(action, CreateWorkload)) or (
                    err.status in (404, 409) and isinstance(action, DeleteWorkload)):
                return
            self.recorder.api_error(what.lower(), err.status)
            if err.status in (400, 422) and isinstance(action, CreateWorkload):
                await self.fail(key, "InvalidWorkload", f"Kueue refused Workload {action.name}: {api_message(err)}")
                return
            if err.status in (400, 403, 404, 409, 422, 429, 500, 503):
                self.recorder.event(job, "Warning", "WorkloadUpdateFailed",
                                    f"{what} {action.name}: {api_message(err)}; retrying")
                self.retry(key, RETRY_SECRET_AFTER)
                return
            raise
        if isinstance(action, CreateWorkload):
            self.recorder.event(job, "Normal", "WorkloadCreated",
                                f"Created Kueue Workload {action.name} in LocalQueue {action.body['spec']['queueName']}")
        elif isinstance(action, DeleteWorkload):
            self.recorder.event(job, "Normal", "WorkloadDeleted", f"Deleted Workload {action.name}: {action.reason}")

    async def sync_disruption_budget(self, key: Key, job: Body, wanted: bool | None) -> None:
        """Create the job's PodDisruptionBudget while it is wanted (True), delete it once the job finished (False)
        or no longer asks for one (None, after this operator made it); once known either way, nothing more is
        asked of the API server (budgets are not watched; a restarted operator checks once more)."""
        known = self.cache.disruption_budgets.get(key)
        if wanted is None:
            if known is not True:
                return  # never asked for, as far as this operator knows: no API call
            wanted = False
        if known is wanted:
            return
        name = disruption.pdb_name(key[1])
        try:
            if wanted:
                await self.kube.create_pod_disruption_budget(key[0], disruption.pdb_body(job))
            else:
                await self.kube.delete_pod_disruption_budget(key[0], name)
        except ApiError as err:
            if err.status not in (404, 409):
                self.recorder.api_error("create-pdb" if wanted else "delete-pdb", err.status)
                self.recorder.event(job, "Warning", "DisruptionBudgetFailed",
                                    f"Could not {'create' if wanted else 'delete'} PodDisruptionBudget {name}: "
                                    f"{api_message(err)}; retrying")
                self.retry(key, RETRY_CREATE_AFTER)
                return
        else:
            self.recorder.event(job, "Normal", "DisruptionBudgetCreated" if wanted else "DisruptionBudgetDeleted",
                                f"{'Created' if wanted else 'Deleted'} PodDisruptionBudget {name} (chief and "
                                f"parameter servers)")
        self.cache.disruption_budgets[key] = wanted
