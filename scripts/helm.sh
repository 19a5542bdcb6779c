#!/bin/sh
# The helm binary the tests and `make manifests` use: helm.sh/helm/v3 built from the Go module proxy
# with the Go toolchain, cached outside the repository (~/.cache/tidal/helm/<version>/helm).
#   sh scripts/helm.sh          build it where missing, print its path
set -eu
version="${HELM_VERSION:-v3.22.0}"
dir="${TIDAL_CACHE:-$HOME/.cache/tidal}/helm/$version"
if [ ! -x "$dir/helm" ]; then
    command -v go >/dev/null 2>&1 || { echo "helm: needs the Go toolchain to build helm $version" >&2; exit 1; }
    echo "helm: building helm.sh/helm/v3 $version (once; cached in $dir)" >&2
    mkdir -p "$dir"
    (cd /tmp && GOBIN="$dir" GOFLAGS=-mod=mod go install "helm.sh/helm/v3/cmd/helm@$version") >&2
fi
echo "$dir/helm"
