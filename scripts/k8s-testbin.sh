#!/bin/sh
# Build the real control plane the Kubernetes end-to-end tests run against:
# kube-apiserver, kube-scheduler and kube-controller-manager from the
# k8s.io/kubernetes Go module, the node's kubelet and kubectl (the node tier),
# and etcd from go.etcd.io/etcd/server/v3, all from the Go module proxy. Cached
# outside the repository: a second run returns at once, and a cache that lacks
# some of them (an older one) builds only those.
#
#   K8S_VERSION=1.34.4 ETCD_VERSION=3.5.21 TIDAL_K8S_TESTBIN=DIR sh scripts/k8s-testbin.sh
#
# k8s.io/kubernetes is not meant to be a dependency: its go.mod points each
# staging module (k8s.io/api, k8s.io/client-go, ...) at ./staging/src/...;
# a consumer must pin each to the matching v0.X.Y tag. This script reads
# those replace lines from the module's own go.mod and writes the pins.
set -eu
K8S_VERSION="${K8S_VERSION:-1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-3.5.21}"
DEST="${TIDAL_K8S_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal/k8s-testbin/v$K8S_VERSION}"
KUBE_COMMANDS="kube-apiserver kube-scheduler kube-controller-manager kubelet kubectl"
missing=""
for bin in $KUBE_COMMANDS; do [ -x "$DEST/$bin" ] || missing="$missing $bin"; done
if [ -z "$missing" ] && [ -x "$DEST/etcd" ]; then
    echo "k8s-testbin: cached in $DEST"
    exit 0
fi
command -v go >/dev/null 2>&1 || { echo "k8s-testbin: needs Go (https://go.dev/dl)" >&2; exit 1; }
mkdir -p "$DEST"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
staging_tag="v0.${K8S_VERSION#1.}"

echo "k8s-testbin:$missing v$K8S_VERSION (takes a while: it compiles Kubernetes)"
mkdir -p "$work/k8s"
cd "$work/k8s"
gomod="$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
{
    echo "module tidal.local/k8stestbin"
    echo
    echo "go 1.24"
    echo
    echo "require k8s.io/kubernetes v$K8S_VERSION"
    echo
    echo "replace ("
    sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9.-]*\) => ./staging/src/.*#\t\1 => \1 '"$staging_tag"'#p' "$gomod"
    echo ")"
} > go.mod
{
    echo "//go:build tools"
    echo
    echo "package tools"
    echo
    echo "import ("
    for bin in $KUBE_COMMANDS; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$bin"; done
    echo ")"
} > tools.go
go mod tidy >/dev/null
for bin in $missing; do
    echo "k8s-testbin: building $bin"
    # the version each reports (kubelet --version, the Node's kubeletVersion), as a release build stamps it
    go build -trimpath -ldflags "-X k8s.io/component-base/version.gitVersion=v$K8S_VERSION \
        -X k8s.io/component-base/version.gitMajor=${K8S_VERSION%%.*} \
        -X k8s.io/component-base/version.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2) \
        -X k8s.io/component-base/version.gitTreeState=clean" -o "$DEST/$bin.tmp" "k8s.io/kubernetes/cmd/$bin"
    mv "$DEST/$bin.tmp" "$DEST/$bin"
done

if [ -x "$DEST/etcd" ]; then echo "k8s-testbin: built in $DEST"; exit 0; fi
echo "k8s-testbin: etcd v$ETCD_VERSION"
mkdir -p "$work/etcd"
cd "$work/etcd"
cat > go.mod <<EOF
module tidal.local/etcdtestbin

go 1.24

require go.etcd.io/etcd/server/v3 v$ETCD_VERSION
EOF
cat > main.go <<'EOF'
// The etcd server's own entry point (etcdmain.Main), built as a binary.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
go mod tidy >/dev/null
go build -trimpath -o "$DEST/etcd.tmp" .

mv "$DEST/etcd.tmp" "$DEST/etcd"
echo "k8s-testbin: built in $DEST"
