{{/* The image every container runs: repository:tag, the tag the chart's appVersion by default. */}}
{{- define "tidal.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
