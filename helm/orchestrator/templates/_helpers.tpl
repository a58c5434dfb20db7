{{/*
Names, labels, the images, the security contexts every pod shares, and where the
secrets live. Templates call these instead of repeating them.
*/}}

{{- define "orchestrator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name; worker pods are "<fullname>-worker-N" and that is their host id,
which must stay within 63 characters, so the base is cut at 40. */}}
{{- define "orchestrator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "orchestrator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object. Call with (dict "ctx" $ "component" "api"). */}}
{{- define "orchestrator.labels" -}}
helm.sh/chart: {{ include "orchestrator.chart" .ctx }}
{{ include "orchestrator.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: orchestrator
{{- end -}}

{{- define "orchestrator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "orchestrator.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "orchestrator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Pod-level hardening. Call with the uid to run as. */}}
{{- define "orchestrator.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ . }}
runAsGroup: {{ . }}
fsGroup: {{ . }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container-level hardening, the same for every container. */}}
{{- define "orchestrator.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The chart's own Secret: generated API token and Redis URL/password, and the tenants
file given inline. */}}
{{- define "orchestrator.secretName" -}}
{{- printf "%s-secrets" (include "orchestrator.fullname" .) -}}
{{- end -}}

{{- define "orchestrator.apiTokensSecretName" -}}
{{- default (include "orchestrator.secretName" .) .Values.apiTokens.existingSecret -}}
{{- end -}}

{{- define "orchestrator.tenantsSecretName" -}}
{{- default (include "orchestrator.secretName" .) .Values.tenants.existingSecret -}}
{{- end -}}

{{- define "orchestrator.redisUrlSecretName" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- else -}}
{{- include "orchestrator.secretName" . -}}
{{- end -}}
{{- end -}}

{{- define "orchestrator.redisUrlSecretKey" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecretKey -}}
{{- else -}}
redis-url
{{- end -}}
{{- end -}}

{{/* The bundled Sentinels' URL (state/sentinel.py): the three pods' Sentinels by their
stable names, the monitored service, database 0. */}}
{{- define "orchestrator.sentinelUrl" -}}
{{- $fullname := include "orchestrator.fullname" .ctx -}}
{{- $hosts := list -}}
{{- range $i := until 3 -}}
{{- $hosts = append $hosts (printf "%s-redis-%d.%s-redis-headless.%s.svc:26379" $fullname $i $fullname $.ctx.Release.Namespace) -}}
{{- end -}}
{{- printf "redis+sentinel://:%s@%s/%s/0" .password (join "," $hosts) .ctx.Values.redis.bundled.sentinel.service -}}
{{- end -}}

{{- define "orchestrator.redisHost" -}}
{{- printf "%s-redis.%s.svc" (include "orchestrator.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* A value kept in the chart's Secret across upgrades: the live one if the Secret exists,
else a new random one (lookup is empty under `helm template`, so each render differs). */}}
{{- define "orchestrator.keptRandom" -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace (include "orchestrator.secretName" .ctx) -}}
{{- if and $existing (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}

{{/* Environment of every orchestrator process: settings from the ConfigMap, secrets by
reference. The API token and the graders' secrets only go to the API. */}}
{{- define "orchestrator.env" -}}
- name: ORCH_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "orchestrator.redisUrlSecretName" .ctx }}
      key: {{ include "orchestrator.redisUrlSecretKey" .ctx }}
{{- if .api }}
- name: ORCH_API_TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ include "orchestrator.apiTokensSecretName" .ctx }}
      key: {{ .ctx.Values.apiTokens.existingSecretKey }}
{{- if .ctx.Values.graderUrlSecret.enabled }}
- name: ORCH_GRADER_URL_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ default (include "orchestrator.secretName" .ctx) .ctx.Values.graderUrlSecret.existingSecret }}
      key: {{ .ctx.Values.graderUrlSecret.existingSecretKey }}
{{- end }}
{{- range .ctx.Values.graderSecretEnv }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secret }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "orchestrator.envFrom" -}}
- configMapRef:
    name: {{ include "orchestrator.fullname" . }}-config
{{- end -}}

