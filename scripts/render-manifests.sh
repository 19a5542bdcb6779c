#!/bin/sh
# The plain manifests of deploy/ rendered from the chart (deploy/helm/tidal), its one source:
#   sh scripts/render-manifests.sh [OUT]     OUT defaults to deploy/ (make manifests)
# with the chart's defaults, in namespace tidal-system (made by the manifests), with the alerts as a
# PrometheusRule. The test tests/unit/test_chart.py renders them again and fails when deploy/ differs.
set -eu
cd "$(dirname "$0")/.."
helm="$(sh scripts/helm.sh)"
out="${1:-deploy}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$helm" template tidal deploy/helm/tidal --namespace tidal-system --include-crds \
    --set namespace.create=true --set monitoring.prometheusRule.enabled=true --output-dir "$work" >/dev/null
rendered="$work/tidal"
note() {
    printf '# Rendered from the chart (deploy/helm/tidal/%s) by scripts/render-manifests.sh (make manifests):\n' "$1"
    printf '# edit the chart, then render again. Namespace tidal-system, the chart'"'"'s default values.\n'
}
# helm writes each template's output under "# Source: ..." lines; a file per manifest of deploy/
strip() { grep -v '^# Source: ' "$@"; }
mkdir -p "$out/monitoring"
for crd in "$rendered"/crds/*.yaml; do
    name="$(basename "$crd")"
    { note "crds/$name"; strip "$crd" | sed '1{/^---$/d}'; } > "$out/$name"
done
{ note "templates/namespace.yaml, templates/rbac.yaml"; strip "$rendered/templates/namespace.yaml" | sed '1{/^---$/d}'
  strip "$rendered/templates/rbac.yaml"; } > "$out/rbac.yaml"
{ note "templates/agent-daemonset.yaml"; strip "$rendered/templates/agent-daemonset.yaml" | sed '1{/^---$/d}'; } \
    > "$out/agent-daemonset.yaml"
{ note "templates/extender.yaml"; strip "$rendered/templates/extender.yaml" | sed '1{/^---$/d}'; } > "$out/extender.yaml"
{ note "templates/scheduler.yaml"; strip "$rendered/templates/scheduler.yaml" | sed '1{/^---$/d}'; } > "$out/scheduler.yaml"
# the metrics API is off by default (a cluster runs it or metrics-server): its manifest rendered with it on
"$helm" template tidal deploy/helm/tidal --namespace tidal-system --set metrics.enabled=true \
    --show-only templates/metrics.yaml > "$work/metrics.yaml"
{ note "templates/metrics.yaml (metrics.enabled=true)"; strip "$work/metrics.yaml" | sed '1{/^---$/d}'; } \
    > "$out/metrics.yaml"
{ note "templates/monitoring.yaml"; strip "$rendered/templates/monitoring.yaml" | sed '1{/^---$/d}'; } \
    > "$out/monitoring/prometheus-rule.yaml"
echo "rendered deploy/ from the chart into $out"
