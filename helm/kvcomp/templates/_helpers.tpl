{{/*
Named templates of the kvcomp chart. Every template here takes a chart context (the root `.` of
this chart, or `.Subcharts.kvcomp` when an inference chart includes the sidecar templates).
*/}}

{{- define "kvcomp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvcomp.fullname" -}}
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

{{- define "kvcomp.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvcomp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvcomp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvcomp.labels" -}}
helm.sh/chart: {{ include "kvcomp.chart" . }}
{{ include "kvcomp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: kvcompd
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvcomp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvcomp.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvcomp.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "kvcomp.configName" -}}
{{- printf "%s-config" (include "kvcomp.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret holding the token file, or "" when the daemon runs open (auth.mode=open). */}}
{{- define "kvcomp.authSecretName" -}}
{{- if eq .Values.auth.mode "open" -}}
{{- else if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else -}}
{{- printf "%s-auth" (include "kvcomp.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* "true" when the chart generates the token Secret (auth required, no tokens given). */}}
{{- define "kvcomp.authGenerated" -}}
{{- if and (eq .Values.auth.mode "required") (not .Values.auth.existingSecret) (not .Values.auth.tokens) -}}
true
{{- end -}}
{{- end -}}

{{/* "true" when the daemon gets GPUs and runs the CUDA backend. */}}
{{- define "kvcomp.gpu" -}}
{{- and .Values.gpu.enabled (gt (int .Values.gpu.count) 0) -}}
{{- end -}}

{{/* The data volume kind after resolving "auto" for the mode. */}}
{{- define "kvcomp.persistenceType" -}}
{{- $t := .Values.persistence.type -}}
{{- if eq $t "auto" -}}
{{- $t = get (dict "daemonset" "hostPath" "statefulset" "pvc" "sidecar" "emptyDir") .Values.mode -}}
{{- end -}}
{{- $t -}}
{{- end -}}

{{/*
"true" when pods share a node directory (hostPath outside a DaemonSet): each pod then keeps its
data in a subdirectory named after the pod, so two daemons never open one RocksDB.
*/}}
{{- define "kvcomp.dataSubPathPerPod" -}}
{{- and (eq (include "kvcomp.persistenceType" .) "hostPath") (ne .Values.mode "daemonset") -}}
{{- end -}}

{{/*
A size in bytes from a Kubernetes-style quantity ("8Gi", "512Mi", "1Ti", "4096") or a number.
*/}}
{{- define "kvcomp.bytes" -}}
{{- $q := . -}}
{{- if kindIs "string" $q -}}
{{- $re := "^([0-9]+)(Ki|Mi|Gi|Ti)?$" -}}
{{- if not (regexMatch $re $q) -}}
{{- fail (printf "kvcomp: %q is not a size (digits, optionally followed by Ki, Mi, Gi or Ti)" $q) -}}
{{- end -}}
{{- $num := regexReplaceAll $re $q "${1}" | int64 -}}
{{- $unit := regexReplaceAll $re $q "${2}" -}}
{{- $mult := get (dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776) $unit -}}
{{- mul $num $mult -}}
{{- else -}}
{{- int64 $q -}}
{{- end -}}
{{- end -}}

{{/* An int-or-string for a PodDisruptionBudget: "50%" stays a string, 1 becomes 1. */}}
{{- define "kvcomp.intOrPercent" -}}
{{- if kindIs "string" . -}}
{{- if regexMatch "^[0-9]+$" . }}{{ . }}{{ else }}{{ . | quote }}{{ end -}}
{{- else -}}
{{- int64 . -}}
{{- end -}}
{{- end -}}

{{/* The token file kvcompd reads (auth.token_file): `tenant: token` lines, a YAML map. */}}
{{/* Takes the tenant-to-token map. */}}
{{- define "kvcomp.tokenFile" -}}
{{- range $tenant, $token := . }}
{{ $tenant | quote }}: {{ $token | quote }}
{{- end }}
{{- end -}}

{{/*
PromQL label matchers selecting this release's daemons: the ServiceMonitor's job is the Service's
name, a PodMonitor's job is <namespace>/<monitor name>.
*/}}
{{- define "kvcomp.promSelector" -}}
{{- $name := include "kvcomp.fullname" . -}}
{{- printf "namespace=\"%s\",job=~\"%s|%s/%s\"" .Release.Namespace $name .Release.Namespace $name -}}
{{- end -}}

{{/* Checks that values which the schema cannot relate to each other fit together. */}}
{{- define "kvcomp.validate" -}}
{{- $p := include "kvcomp.persistenceType" . -}}
{{- if and (eq $p "pvc") (ne .Values.mode "statefulset") -}}
{{- fail "kvcomp: persistence.type=pvc needs mode=statefulset (one claim per pod); a daemonset uses hostPath, a sidecar emptyDir or hostPath" -}}
{{- end -}}
{{- if ge (float64 .Values.tiers.lowWatermark) (float64 .Values.tiers.highWatermark) -}}
{{- fail "kvcomp: tiers.lowWatermark must be below tiers.highWatermark" -}}
{{- end -}}
{{- if and .Values.thriftTls.enabled (not .Values.thriftTls.secretName) -}}
{{- fail "kvcomp: thriftTls.enabled needs thriftTls.secretName (a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- if and .Values.auth.existingSecret .Values.auth.tokens -}}
{{- fail "kvcomp: set auth.existingSecret or auth.tokens, not both" -}}
{{- end -}}
{{- if and (eq .Values.auth.mode "open") (or .Values.auth.existingSecret .Values.auth.tokens) -}}
{{- fail "kvcomp: auth.mode=open takes no auth.existingSecret or auth.tokens (set auth.mode=required to use them)" -}}
{{- end -}}
{{- if and .Values.daemonset.hostPorts .Values.hostNetwork -}}
{{- fail "kvcomp: daemonset.hostPorts and hostNetwork exclude each other (with hostNetwork the ports already are the node's)" -}}
{{- end -}}
{{- if and (eq .Values.tiers.putTier "device") (ne (include "kvcomp.gpu" .) "true") -}}
{{- fail "kvcomp: tiers.putTier=device needs gpu.enabled and gpu.count > 0" -}}
{{- end -}}
{{- if and (ne .Values.storage.durability "memory") (not .Values.tiers.rocksdb.enabled) -}}
{{- fail (printf "kvcomp: storage.durability=%s needs tiers.rocksdb.enabled" .Values.storage.durability) -}}
{{- end -}}
{{- if ge (float64 .Values.shutdownGraceSeconds) (float64 .Values.terminationGracePeriodSeconds) -}}
{{- fail "kvcomp: shutdownGraceSeconds must be below terminationGracePeriodSeconds (the daemon needs time to flush after its grace period)" -}}
{{- end -}}
{{- with .Values.ucx.tls -}}
{{- if not (has "tcp" (splitList "," .)) -}}
{{- fail (printf "kvcomp: ucx.tls %q must include tcp (UCX sets connections up over TCP) or be empty" .) -}}
{{- end -}}
{{- end -}}
{{- range .Values.extraEnv -}}
{{- if hasPrefix "KVCOMP_" .name -}}
{{- fail (printf "kvcomp: extraEnv %s would override the configuration file; set the option through the chart's values or extraConfig" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The daemon's YAML configuration: the ONE place where chart values map onto kvcompd's options
(keys of docs/configuration.md). Paths point at the mounts of kvcomp.container. Sizes are written
as plain byte counts.
*/}}
{{- define "kvcomp.daemonConfig" -}}
{{- $v := .Values -}}
{{- $gpu := eq (include "kvcomp.gpu" .) "true" -}}
{{- $secret := include "kvcomp.authSecretName" . -}}
{{- $dataPlane := dict
      "address" "0.0.0.0"
      "port" (int $v.ports.ucx)
      "max_put_bytes" (include "kvcomp.bytes" $v.dataPlane.maxPutBytes | int64)
      "max_block_bytes" (include "kvcomp.bytes" $v.dataPlane.maxBlockBytes | int64)
      "max_inflight_bytes_per_connection" (include "kvcomp.bytes" $v.dataPlane.maxInflightBytesPerConnection | int64)
      "max_buffered_bytes" (include "kvcomp.bytes" $v.dataPlane.maxBufferedBytes | int64)
      "put_timeout_seconds" $v.dataPlane.putTimeoutSeconds
      "max_open_puts" (int $v.dataPlane.maxOpenPuts)
      "ucx_tls" $v.ucx.tls
      "ucx_net_devices" $v.ucx.netDevices
      "ucx_interop" ($v.ucx.interop | default "defaults") -}}
{{- $controlPlane := dict
      "address" "0.0.0.0"
      "port" (int $v.ports.thrift)
      "io_threads" (int $v.controlPlane.ioThreads)
      "worker_threads" (int $v.controlPlane.workerThreads)
      "tls" $v.thriftTls.enabled
      "tls_cert_file" (ternary "/etc/kvcomp/tls/tls.crt" "" $v.thriftTls.enabled)
      "tls_key_file" (ternary "/etc/kvcomp/tls/tls.key" "" $v.thriftTls.enabled)
      "tls_ca_file" (ternary "/etc/kvcomp/tls/ca.crt" "" (and $v.thriftTls.enabled $v.thriftTls.verifyClients)) -}}
{{- $metrics := dict "enabled" true "address" "0.0.0.0" "port" (int $v.ports.metrics) -}}
{{- $auth := dict
      "token_file" (ternary "/etc/kvcomp/auth/tokens" "" (ne $secret ""))
      "reload_interval_seconds" $v.auth.reloadIntervalSeconds -}}
{{- $gpus := ternary (int $v.gpu.count) 0 $gpu -}}
{{- $engine := dict
      "backend" (ternary "cuda" "cpu" $gpu)
      "cuda_device" 0
      "cuda_devices" (ternary (join "," (until $gpus)) "" (gt $gpus 1))
      "cpu_threads" (int $v.engine.cpuThreads)
      "workers" (int $v.engine.workers)
      "queue_capacity" (int $v.engine.queueCapacity)
      "gpu_memory_bytes" (include "kvcomp.bytes" $v.engine.gpuMemory | int64) -}}
{{- $t := $v.tiers -}}
{{- $storage := dict
      "data_dir" $v.persistence.mountPath
      "durability" $v.storage.durability
      "put_tier" $t.putTier
      "device_capacity_bytes" (ternary (include "kvcomp.bytes" $t.device.capacity | int64) 0 $gpu)
      "host_capacity_bytes" (include "kvcomp.bytes" $t.host.capacity | int64)
      "rocksdb_enabled" $t.rocksdb.enabled
      "rocksdb_capacity_bytes" (include "kvcomp.bytes" $t.rocksdb.capacity | int64)
      "rocksdb_reserve_bytes" (include "kvcomp.bytes" $t.rocksdb.reserve | int64)
      "high_watermark" $t.highWatermark
      "low_watermark" $t.lowWatermark
      "promote_on_read" $v.storage.promoteOnRead
      "ttl_seconds" $v.storage.ttlSeconds
      "tenant_quota_bytes" (include "kvcomp.bytes" $v.storage.tenantQuotaBytes | int64)
      "verify_checksums_on_open" $v.storage.verifyChecksumsOnOpen -}}
{{- $p := $v.policy -}}
{{- $policy := dict
      "scorer" $p.scorer
      "ratio" $p.ratio
      "token_budget" (int $p.tokenBudget)
      "head_budget" $p.headBudget
      "alpha_safeguard" $p.alphaSafeguard
      "n_sink" (int $p.nSink)
      "n_recent" (int $p.nRecent)
      "recent_fraction" $p.recentFraction
      "protect" $p.protect
      "window" (int $p.window)
      "snapkv_window" (int $p.snapkvWindow)
      "snapkv_pool" (int $p.snapkvPool)
      "seed" (int64 $p.seed)
      "block_size" (int $p.blockSize)
      "moments" $p.moments
      "moment_aware" $p.momentAware
      "key_codec" $p.keyCodec
      "value_codec" $p.valueCodec
      "rank" (int $p.rank)
      "group_size" (int $p.groupSize)
      "gamma_aware" $p.gammaAware
      "value_outlier_factor" $p.valueOutlierFactor
      "value_raw_fraction" $p.valueRawFraction
      "key_bits" (int $p.keyBits)
      "value_bits" (int $p.valueBits) -}}
{{- $process := dict
      "shutdown_grace_seconds" $v.shutdownGraceSeconds
      "log_level" $v.logLevel -}}
{{- $cfg := dict
      "data_plane" $dataPlane
      "control_plane" $controlPlane
      "metrics" $metrics
      "auth" $auth
      "engine" $engine
      "storage" $storage
      "default_policy" $policy
      "process" $process -}}
{{- $cfg = mergeOverwrite $cfg (deepCopy $v.extraConfig) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
UCX's own environment variables (read by UCX itself; UCX_TLS and UCX_NET_DEVICES are set through
the daemon configuration instead, data_plane.ucx_tls and ucx_net_devices).
*/}}
{{- define "kvcomp.ucxEnv" -}}
{{- with .Values.ucx.tcpPortRange }}
- name: UCX_TCP_PORT_RANGE
  value: {{ . | quote }}
{{- end }}
{{- range $k, $val := .Values.ucx.extraEnv }}
- name: {{ $k }}
  value: {{ $val | toString | quote }}
{{- end }}
{{- end -}}

{{/* The kvcompd container, the same in every mode. */}}
{{- define "kvcomp.container" -}}
{{- $gpu := eq (include "kvcomp.gpu" .) "true" -}}
name: kvcompd
image: {{ include "kvcomp.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args:
  - --config
  - /etc/kvcomp/kvcompd.yaml
env:
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  - name: POD_NAMESPACE
    valueFrom:
      fieldRef:
        fieldPath: metadata.namespace
  - name: NODE_NAME
    valueFrom:
      fieldRef:
        fieldPath: spec.nodeName
{{- with include "kvcomp.ucxEnv" . | trim }}
{{- . | nindent 2 }}
{{- end }}
{{- with .Values.extraEnv }}
{{- toYaml . | nindent 2 }}
{{- end }}
ports:
  - name: ucx
    containerPort: {{ .Values.ports.ucx }}
    protocol: TCP
    {{- if and (eq .Values.mode "daemonset") .Values.daemonset.hostPorts }}
    hostPort: {{ .Values.ports.ucx }}
    {{- end }}
  - name: thrift
    containerPort: {{ .Values.ports.thrift }}
    protocol: TCP
    {{- if and (eq .Values.mode "daemonset") .Values.daemonset.hostPorts }}
    hostPort: {{ .Values.ports.thrift }}
    {{- end }}
  - name: metrics
    containerPort: {{ .Values.ports.metrics }}
    protocol: TCP
{{- with .Values.probes.startup }}
{{- if .enabled }}
startupProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: {{ .periodSeconds }}
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: {{ .failureThreshold }}
{{- end }}
{{- end }}
{{- with .Values.probes.liveness }}
{{- if .enabled }}
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  initialDelaySeconds: {{ .initialDelaySeconds }}
  periodSeconds: {{ .periodSeconds }}
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: {{ .failureThreshold }}
{{- end }}
{{- end }}
{{- with .Values.probes.readiness }}
{{- if .enabled }}
readinessProbe:
  httpGet:
    path: /readyz
    port: metrics
  initialDelaySeconds: {{ .initialDelaySeconds }}
  periodSeconds: {{ .periodSeconds }}
  timeoutSeconds: {{ .timeoutSeconds }}
  failureThreshold: {{ .failureThreshold }}
{{- end }}
{{- end }}
{{- $res := deepCopy (.Values.resources | default dict) -}}
{{- if $gpu }}
{{- $limits := get $res "limits" | default dict -}}
{{- $_ := set $limits .Values.gpu.resourceName (int .Values.gpu.count) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end }}
{{- with $res }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $sc := deepCopy (.Values.securityContext | default dict) -}}
{{- if eq .Values.mode "sidecar" }}
{{- /* In someone else's pod the pod-level user settings are not ours: carry them here. */ -}}
{{- $sc = merge $sc (pick (.Values.podSecurityContext | default dict) "runAsNonRoot" "runAsUser" "runAsGroup" "seccompProfile") -}}
{{- end }}
{{- with $sc }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  - name: kvcomp-config
    mountPath: /etc/kvcomp/kvcompd.yaml
    subPath: kvcompd.yaml
    readOnly: true
  {{- if include "kvcomp.authSecretName" . }}
  - name: kvcomp-auth
    mountPath: /etc/kvcomp/auth
    readOnly: true
  {{- end }}
  {{- if .Values.thriftTls.enabled }}
  - name: kvcomp-tls
    mountPath: /etc/kvcomp/tls
    readOnly: true
  {{- end }}
  - name: kvcomp-data
    mountPath: {{ .Values.persistence.mountPath }}
    {{- if eq (include "kvcomp.dataSubPathPerPod" .) "true" }}
    subPathExpr: $(POD_NAME)
    {{- end }}
  - name: kvcomp-shm
    mountPath: /dev/shm
  - name: kvcomp-tmp
    mountPath: /tmp
  {{- with .Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/*
Pod volumes. The data volume is left out for a pvc (the StatefulSet's claim template makes it).
The auth Secret is mounted as a directory, not by subPath, so that a rotated token file reaches
the running daemon (which reloads it).
*/}}
{{- define "kvcomp.volumes" -}}
{{- $p := include "kvcomp.persistenceType" . -}}
- name: kvcomp-config
  configMap:
    name: {{ include "kvcomp.configName" . }}
{{- with include "kvcomp.authSecretName" . }}
- name: kvcomp-auth
  secret:
    secretName: {{ . }}
    items:
      - key: {{ $.Values.auth.secretKey }}
        path: tokens
{{- end }}
{{- if .Values.thriftTls.enabled }}
- name: kvcomp-tls
  secret:
    secretName: {{ .Values.thriftTls.secretName }}
{{- end }}
{{- if eq $p "hostPath" }}
- name: kvcomp-data
  hostPath:
    path: {{ .Values.persistence.hostPath.path }}
    type: {{ .Values.persistence.hostPath.type }}
{{- else if eq $p "emptyDir" }}
- name: kvcomp-data
  emptyDir:
    {{- with .Values.persistence.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
- name: kvcomp-shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ucx.shmSize }}
- name: kvcomp-tmp
  emptyDir: {}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Annotations that roll the pods when the configuration changes. */}}
{{- define "kvcomp.configChecksum" -}}
checksum/config: {{ include "kvcomp.daemonConfig" . | sha256sum }}
{{- end -}}

{{/* The pod template of the DaemonSet and the StatefulSet. */}}
{{- define "kvcomp.podTemplate" -}}
metadata:
  labels:
    {{- include "kvcomp.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: kvcompd
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- include "kvcomp.configChecksum" . | nindent 4 }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "kvcomp.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- if and .Values.gpu.enabled .Values.gpu.runtimeClassName }}
  runtimeClassName: {{ .Values.gpu.runtimeClassName }}
  {{- end }}
  {{- if .Values.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  {{- if .Values.hostIPC }}
  hostIPC: true
  {{- end }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  {{- with .Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if and .Values.volumePermissions.enabled (eq (include "kvcomp.persistenceType" .) "hostPath") }}
  initContainers:
    - name: volume-permissions
      image: {{ include "kvcomp.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        - chown
        - "{{ .Values.podSecurityContext.runAsUser | default 10001 }}:{{ .Values.podSecurityContext.fsGroup | default 10001 }}"
        - {{ .Values.persistence.mountPath | quote }}
      securityContext:
        runAsUser: 0
        runAsNonRoot: false
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop:
            - ALL
          add:
            - CHOWN
      {{- if eq (include "kvcomp.dataSubPathPerPod" .) "true" }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
      {{- end }}
      volumeMounts:
        - name: kvcomp-data
          mountPath: {{ .Values.persistence.mountPath }}
          {{- if eq (include "kvcomp.dataSubPathPerPod" .) "true" }}
          subPathExpr: $(POD_NAME)
          {{- end }}
  {{- end }}
  containers:
    - {{ include "kvcomp.container" . | indent 6 | trim }}
  volumes:
    {{- include "kvcomp.volumes" . | nindent 4 }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
Library templates for mode=sidecar, for an inference chart that lists kvcomp as a dependency and
calls them with the subchart's context (helm/examples/inference-sidecar):
  containers:
    - name: engine
      ...
    - {{ include "kvcomp.sidecar.container" .Subcharts.kvcomp | indent 6 | trim }}
  volumes:
    {{- include "kvcomp.sidecar.volumes" .Subcharts.kvcomp | nindent 4 }}
and adds `kvcomp.sidecar.podLabels` (so the PodMonitor finds the pod) and
`kvcomp.sidecar.podAnnotations` (to roll the pod on a config change) to its pod template.
The inference container then reaches kvcompd on localhost at ports.ucx and ports.thrift.
*/}}
{{- define "kvcomp.sidecar.container" -}}
{{ include "kvcomp.container" . }}
{{- end -}}

{{- define "kvcomp.sidecar.volumes" -}}
{{ include "kvcomp.volumes" . }}
{{- end -}}

{{- define "kvcomp.sidecar.podLabels" -}}
kvcomp.io/sidecar: {{ include "kvcomp.fullname" . | quote }}
{{- end -}}

{{- define "kvcomp.sidecar.podAnnotations" -}}
{{ include "kvcomp.configChecksum" . }}
{{- end -}}

{{/*
The SDK endpoints of this release (clients.endpoints, or derived from the mode): the headless
Service as a DNS pool (the SDKs resolve every ready daemon and follow the pool as it changes), or
in sidecar mode the daemon of the same pod on localhost.
*/}}
{{- define "kvcomp.clientEndpoints" -}}
{{- if .Values.clients.endpoints -}}
{{ .Values.clients.endpoints }}
{{- else if eq .Values.mode "sidecar" -}}
127.0.0.1:{{ .Values.ports.ucx }},127.0.0.1:{{ .Values.ports.thrift }}
{{- else if .Values.service.enabled -}}
dns:///{{ include "kvcomp.fullname" . }}.{{ .Release.Namespace }}.svc:{{ .Values.ports.ucx }},{{ .Values.ports.thrift }}
{{- else -}}
{{- fail "clients.endpoints: set it when service.enabled is false (there is no Service to resolve)" -}}
{{- end -}}
{{- end -}}

{{/*
KVCOMP_ENDPOINTS for an inference container, as an env list entry:
  env:
    {{- include "kvcomp.client.env" .Subcharts.kvcomp | nindent 4 }}
*/}}
{{- define "kvcomp.client.env" -}}
- name: KVCOMP_ENDPOINTS
  value: {{ include "kvcomp.clientEndpoints" . | quote }}
{{- end -}}
