"""The job's membership ConfigMap, as the actuator reads and writes it: the document of the workers the chief
dispatches to (the operator is its only writer, so it is read once and then remembered), and the annotation that
makes the chief's kubelet refresh the mounted file at once."""

from __future__ import annotations

import logging

from kubeps.runtime.cluster import Membership

from kubeps.operator.core.actions import AnnotatePod, ApplyMembership
from kubeps.operator.core.children import membership_name, membership_of
from kubeps.operator.core.observed import controlled_by
from kubeps.operator.kube.client import ApiError

from .cache import Body, Key
from .writes import RETRY_CREATE_AFTER, ControlPart, api_message

log = logging.getLogger("kubeps.operator")


class MembershipControl(ControlPart):
    """Reads and writes the job's membership ConfigMap, and annotates the chief pod with its generation."""

    async def read_membership(self, key: Key, uid: str | None) -> Membership | None:
        """The document of the job's membership ConfigMap (None: none, or another job's), read once, then
        remembered, absent too (a queued job is not read again at each reconcile): the operator is its only
        writer."""
        known = self.cache.memberships.get(key)
        if known is not None and known[0] == uid:
            return known[1]
        try:
            body = await self.kube.read_config_map(key[0], membership_name(key[1]))
        except ApiError as err:
            # not known (e.g. an install whose RBAC predates configmaps): planned as absent, so the write is tried
            # and its failure said in an Event, and the job's other children go on
            self.recorder.api_error("read-configmap", err.status)
            log.warning("could not read ConfigMap %s/%s: %s", key[0], membership_name(key[1]), err)
            return None
        document = membership_of(body) if body is not None and controlled_by(body, uid) else None
        self.cache.memberships[key] = (uid, document)
        return document

    async def apply_membership(self, key: Key, job: Body, action: ApplyMembership) -> bool:
        """Write the membership ConfigMap (created, or its document replaced); the chief sees it when the kubelet
        refreshes the mounted file."""
        try:
            await self.kube.write_config_map(key[0], action.body)
        except ApiError as err:
            self.recorder.api_error("apply-configmap", err.status)
            self.cache.memberships.pop(key, None)
            self.recorder.event(job, "Warning", "MembershipWriteFailed",
                                f"Could not write ConfigMap {action.name}: {api_message(err)}; the chief keeps "
                                f"dispatching to the workers it knows")
            self.retry(key, RETRY_CREATE_AFTER)
            return False
        document = membership_of(action.body)
        if document is not None:
            self.cache.memberships[key] = (job["metadata"].get("uid"), document)
        return True

    async def annotate_pod(self, key: Key, action: AnnotatePod) -> None:
        """Annotate a pod (its UID a precondition); one that is gone or changed is left to the next reconcile."""
        body = {"metadata": {"uid": action.uid, "annotations": action.annotations}}
        try:
            await self.kube.patch_pod(key[0], action.name, body)
        except ApiError as err:
            self.recorder.api_error("patch-pod", err.status)
            if err.status not in (404, 409, 422):
                self.retry(key, RETRY_CREATE_AFTER)
