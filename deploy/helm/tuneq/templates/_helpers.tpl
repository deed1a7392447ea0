{{/* Names: "tuneq" for a release called tuneq, else "<release>-tuneq". */}}
{{- define "tuneq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tuneq.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object; "component" is added per object. */}}
{{- define "tuneq.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tuneq.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tuneq
{{- end -}}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "api"). */}}
{{- define "tuneq.selector" -}}
app.kubernetes.io/name: {{ include "tuneq.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tuneq.componentLabels" -}}
{{ include "tuneq.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The image of the API and the dispatcher. */}}
{{- define "tuneq.image" -}}
{{- $img := .Values.image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* The image of `tuneq serve`: `image` while serve.image is empty; else serve.image, its
empty fields taken from `image` as trainerImage's are. */}}
{{- define "tuneq.serveImage" -}}
{{- $s := .Values.serve.image -}}
{{- if not (or $s.repository $s.tag $s.digest) -}}
{{- include "tuneq.image" . -}}
{{- else -}}
{{- $repo := default .Values.image.repository $s.repository -}}
{{- if $s.digest -}}
{{- printf "%s@%s" $repo $s.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default (default .Chart.AppVersion .Values.image.tag) $s.tag) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The trainers' image, as the pools file names it: trainerImage, else image. */}}
{{- define "tuneq.trainerImage" -}}
{{- $t := .Values.trainerImage -}}
{{- $repo := default .Values.image.repository $t.repository -}}
{{- if $t.digest -}}
{{- printf "%s@%s" $repo $t.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default (default .Chart.AppVersion .Values.image.tag) $t.tag) -}}
{{- end -}}
{{- end -}}

{{- define "tuneq.serviceAccountName" -}}
{{- $sa := index .ctx.Values .component "serviceAccount" -}}
{{- default (printf "%s-%s" (include "tuneq.fullname" .ctx) .component) $sa.name -}}
{{- end -}}

{{- define "tuneq.trainerServiceAccountName" -}}
{{- include "tuneq.serviceAccountName" (dict "ctx" . "component" "trainer") -}}
{{- end -}}

{{/* The namespaces attempt Jobs run in: pools.namespaces, else the release's. */}}
{{- define "tuneq.poolNamespaces" -}}
{{- $ns := .Values.pools.namespaces | default (list .Release.Namespace) -}}
{{- toJson (uniq $ns) -}}
{{- end -}}

{{- define "tuneq.apiUrl" -}}
{{- default (printf "http://%s-api.%s.svc:%d" (include "tuneq.fullname" .) .Release.Namespace (int .Values.api.service.port)) .Values.dispatcher.apiUrl -}}
{{- end -}}

{{- define "tuneq.secretName" -}}
{{- required "secrets.existingSecret: name an existing Secret holding the attempt secret (and the admin key); the chart never holds secret values" .Values.secrets.existingSecret -}}
{{- end -}}

{{/* Environment shared by the API and the dispatcher: the queue and the attempt secret. */}}
{{- define "tuneq.commonEnv" -}}
{{- if eq .Values.redis.mode "bundled" }}
- name: TUNEQ_REDIS_URL
  value: {{ printf "redis://%s-redis:%d" (include "tuneq.fullname" .) (int .Values.redis.bundled.port) | quote }}
- name: TUNEQ_REDIS_PASSWORD
  # Set on the URL by tuneq itself (percent-encoded): any character works, and the
  # password stays in its Secret.
  valueFrom:
    secretKeyRef:
      name: {{ default (include "tuneq.secretName" .) .Values.redis.bundled.passwordSecret }}
      key: {{ .Values.redis.bundled.passwordKey }}
{{- else }}
- name: TUNEQ_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "redis.external.existingSecret: name the Secret holding the Redis URL" .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.urlKey }}
{{- end }}
- name: TUNEQ_ATTEMPT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "tuneq.secretName" . }}
      key: {{ .Values.secrets.attemptSecretKey }}
- name: TUNEQ_POOLS
  value: /etc/tuneq/pools/pools.toml
- name: TUNEQ_LOG
  value: {{ .Values.logLevel | quote }}
{{- end -}}

{{- define "tuneq.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tuneq.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}


{{/*
What `tuneq api` and `tuneq serve` share: they answer the same routes on the same queue
and store, so they take the same arguments, environment and files. Include with
(dict "ctx" $ "port" <the container's port>).
*/}}
{{- define "tuneq.apiArgs" -}}
- --max-upload-mib
- {{ .ctx.Values.api.maxUploadMiB | quote }}
{{- range .ctx.Values.models }}
- --model
- {{ printf "%s=%s" .id .location | quote }}
{{- end }}
{{- end -}}

{{- define "tuneq.apiEnv" -}}
{{- $ := .ctx -}}
{{ include "tuneq.commonEnv" $ }}
- name: TUNEQ_HOST
  value: "0.0.0.0"
- name: TUNEQ_PORT
  value: {{ .port | quote }}
- name: TUNEQ_STORE
  value: {{ required "store.uri: where uploads, checkpoints and adapters live (s3://bucket/prefix or gs://bucket/prefix)" $.Values.store.uri | quote }}
{{- if $.Values.store.config }}
- name: TUNEQ_STORAGE_CONFIG
  value: /etc/tuneq/storage/storage.toml
{{- end }}
- name: TUNEQ_SPOOL_DIR
  value: /var/lib/tuneq/spool
{{- if $.Values.secrets.adminKeyKey }}
- name: TUNEQ_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tuneq.secretName" $ }}
      key: {{ $.Values.secrets.adminKeyKey }}
      # Without the key, /admin stays off.
      optional: true
{{- end }}
{{- if $.Values.api.webhookAllowPrivate }}
- name: TUNEQ_WEBHOOK_ALLOW_PRIVATE
  value: "true"
{{- end }}
{{- if $.Values.store.s3CredentialsSecret }}
- name: AWS_SHARED_CREDENTIALS_FILE
  value: /var/run/secrets/tuneq/s3/credentials
{{- end }}
{{- range $name, $value := $.Values.store.env }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{- define "tuneq.apiVolumeMounts" -}}
{{- $ := .ctx -}}
- name: pools
  mountPath: /etc/tuneq/pools
  readOnly: true
{{- if $.Values.store.config }}
- name: storage
  mountPath: /etc/tuneq/storage
  readOnly: true
{{- end }}
{{- if $.Values.store.s3CredentialsSecret }}
- name: s3-credentials
  mountPath: /var/run/secrets/tuneq/s3
  readOnly: true
{{- end }}
- name: spool
  mountPath: /var/lib/tuneq/spool
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "tuneq.apiVolumes" -}}
{{- $ := .ctx -}}
- name: pools
  configMap:
    name: {{ include "tuneq.fullname" $ }}-pools
{{- if $.Values.store.config }}
- name: storage
  configMap:
    name: {{ include "tuneq.fullname" $ }}-storage
{{- end }}
{{- if $.Values.store.s3CredentialsSecret }}
- name: s3-credentials
  secret:
    secretName: {{ $.Values.store.s3CredentialsSecret }}
    items:
      - key: credentials
        path: credentials
{{- end }}
- name: spool
  emptyDir:
    sizeLimit: {{ $.Values.api.spoolSizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: 256Mi
{{- end -}}
