#!/bin/sh
# Build what the node tier (pytest -m node) runs beside the control plane of k8s-testbin:
# containerd 2.x with its runc shim and ctr, and runc 1.3, from the Go module proxy (Debian's
# containerd 1.6 has no NRI; Debian's runc 1.1.5 fails every container on this host's 6.18 kernel:
# "can't get final child's PID from pipe"), and the two images the tier's pods use, as OCI
# archives, with no registry:
#   tidal.local/pause:1     the pod sandbox (tests/node/images/pause, a static Go binary)
#   tidal.local/busybox:1   the workloads (Debian's busybox-static)
# runc is built with seccomp (libseccomp-dev, scripts/debian-packages.txt). Cached outside the
# repository.
#
#   CONTAINERD_VERSION=2.2.9 RUNC_VERSION=1.3.6 TIDAL_NODE_TESTBIN=DIR sh scripts/node-testbin.sh
set -eu
cd "$(dirname "$0")/.."
CONTAINERD_VERSION="${CONTAINERD_VERSION:-2.2.9}"
RUNC_VERSION="${RUNC_VERSION:-1.3.6}"
DEST="${TIDAL_NODE_TESTBIN:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal/node-testbin/containerd-v$CONTAINERD_VERSION}"
pause_sum="$(cat tests/node/images/pause/main.go tests/node/images/pause/go.mod | sha256sum | cut -c1-12)"
done_all=1
for f in containerd containerd-shim-runc-v2 ctr "runc-$RUNC_VERSION" "pause-$pause_sum.oci.tar" busybox.oci.tar; do
    [ -e "$DEST/$f" ] || done_all=0
done
if [ "$done_all" = 1 ]; then
    echo "node-testbin: cached in $DEST"
    exit 0
fi
command -v go >/dev/null 2>&1 || { echo "node-testbin: needs Go (https://go.dev/dl)" >&2; exit 1; }
command -v umoci >/dev/null 2>&1 || { echo "node-testbin: needs umoci (apt-get install umoci)" >&2; exit 1; }
[ -x /bin/busybox ] || { echo "node-testbin: needs busybox-static (apt-get install busybox-static)" >&2; exit 1; }
mkdir -p "$DEST"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
repo="$(pwd)"

go_module() {  # NAME MODULE VERSION: a scratch module in $work/NAME that requires MODULE@VERSION; cd there
    mkdir -p "$work/$1"
    cd "$work/$1"
    printf 'module tidal.local/%s\n\ngo 1.24\n\nrequire %s %s\n' "$1" "$2" "$3" > go.mod
}

if ! [ -x "$DEST/containerd" ] || ! [ -x "$DEST/containerd-shim-runc-v2" ] || ! [ -x "$DEST/ctr" ]; then
    echo "node-testbin: containerd v$CONTAINERD_VERSION, its runc shim and ctr"
    go_module containerd github.com/containerd/containerd/v2 "v$CONTAINERD_VERSION"
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
GO
    go mod tidy >/dev/null
    # no_btrfs: the btrfs snapshotter needs btrfs headers (cgo); the tier uses overlayfs
    for cmd in containerd containerd-shim-runc-v2 ctr; do
        go build -trimpath -tags no_btrfs -o "$DEST/$cmd.tmp" "github.com/containerd/containerd/v2/cmd/$cmd"
        mv "$DEST/$cmd.tmp" "$DEST/$cmd"
    done
    cd "$repo"
fi

if ! [ -x "$DEST/runc-$RUNC_VERSION" ]; then
    echo "node-testbin: runc v$RUNC_VERSION"
    go_module runc github.com/opencontainers/runc "v$RUNC_VERSION"
    printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/opencontainers/runc"\n' > tools.go
    go mod tidy >/dev/null
    go build -trimpath -tags seccomp -o "$DEST/runc.tmp" github.com/opencontainers/runc
    mv "$DEST/runc.tmp" "$DEST/runc-$RUNC_VERSION"
    cd "$repo"
fi

# one image: a tar of ROOT as its only layer, ENTRYPOINT given, packed as an OCI archive
pack() {  # NAME ROOT OUT ENTRYPOINT...
    name="$1" root="$2" out="$3"
    shift 3
    rm -rf "$work/oci"
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$root" -cf "$work/layer.tar" .
    umoci init --layout "$work/oci"
    umoci new --image "$work/oci:$name"
    umoci raw add-layer --image "$work/oci:$name" "$work/layer.tar"
    set -- $(for arg in "$@"; do printf -- '--config.entrypoint %s ' "$arg"; done)
    umoci config --image "$work/oci:$name" --created 1970-01-01T00:00:00Z "$@"
    umoci gc --layout "$work/oci"
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/oci" -cf "$out.tmp" .
    mv "$out.tmp" "$out"
}

if ! [ -e "$DEST/pause-$pause_sum.oci.tar" ]; then
    echo "node-testbin: the pause image"
    mkdir -p "$work/pause-root"
    (cd tests/node/images/pause && CGO_ENABLED=0 go build -trimpath -ldflags=-s -o "$work/pause-root/pause" .)
    pack tidal.local/pause:1 "$work/pause-root" "$DEST/pause-$pause_sum.oci.tar" /pause
fi
if ! [ -e "$DEST/busybox.oci.tar" ]; then
    echo "node-testbin: the busybox image"
    mkdir -p "$work/busybox-root/bin"
    cp /bin/busybox "$work/busybox-root/bin/busybox"
    /bin/busybox --install -s "$work/busybox-root/bin"
    # --install -s links to the running binary's path; the image's is /bin/busybox
    for link in "$work/busybox-root/bin"/*; do [ -L "$link" ] && ln -sf busybox "$link"; done
    pack tidal.local/busybox:1 "$work/busybox-root" "$DEST/busybox.oci.tar" /bin/sh
fi
echo "node-testbin: built in $DEST"
