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

{{/* The picker's config: the user's document with the server section the chart owns. */}}
{{- define "kv-picker.config" -}}
{{- $server := dict "host" "0.0.0.0" "grpcPort" (int .Values.grpc.port) "metricsPort" (int .Values.metrics.port) -}}
{{- if .Values.tls.enabled -}}
{{- $_ := set $server "tls" (dict "certPath" "/etc/kv-picker/tls/tls.crt" "keyPath" "/etc/kv-picker/tls/tls.key") -}}
{{- end -}}
{{- $config := deepCopy .Values.config -}}
{{- $_ := set $config "server" (merge $server (default (dict) $config.server)) -}}
{{- toYaml $config -}}
{{- end -}}
