{{/* The chart's name, overridable only through the release name (no nameOverride: one operator per release). */}}
{{- define "kubeps.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release> when it already contains the chart name, else <release>-kubeps; 63 characters at most. */}}
{{- define "kubeps.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kubeps.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubeps.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubeps.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kubeps.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubeps
{{- end -}}

{{- define "kubeps.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubeps.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository@digest when a digest is given, else repository:tag (tag defaults to the appVersion). */}}
{{- define "kubeps.imageRef" -}}
{{- $img := index . 0 -}}
{{- $ctx := index . 1 -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default $ctx.Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* Rules the operator needs in the namespaces it watches (ClusterRole or Role); exactly the calls of
operator/kube/client.py and the resources of its kopf handlers (tests/packaging/test_rbac.py keeps them in sync). */}}
{{- define "kubeps.namespacedRules" -}}
# PSTrainingJobs: kopf lists and watches them; the operator reads one, deletes finished ones (TTL) and writes status.
- apiGroups: [{{ include "kubeps.crdGroup" . | quote }}]
  resources: [{{ include "kubeps.crdPlural" . | quote }}]
  verbs: ["get", "list", "watch", "delete"]
- apiGroups: [{{ include "kubeps.crdGroup" . | quote }}]
  resources: [{{ printf "%s/status" (include "kubeps.crdPlural" .) | quote }}]
  verbs: ["patch"]
# The chief/ps/worker/evaluator pods and their headless Services: indexed and watched by kopf, created and deleted.
- apiGroups: [""]
  resources: ["pods", "services"]
  verbs: ["list", "watch", "create", "delete"]
# The chief pod annotated with the membership generation (its kubelet then refreshes the membership ConfigMap).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["patch"]
# The per-job Secret (token, CA, task certificate) the operator creates, reads back, and patches to issue the
# certificate again when Workers are added.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
# The per-job membership ConfigMap (the workers the chief dispatches to): read back, and server-side applied.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# The per-job NetworkPolicy (spec.security.networkPolicy.mode SameJob, or --job-network-policy).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create"]
{{- $gangGroups := dict "native" "scheduling.k8s.io" "volcano" "scheduling.volcano.sh" "scheduler-plugins" "scheduling.x-k8s.io" }}
{{- if .Values.gangScheduling.rbacForAllBackends }}
# The per-job PodGroup of every gang scheduling backend (--gang-scheduler picks one): created, read back, deleted.
- apiGroups: ["scheduling.k8s.io", "scheduling.volcano.sh", "scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create", "delete"]
{{- else if ne .Values.gangScheduling.backend "none" }}
# The per-job PodGroup of the gang scheduler (gangScheduling.backend): created, read back, deleted.
- apiGroups: [{{ get $gangGroups .Values.gangScheduling.backend | quote }}]
  resources: ["podgroups"]
  verbs: ["get", "create", "delete"]
{{- end }}
# The per-job PodDisruptionBudget (spec.runPolicy.podDisruptionBudget ChiefAndPS), deleted when the job finishes.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "delete"]
# kopf.event() posts the job's lifecycle as core v1 Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if ne (toString .Values.kueue) "off" }}
# Kueue (docs/kueue.md): a queued job's Workload, watched, created, patched (queue, active) and deleted (replicas
# changed while admitted); its status written by server-side apply (PodsReady, Finished, the admission cleared).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- end -}}

{{/* Cluster-scoped objects the operator reads, granted by the ClusterRole in both modes. */}}
{{- define "kubeps.clusterRules" -}}
{{- if ne (toString .Values.kueue) "off" }}
# Kueue: the ResourceFlavors an admission names (their nodeLabels and tolerations go onto the pods) and the
# priority class a queued job names (its value goes into the Workload).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors", "workloadpriorityclasses"]
  verbs: ["get"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
{{- end }}
{{- end -}}


{{/* The PSTrainingJob CRD, generated from the operator's models by hack/generate-manifests.py. */}}
{{- define "kubeps.crdText" -}}
{{- required "files/crd.yaml is missing: run hack/generate-manifests.py" (.Files.Get "files/crd.yaml") -}}
{{- end -}}
{{- define "kubeps.crdGroup" -}}
{{- (include "kubeps.crdText" . | fromYaml).spec.group -}}
{{- end -}}
{{- define "kubeps.crdPlural" -}}
{{- (include "kubeps.crdText" . | fromYaml).spec.names.plural -}}
{{- end -}}
