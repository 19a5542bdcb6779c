#!/bin/sh
# Koordinator's node agent, koordlet, for the node tier's peers benchmark (tests/node/test_peers.py):
# github.com/koordinator-sh/koordinator at the newest release the Go module proxy serves here, built with
# the Go toolchain and cached outside the repository (~/.cache/tidal/koordlet/<version>/: the binary and the
# module's source, whose CRDs the benchmark installs). Its go.mod replaces modules, so `go install mod@v`
# refuses it: the module is downloaded and built in a copy. koordlet links libpfm4 (cgo): libpfm4-dev is
# installed from Debian where missing.
#   sh scripts/koordlet.sh          build it where missing, print the cache directory
set -eu
version="${KOORDINATOR_VERSION:-v1.8.0}"
dir="${TIDAL_CACHE:-$HOME/.cache/tidal}/koordlet/$version"
if [ ! -x "$dir/koordlet" ]; then
    command -v go >/dev/null 2>&1 || { echo "koordlet: needs the Go toolchain to build koordinator $version" >&2; exit 1; }
    if [ ! -e /usr/include/perfmon/pfmlib.h ]; then
        echo "koordlet: installing libpfm4-dev (koordlet's perf collector links it)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q libpfm4-dev >&2 \
            || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libpfm4-dev >&2; }
    fi
    echo "koordlet: building github.com/koordinator-sh/koordinator/cmd/koordlet $version (once; cached in $dir)" >&2
    mkdir -p "$dir"
    json=$(cd /tmp && go mod download -json "github.com/koordinator-sh/koordinator@$version" 2>&1 || true)
    module=$(printf '%s\n' "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    if [ -z "$module" ]; then
        why=$(printf '%s\n' "$json" | sed -n 's/^[[:space:]]*"Error": "\(.*\)",\{0,1\}$/\1/p' | head -n 1)
        echo "koordlet: the Go module proxy gave no koordinator $version: ${why:-$json}" >&2
        exit 1
    fi
    rm -rf "$dir/src.tmp"
    cp -r "$module" "$dir/src.tmp"
    chmod -R u+w "$dir/src.tmp"
    (cd "$dir/src.tmp" && go build -o "$dir/koordlet.tmp" ./cmd/koordlet) >&2
    rm -rf "$dir/src"
    mv "$dir/src.tmp" "$dir/src"
    mv "$dir/koordlet.tmp" "$dir/koordlet"
fi
echo "$dir"
