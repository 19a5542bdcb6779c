#!/bin/sh
# Build the upstream NodeResourceTopologyMatch plugin into a kube-scheduler:
# sigs.k8s.io/scheduler-plugins (the release for the control plane's
# Kubernetes minor) from the Go module proxy, with only that plugin registered
# (and its config scheme). Cached outside the repository beside the control
# plane (a second run returns at once).
#
#   PLUGINS_VERSION=0.34.7 K8S_VERSION=1.34.4 TIDAL_NRT_SCHEDULER=DIR sh scripts/nrt-scheduler.sh
#
# scheduler-plugins pins the Kubernetes staging modules (k8s.io/api, ...) to
# its own patch release; the proxy refuses some of those, so they are pinned
# here to the control plane's (K8S_VERSION), as scripts/k8s-testbin.sh does:
# the same API the tests' apiserver serves.
set -eu
PLUGINS_VERSION="${PLUGINS_VERSION:-0.34.7}"
K8S_VERSION="${K8S_VERSION:-1.34.4}"
DEST="${TIDAL_NRT_SCHEDULER:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal/nrt-scheduler/v$PLUGINS_VERSION-k$K8S_VERSION}"
if [ -x "$DEST/nrt-scheduler" ]; then
    echo "nrt-scheduler: cached in $DEST"
    exit 0
fi
command -v go >/dev/null 2>&1 || { echo "nrt-scheduler: needs Go (https://go.dev/dl)" >&2; exit 1; }
mkdir -p "$DEST"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
staging_tag="v0.${K8S_VERSION#1.}"
cd "$work"
echo "nrt-scheduler: scheduler-plugins v$PLUGINS_VERSION on Kubernetes v$K8S_VERSION (compiles a kube-scheduler)"
gomod="$(GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/scheduler-plugins@v$PLUGINS_VERSION" \
    | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
[ -n "$gomod" ] || { echo "nrt-scheduler: cannot download sigs.k8s.io/scheduler-plugins@v$PLUGINS_VERSION" >&2; exit 1; }
{
    echo "module tidal.local/nrtscheduler"
    echo
    echo "go 1.24"
    echo
    echo "require sigs.k8s.io/scheduler-plugins v$PLUGINS_VERSION"
    echo
    echo "replace ("
    # every k8s.io module the plugins' go.mod replaces, at the control plane's version
    sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9.-]*\) => k8s.io/[a-z0-9.-]* v0\..*#\t\1 => \1 '"$staging_tag"'#p' "$gomod" \
        | grep -v legacy-cloud-providers
    sed -n 's#^replace \(k8s.io/[a-z0-9.-]*\) => k8s.io/[a-z0-9.-]* v0\..*#\t\1 => \1 '"$staging_tag"'#p' "$gomod"
    echo "	k8s.io/kubernetes => k8s.io/kubernetes v$K8S_VERSION"
    echo ")"
} > go.mod
cat > main.go <<'EOF'
// kube-scheduler with the upstream NodeResourceTopologyMatch plugin (and nothing else of
// scheduler-plugins): what a stock topology-aware deployment runs.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"

	_ "sigs.k8s.io/scheduler-plugins/apis/config/scheme" // the plugin's args in the scheduler config
	"sigs.k8s.io/scheduler-plugins/pkg/noderesourcetopology"
)

func main() {
	command := app.NewSchedulerCommand(app.WithPlugin(noderesourcetopology.Name, noderesourcetopology.New))
	os.Exit(cli.Run(command))
}
EOF
go mod tidy >/dev/null
go build -trimpath -o "$DEST/nrt-scheduler.tmp" .
mv "$DEST/nrt-scheduler.tmp" "$DEST/nrt-scheduler"
echo "nrt-scheduler: built $DEST/nrt-scheduler"
