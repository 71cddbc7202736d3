{{/*
The release's name for itself: <release>-kubellm, or <release> when that already has "kubellm" in it. At most
46 characters, so that the longest name built on it, <name>-operator-metrics (a Service), fits in 63.
*/}}
{{- define "kubellm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 46 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 46 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The operator's Deployment, ServiceAccount, roles and bindings (kubellm-operator for release kubellm). */}}
{{- define "kubellm.operatorName" -}}
{{- printf "%s-operator" (include "kubellm.fullname" .) -}}
{{- end -}}

{{/* Labels of the operator's pods, and the selector of its Deployment and metrics Service (never changes). */}}
{{- define "kubellm.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubellm.labels" -}}
{{ include "kubellm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kubellm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubellm.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kubellm.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{/*
What the operator needs in each namespace it serves; operator/control/rbac.py holds the same table with the reason for
every verb, and tests/delivery/test_chart.py checks that the two agree.
*/}}
{{- define "kubellm.namespacedRules" -}}
- apiGroups: [kubellm.io]
  resources: [llmdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [kubellm.io]
  resources: [llmdeployments/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [services]
  verbs: [list, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [list]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
{{- if .Values.rbac.keda }}
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [list, create, patch, delete]
{{- end }}
{{- if .Values.rbac.serviceMonitors }}
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [list, create, patch, delete]
{{- end }}
{{- if .Values.rbac.prometheusRules }}
- apiGroups: [monitoring.coreos.com]
  resources: [prometheusrules]
  verbs: [list, create, patch, delete]
{{- end }}
{{- if .Values.rbac.inferencePools }}
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [list, create, patch, delete]
{{- end }}
{{- if .Values.rbac.leaderWorkerSets }}
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [list, create, patch, delete]
{{- end }}
{{- if .Values.activator.enabled }}
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, create, patch, delete]
{{- end }}
{{- end -}}

{{/* The activator's Deployment, Service, ServiceAccount and roles (kubellm-activator for release kubellm). */}}
{{- define "kubellm.activatorName" -}}
{{- printf "%s-activator" (include "kubellm.fullname" .) -}}
{{- end -}}

{{- define "kubellm.activatorSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: activator
{{- end -}}

{{- define "kubellm.activatorLabels" -}}
{{ include "kubellm.activatorSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* What the activator needs in each namespace it serves (operator/control/rbac.py ACTIVATOR). */}}
{{- define "kubellm.activatorRules" -}}
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch]
- apiGroups: [kubellm.io]
  resources: [llmdeployments]
  verbs: [get, list]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* The namespaces whose LLMDeployments the activator serves, as a JSON list: activator.namespaces, else the
release's own (activator.allNamespaces aside). */}}
{{- define "kubellm.activatorNamespaces" -}}
{{- .Values.activator.namespaces | default (list .Release.Namespace) | uniq | toJson -}}
{{- end -}}

{{/* What kopf reads cluster-wide: CRDs always; namespaces when it serves a list of them. */}}
{{- define "kubellm.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end -}}