{{/* Writable places under a read-only root (/tmp, the state dir), and the codebase
    catalogue and environments file. */}}
{{- define "orchestrator.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: state
  mountPath: /var/lib/orchestrator
- name: codebases
  mountPath: /etc/orchestrator/codebases
  readOnly: true
{{- if .Values.environments }}
- name: environments
  mountPath: /etc/orchestrator/environments
  readOnly: true
{{- end }}
{{- end -}}

{{- define "orchestrator.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 256Mi
- name: state
  emptyDir:
    sizeLimit: 1Gi
- name: codebases
  configMap:
    name: {{ include "orchestrator.fullname" . }}-codebases
{{- if .Values.environments }}
- name: environments
  configMap:
    name: {{ include "orchestrator.fullname" . }}-environments
{{- end }}
{{- end -}}

{{/* Roll pods when their configuration changes. */}}
{{- define "orchestrator.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{/* The scale-down brake shared by the HPA and KEDA: removing a worker ends its rollouts. */}}
{{- define "orchestrator.scalingBehavior" -}}
scaleUp:
  stabilizationWindowSeconds: 0
  selectPolicy: Max
  policies:
    - type: Percent
      value: 100
      periodSeconds: 30
    - type: Pods
      value: 4
      periodSeconds: 30
scaleDown:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleDownStabilizationSeconds }}
  selectPolicy: Min
  policies:
    - type: Pods
      value: 1
      periodSeconds: {{ .Values.autoscaling.scaleDownPeriodSeconds }}
{{- end -}}

{{/* Values that are valid one by one but not together. */}}
{{- define "orchestrator.validate" -}}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) -}}
{{- fail "redis.mode=external needs redis.external.url or redis.external.existingSecret" -}}
{{- end -}}
{{- if gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas) -}}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" -}}
{{- end -}}
{{- if and (eq .Values.autoscaling.mode "keda") .Values.autoscaling.keda.redis.enabled (eq .Values.redis.mode "external") (not .Values.autoscaling.keda.redis.address) -}}
{{- fail "autoscaling.keda.redis.address (host:port) is required with an external Redis" -}}
{{- end -}}
{{- if and (eq .Values.autoscaling.mode "keda") (not .Values.autoscaling.keda.redis.enabled) (not .Values.autoscaling.keda.prometheus.serverAddress) -}}
{{- fail "autoscaling.mode=keda needs a trigger: keda.redis.enabled or keda.prometheus.serverAddress" -}}
{{- end -}}
{{- if and .Values.tenants.file .Values.tenants.existingSecret -}}
{{- fail "tenants.file and tenants.existingSecret: give the tenants file one way, not both" -}}
{{- end -}}
{{- if eq (int .Values.api.metricsPort) 8000 -}}
{{- fail "api.metricsPort must differ from the API's own port, 8000" -}}
{{- end -}}
{{- if and .Values.ingress.tls.enabled (not .Values.ingress.tls.secretName) -}}
{{- fail "ingress.tls.enabled needs ingress.tls.secretName" -}}
{{- end -}}
{{- if eq .Values.sandboxes.namespace .Release.Namespace -}}
{{- fail "sandboxes.namespace must differ from the release namespace: the workers' Role there may create pods and read secrets" -}}
{{- end -}}
{{- end -}}

{{/*
The PodDisruptionBudget's API version: policy/v1 where the cluster serves it (1.21 and
later), else its beta (the same fields the chart uses); `helm template` without a cluster
renders policy/v1.
*/}}
{{- define "orchestrator.pdbApiVersion" -}}
{{- if .Capabilities.APIVersions.Has "policy/v1" -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end -}}
{{- end -}}

{{/*
The HorizontalPodAutoscaler's: autoscaling/v2 (1.23 and later), else v2beta2 (same fields).
*/}}
{{- define "orchestrator.hpaApiVersion" -}}
{{- if .Capabilities.APIVersions.Has "autoscaling/v2" -}}
autoscaling/v2
{{- else -}}
autoscaling/v2beta2
{{- end -}}
{{- end -}}
