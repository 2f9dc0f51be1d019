{{- define "mcp-reattach.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mcp-reattach.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mcp-reattach.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mcp-reattach.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mcp-reattach.labels" -}}
{{ include "mcp-reattach.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- /* The pod's labels: podLabels, then the selector labels (which podLabels cannot change). */}}
{{- define "mcp-reattach.podLabels" -}}
{{- $selector := include "mcp-reattach.selectorLabels" . | fromYaml -}}
{{- toYaml (merge $selector (deepCopy .Values.podLabels)) -}}
{{- end -}}

{{- /* The pod's ServiceAccount: the chart's own when it creates one, else the one named
       (empty: the namespace's `default`). */}}
{{- define "mcp-reattach.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "mcp-reattach.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* The admin port is on the Service when asked for, or when a ServiceMonitor scrapes
       through it. */}}
{{- define "mcp-reattach.serviceAdminPort" -}}
{{- if or .Values.service.admin.enabled .Values.serviceMonitor.enabled -}}true{{- end -}}
{{- end -}}

{{- /* interval and scrapeTimeout of a ServiceMonitor endpoint or PodMonitor podMetricsEndpoint. */}}
{{- define "mcp-reattach.scrapeTiming" -}}
{{- with .interval }}
interval: {{ . }}
{{- end }}
{{- with .scrapeTimeout }}
scrapeTimeout: {{ . }}
{{- end }}
{{- end -}}

{{- /* "true" when the replicas share a store (store.url or store.existingSecret), else empty;
       fails on a store without its key Secret, a URL given both ways, or a key Secret
       without a store. */}}
{{- define "mcp-reattach.store" -}}
{{- $s := .Values.store | default dict -}}
{{- if and $s.url $s.existingSecret -}}
{{- fail "store.url and store.existingSecret are both set: give the store's URL one way (a URL with a password belongs in the Secret)" -}}
{{- end -}}
{{- if or $s.url $s.existingSecret -}}
{{- if not $s.keySecret -}}
{{- fail "store: a store URL (store.url or store.existingSecret) needs store.keySecret, the Secret holding the fleet's shared key (at least 32 random bytes, e.g. `head -c 32 /dev/urandom | base64`); mcp-reattach does not start without it" -}}
{{- end -}}
true
{{- else if $s.keySecret -}}
{{- fail "store.keySecret is set without a store: set store.url or store.existingSecret too, or drop it" -}}
{{- end -}}
{{- end -}}
