{{/* Names and labels. */}}
{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* RayService names get suffixes from KubeRay (-raycluster-xxxxx-head-svc): keep ours short. */}}
{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* GPU mode: each TP rank asks Ray for one "GPU", so a worker pod holds tensor_parallel_size GPUs. */}}
{{- define "kvmesh.gpuWorkers" -}}
{{- if eq (toString .Values.kvmesh.parallel.worker_resource) "GPU" }}true{{- end }}
{{- end }}

{{- define "kvmesh.apiKeySecretName" -}}
{{- default (printf "%s-api-keys" (include "kvmesh.fullname" .)) .Values.apiKeyHashes.existingSecret }}
{{- end }}

{{- define "kvmesh.redisSecretName" -}}
{{- default (printf "%s-redis-url" (include "kvmesh.fullname" .)) .Values.redis.external.existingSecret }}
{{- end }}

{{- define "kvmesh.redisServiceName" -}}
{{- printf "%s-redis" (include "kvmesh.fullname" .) }}
{{- end }}

{{/*
Checks the JSON schema cannot express (cross-field); they fail the install with a message.
*/}}
{{- define "kvmesh.validate" -}}
{{- $p := .Values.kvmesh.parallel }}
{{- if .Values.autoscaling.enabled }}
{{- if or (lt (int $p.num_workers) (int .Values.autoscaling.minReplicas)) (gt (int $p.num_workers) (int .Values.autoscaling.maxReplicas)) }}
{{- fail (printf "kvmesh.parallel.num_workers (%v) must lie within autoscaling.minReplicas..maxReplicas (%v..%v): each worker pod hosts one engine" $p.num_workers .Values.autoscaling.minReplicas .Values.autoscaling.maxReplicas) }}
{{- end }}
{{- end }}
{{- if and (ne .Values.redis.mode "none") .Values.kvmesh.tenants.redis_url }}
{{- fail (printf "kvmesh.tenants.redis_url must be null when redis.mode is %s: the chart supplies the URL" .Values.redis.mode) }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") (not (or .Values.redis.external.url .Values.redis.external.existingSecret)) }}
{{- fail "redis.mode external needs redis.external.url or redis.external.existingSecret" }}
{{- end }}
{{- if .Values.apiKeyHashes.existingSecret }}
{{- range .Values.kvmesh.tenants.tenants }}
{{- if .api_key_hashes }}
{{- fail (printf "tenant %s: api_key_hashes must be empty when apiKeyHashes.existingSecret is set (one source per key)" .id) }}
{{- end }}
{{- end }}
{{- end }}
{{- if ne .Values.serve.proxyLocation "Disabled" }}
{{- fail "serve.proxyLocation must be Disabled: the router replicas serve router.http_port and router.grpc_port themselves, and a Serve proxy would take the port" }}
{{- end }}
{{- if .Values.serve.grpcServicerFunctions }}
{{- fail "serve.grpcServicerFunctions must be []: no Serve gRPC proxy runs; the router replicas serve kvmesh.v1 on router.grpc_port themselves" }}
{{- end }}
{{- if ne .Values.serve.routePrefix "/" }}
{{- fail "serve.routePrefix must be /: the router replicas serve the API at the root of router.http_port" }}
{{- end }}
{{- if and .Values.tls.secretName (or .Values.kvmesh.router.tls.cert_file .Values.kvmesh.router.tls.key_file) }}
{{- fail "kvmesh.router.tls.cert_file / key_file must be null when tls.secretName is set: the chart mounts the Secret and sets them" }}
{{- end }}
{{- if and .Values.gcsFaultTolerance.enabled (not .Values.gcsFaultTolerance.redisAddress) }}
{{- fail "gcsFaultTolerance.enabled needs gcsFaultTolerance.redisAddress (host:port of an external Redis)" }}
{{- end }}
{{- if and .Values.modelVolume.enabled (not .Values.modelVolume.existingClaim) }}
{{- fail "modelVolume.enabled needs modelVolume.existingClaim (a PVC holding the weights)" }}
{{- end }}
{{- end }}

{{/*
The Serve app's args: .Values.kvmesh with the secret parts taken out (API-key hashes go to a
Secret file, the Redis URL to an env var); kvmesh.deploy.serve_config.config_from_serve_args
merges them back inside the pod.
*/}}
{{- define "kvmesh.serveArgs" -}}
{{- $args := deepCopy .Values.kvmesh }}
{{- $tenants := list }}
{{- range $t := $args.tenants.tenants }}
{{- $tenants = append $tenants (set (deepCopy $t) "api_key_hashes" (list)) }}
{{- end }}
{{- $_ := set $args.tenants "tenants" $tenants }}
{{- if ne .Values.redis.mode "none" }}
{{- $_ := set $args.tenants "redis_url" nil }}
{{- end }}
{{- if .Values.tls.secretName }}
{{- $_ := set $args.router.tls "cert_file" (printf "%s/tls.crt" .Values.tls.mountPath) }}
{{- $_ := set $args.router.tls "key_file" (printf "%s/tls.key" .Values.tls.mountPath) }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{- define "kvmesh.serveConfig" -}}
{{- $router := .Values.kvmesh.router }}
{{- $app := dict "name" .Values.serve.appName "route_prefix" .Values.serve.routePrefix "import_path" "kvmesh.deploy.serve_app:build_app" "args" (include "kvmesh.serveArgs" . | fromYaml) }}
{{- /* No Serve proxies: the router replicas serve router.http_port and router.grpc_port themselves. */}}
{{- $serve := dict "proxy_location" .Values.serve.proxyLocation "applications" (list $app) }}
{{- toYaml $serve }}
{{- end }}

{{/* Env and volumes every Ray container gets: the Serve app may be built on any node. */}}
{{- define "kvmesh.env" -}}
- name: KVMESH_API_KEY_HASHES_FILE
  value: {{ printf "/etc/kvmesh/api-keys/%s" .Values.apiKeyHashes.secretKey | quote }}
{{- if eq .Values.redis.mode "bundled" }}
- name: KVMESH_REDIS_URL
  value: {{ printf "redis://%s:6379/0" (include "kvmesh.redisServiceName" .) | quote }}
{{- else if eq .Values.redis.mode "external" }}
- name: KVMESH_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.redisSecretName" . }}
      key: {{ .Values.redis.external.secretKey }}
{{- end }}
{{- end }}

{{- define "kvmesh.volumes" -}}
- name: api-keys
  secret:
    secretName: {{ include "kvmesh.apiKeySecretName" . }}
    items:
      - key: {{ .Values.apiKeyHashes.secretKey }}
        path: {{ .Values.apiKeyHashes.secretKey }}
{{- if .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0400
{{- end }}
{{- if .Values.modelVolume.enabled }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.modelVolume.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "kvmesh.volumeMounts" -}}
- name: api-keys
  mountPath: /etc/kvmesh/api-keys
  readOnly: true
{{- if .Values.tls.secretName }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.modelVolume.enabled }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvmesh.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Pod-level settings shared by the head and worker groups; dict "root" . "group" .Values.<group>. */}}
{{- define "kvmesh.podCommon" -}}
{{- $root := .root }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod annotations: Prometheus scrape hints for Ray's metrics port, plus the group's own. */}}
{{- define "kvmesh.podAnnotations" -}}
{{- $annotations := deepCopy (default (dict) .extra) }}
{{- if .root.Values.metrics.podAnnotations }}
{{- $_ := set $annotations "prometheus.io/scrape" "true" }}
{{- $_ := set $annotations "prometheus.io/port" (toString .root.Values.metrics.port) }}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
{{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
