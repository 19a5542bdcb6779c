#!/bin/sh
# KWOK (sigs.k8s.io/kwok): the controller that makes Node objects look like live nodes (leases,
# conditions) and pods bound to them run, with no kubelet. The scheduler tier and
# `tidal bench scheduler` run it beside the control plane of `make k8s-testbin`. Built from the Go
# module proxy and cached outside the repository (~/.cache/tidal/kwok/<version>/kwok).
#   sh scripts/kwok.sh          build it where missing, print its path
set -eu
version="${KWOK_VERSION:-v0.7.0}"
dir="${TIDAL_CACHE:-$HOME/.cache/tidal}/kwok/$version"
if [ ! -x "$dir/kwok" ]; then
    command -v go >/dev/null 2>&1 || { echo "kwok: needs the Go toolchain to build kwok $version" >&2; exit 1; }
    echo "kwok: building sigs.k8s.io/kwok $version (once; cached in $dir)" >&2
    mkdir -p "$dir"
    (cd /tmp && GOBIN="$dir" GOFLAGS=-mod=mod go install "sigs.k8s.io/kwok/cmd/kwok@$version") >&2
fi
echo "$dir/kwok"
