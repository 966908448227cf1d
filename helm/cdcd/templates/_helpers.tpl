{{/*
Names and labels shared by the templates.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "cdcd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource name: fullnameOverride, else "<release>-<chart>" (just the release name when it
already contains the chart name). Truncated to 63 characters (DNS label limit).
*/}}
{{- define "cdcd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "chart-version" for the helm.sh/chart label. */}}
{{- define "cdcd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every resource carries. */}}
{{- define "cdcd.labels" -}}
helm.sh/chart: {{ include "cdcd.chart" . }}
{{ include "cdcd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels the Deployment and the Service select the pod by. */}}
{{- define "cdcd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cdcd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The image reference: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "cdcd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The claim mounted at /var/lib/cdcd when persistence is enabled. */}}
{{- define "cdcd.claimName" -}}
{{- default (include "cdcd.fullname" .) .Values.persistence.existingClaim }}
{{- end }}

{{/* Where the password Secret is mounted in mode "file". */}}
{{- define "cdcd.secretDir" -}}
/etc/cdcd-secret
{{- end }}
