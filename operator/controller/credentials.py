"""The job's credentials and isolation, as the actuator writes them: its token Secret (a fresh random token, a new
CA and task certificate, :mod:`kubeps.runtime.certs`: the only randomness of the operator, kept out of the pure
core), the certificate issued again for added Workers, and the job's NetworkPolicy. A Secret of another owner is
never used: the pods wait until it is gone."""

from __future__ import annotations

import base64
import copy
import logging
import secrets

from kubeps.runtime import certs

from kubeps.operator.core.actions import CreateNetworkPolicy, CreateSecret, ReissueCertificate
from kubeps.operator.core.children import ANNOTATION_TLS_PS, ANNOTATION_TLS_WORKERS, TOKEN_KEY, secret_name
from kubeps.operator.core.observed import controlled_by
from kubeps.operator.kube.client import ApiError

from .cache import Body, Key
from .writes import RETRY_CREATE_AFTER, RETRY_SECRET_AFTER, ControlPart, api_message, b64

log = logging.getLogger("kubeps.operator")


class SecretControl(ControlPart):
    """Creates the job's token Secret and NetworkPolicy, and issues its task certificate again."""

    async def read_own_secret(self, key: Key, uid: str | None) -> Body | None:
        """The job's token Secret if it exists and belongs to this job (remembered), else None (forgotten)."""
        secret = await self.kube.read_secret(key[0], secret_name(key[1]))
        if secret is not None and controlled_by(secret, uid):
            self._remember_secret(key, uid, secret)
            return secret
        # None, or a leftover of an older job of the same name that garbage collection removes
        self.cache.secrets.pop(key, None)
        self.cache.secret_annotations.pop(key, None)
        return None

    def _remember_secret(self, key: Key, uid: str | None, secret: Body) -> None:
        self.cache.secrets[key] = uid
        annotations = (secret.get("metadata") or {}).get("annotations") or {}
        self.cache.secret_annotations[key] = {k: v for k, v in annotations.items()
                                              if k in (ANNOTATION_TLS_WORKERS, ANNOTATION_TLS_PS)}

    async def create_secret(self, key: Key, job: Body, action: CreateSecret) -> bool:
        """Create the job's Secret; returns whether the job's own Secret exists now."""
        uid = job["metadata"]["uid"]
        body = copy.deepcopy(action.body)
        token = secrets.token_urlsafe(32)
        made = certs.issue_job_credentials(key[1], action.tls_hosts or [f"{key[1]}.{key[0]}.svc"])
        body["data"] = {TOKEN_KEY: b64(token.encode()), **{k: b64(v) for k, v in made.files().items()}}
        body["metadata"].setdefault("annotations", {}).update(
            {ANNOTATION_TLS_WORKERS: str(action.tls_workers), ANNOTATION_TLS_PS: str(action.tls_ps)})
        try:
            await self.kube.create_secret(key[0], body)
        except ApiError as err:
            if err.status != 409:
                self.recorder.api_error("create-secret", err.status)
                raise
            existing = await self.kube.read_secret(key[0], action.name)
            if existing is None or not controlled_by(existing, uid):
                # Someone else's, e.g. the Secret of a deleted job of the same name that the garbage collector has
                # not removed yet: not ours to use. Retry until it is gone (Secrets are not watched).
                log.info("Secret %s/%s exists but is not controlled by job %s; retrying", key[0], action.name, uid)
                self.recorder.event(job, "Warning", "SecretConflict",
                                    f"Secret {action.name} exists but belongs to another owner; waiting for it to "
                                    f"be removed before creating pods")
                self.retry(key, RETRY_SECRET_AFTER)
                return False
            self._remember_secret(key, uid, existing)
        else:
            self.recorder.event(job, "Normal", "SecretCreated", f"Created Secret {action.name}")
            self._remember_secret(key, uid, body)
        return True

    async def reissue_certificate(self, key: Key, job: Body, action: ReissueCertificate) -> bool:
        """Issue the job's task certificate again, from its CA, for the names the added Workers are dialed by;
        returns whether the Secret now covers them (else the reconcile is retried and no pod is made)."""
        uid = job["metadata"]["uid"]
        secret = await self.kube.read_secret(key[0], action.name)
        if secret is None or not controlled_by(secret, uid):
            self.cache.secrets.pop(key, None)  # lost: the next reconcile restarts the job with a new Secret
            self.retry(key, RETRY_SECRET_AFTER)
            return False
        data = secret.get("data") or {}
        try:
            ca_cert, ca_key = (base64.b64decode(data[k]) for k in (certs.CA_CERT_KEY, certs.CA_KEY_KEY))
            cert, tls_key = certs.issue_task_certificate(ca_cert, ca_key, action.tls_hosts, f"kubeps job {key[1]}")
        except (KeyError, ValueError) as err:
            message = (f"Secret {action.name} holds no usable job CA ({type(err).__name__}: {err}); delete the "
                       f"Secret to restart the job with a new one")
            self.recorder.event(job, "Warning", "CertificateNotIssued", message)
            self.retry(key, RETRY_CREATE_AFTER)
            return False
        patch = {"metadata": {"resourceVersion": secret["metadata"]["resourceVersion"],
                              "annotations": {ANNOTATION_TLS_WORKERS: str(action.tls_workers),
                                              ANNOTATION_TLS_PS: str(action.tls_ps)}},
                 "data": {certs.TLS_CERT_KEY: b64(cert), certs.TLS_KEY_KEY: b64(tls_key)}}
        try:
            written = await self.kube.patch_secret(key[0], action.name, patch)
        except ApiError as err:
            if err.status not in (404, 409):
                self.recorder.api_error("patch-secret", err.status)
                raise
            self.retry(key, RETRY_SECRET_AFTER)  # changed or deleted meanwhile: plan again
            return False
        self._remember_secret(key, uid, written)
        self.recorder.event(job, "Normal", "CertificateIssued",
                            f"Issued the task certificate in Secret {action.name} again for {action.tls_workers} "
                            f"workers and {action.tls_ps} ps")
        return True

    async def create_network_policy(self, key: Key, job: Body, action: CreateNetworkPolicy) -> None:
        try:
            await self.kube.create_network_policy(key[0], action.body)
        except ApiError as err:
            if err.status == 409:
                self.cache.network_policies.add(key)
                return  # already there
            self.recorder.api_error("create-networkpolicy", err.status)
            self.recorder.event(job, "Warning", "NetworkPolicyCreateFailed",
                                f"Could not create NetworkPolicy {action.name}: {api_message(err)}; the job's pods "
                                f"are not isolated")
            if err.status in (403, 429, 500, 503):
                self.retry(key, RETRY_CREATE_AFTER)
            return
        self.cache.network_policies.add(key)
        self.recorder.event(job, "Normal", "NetworkPolicyCreated", f"Created NetworkPolicy {action.name}")
