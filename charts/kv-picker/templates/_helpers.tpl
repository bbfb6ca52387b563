{{- define "kv-picker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kv-picker.fullname" -}}
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

{{- define "kv-picker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kv-picker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Components other than the picker get a name of their own, so that no selector of the
picker's (Deployment, Service, PodDisruptionBudget) ever matches their pods. */}}
{{- define "kv-picker.componentSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-%s" (include "kv-picker.name" .root) .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "kv-picker.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kv-picker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kv-picker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kv-picker.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kv-picker.poolName" -}}
{{- default (include "kv-picker.fullname" .) .Values.inferencePool.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kv-picker.valkeyName" -}}
{{- printf "%s-valkey" (include "kv-picker.fullname" . | trunc 56 | trimSuffix "-") -}}
{{- end -}}

{{- define "kv-picker.envoyName" -}}
{{- printf "%s-envoy" (include "kv-picker.fullname" . | trunc 57 | trimSuffix "-") -}}
{{- end -}}

{{/* The picker's config: the user's document with the sections the chart owns. */}}
{{- define "kv-picker.config" -}}
{{- $admin := dict "enabled" .Values.admin.enabled "host" "127.0.0.1" "port" (int .Values.admin.port) -}}
{{- $server := dict "host" "0.0.0.0" "grpcPort" (int .Values.grpc.port) "metricsPort" (int .Values.metrics.port) "admin" $admin "shutdownDelay" .Values.shutdownDelay "drainTimeout" .Values.drainTimeout -}}
{{- if .Values.tls.enabled -}}
{{- $tls := dict "certPath" "/etc/kv-picker/tls/tls.crt" "keyPath" "/etc/kv-picker/tls/tls.key" -}}
{{- if .Values.tls.clientCA.enabled -}}
{{- $_ := set $tls "clientCAPath" (printf "/etc/kv-picker/client-ca/%s" .Values.tls.clientCA.key) -}}
{{- end -}}
{{- $_ := set $server "tls" $tls -}}
{{- end -}}
{{- $config := deepCopy .Values.config -}}
{{- $_ := set $config "server" (merge $server (default (dict) $config.server)) -}}
{{- if .Values.inferencePool.enabled -}}
{{- $kubernetes := dict "namespace" .Release.Namespace "inferencePool" (include "kv-picker.poolName" .) -}}
{{- if ne .Values.inferencePool.group "inference.networking.k8s.io" -}}
{{- $_ := set $kubernetes "inferencePoolGroup" .Values.inferencePool.group -}}
{{- end -}}
{{- $_ := set $config "discovery" (dict "kubernetes" $kubernetes) -}}
{{- end -}}
{{- if .Values.valkey.enabled -}}
{{- $url := printf "redis://%s:%d/0" (include "kv-picker.valkeyName" .) (int .Values.valkey.port) -}}
{{- $_ := set $config "index" (merge (dict "backend" "redis" "url" $url) (default (dict) $config.index)) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{- /* serve --worker-ports: workerPortBase, workerPortBase + 1, ... (one per worker). */}}
{{- define "kv-picker.workerPorts" -}}
{{- $ports := list -}}
{{- range $i := until (int .Values.workers) -}}
{{- $ports = append $ports (add $.Values.workerPortBase $i | toString) -}}
{{- end -}}
{{- join "," $ports -}}
{{- end -}}
