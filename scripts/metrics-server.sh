#!/bin/sh
# Kubernetes' metrics-server, the peer of `tidal cluster metrics`, for the node tier's side-by-side check
# (tests/node/test_node.py, the HPA test): sigs.k8s.io/metrics-server at the release the Go module proxy
# serves here, built with the Go toolchain and cached outside the repository
# (~/.cache/tidal/metrics-server/<version>/metrics-server).
#   sh scripts/metrics-server.sh          build it where missing, print the binary's path
set -eu
version="${METRICS_SERVER_VERSION:-v0.9.0}"
dir="${TIDAL_CACHE:-$HOME/.cache/tidal}/metrics-server/$version"
if [ ! -x "$dir/metrics-server" ]; then
    command -v go >/dev/null 2>&1 || { echo "metrics-server: needs the Go toolchain to build $version" >&2; exit 1; }
    echo "metrics-server: building sigs.k8s.io/metrics-server/cmd/metrics-server $version (once; cached in $dir)" >&2
    mkdir -p "$dir"
    (cd /tmp && GOBIN="$dir/bin.tmp" CGO_ENABLED=0 go install "sigs.k8s.io/metrics-server/cmd/metrics-server@$version") >&2
    mv "$dir/bin.tmp/metrics-server" "$dir/metrics-server"
    rmdir "$dir/bin.tmp"
fi
echo "$dir/metrics-server"
