#!/bin/sh
# Build Tidal's image with no registry and no container engine: the root filesystem from Debian
# packages (mmdebstrap) and PyPI (pip, in a venv inside it), with the NRI plugin (Go, cmd/tidal-nri,
# built static with the Go toolchain and its module proxy), written as one OCI image layout and
# packed as an OCI archive (umoci), which `ctr images import`, `podman load`, `skopeo copy
# oci-archive:...` and so any registry accept. The Containerfile describes the same image for
# those who build with buildah, podman or docker; both read deploy/image/packages.txt.
#
#   sh scripts/image.sh [OUT]        OUT defaults to dist/tidal_<version>.oci.tar
#
# The image's name is docker.io/library/tidal:<version>, the version in pyproject.toml: the
# manifests in deploy/ name the same (a unit test holds them to it). Its content is reproducible
# given the same Debian snapshot and PyPI (the layer's diff_id in the image's config is the same
# build after build; umoci's parallel gzip of it is not, so the archive's digest differs): file
# times are SOURCE_DATE_EPOCH (the last commit's), and the
# bytecode is compiled once more after pip (hash-based, PEP 552: no time in it; one process without
# site, -S: a module a .pth file had imported, or parallel workers, made marshal's output of a file
# differ from build to build). The image ships
# its bytecode because its root filesystem is read-only in every pod: without it each process
# compiled every module it imported at each start, and the official Kubernetes client's
# core_v1_api.py (4.5 MB of source) alone left the process 80 MiB larger (126 MiB against 64).
set -eu
cd "$(dirname "$0")/.."
for tool in mmdebstrap umoci go; do
    command -v "$tool" >/dev/null 2>&1 || { echo "image: needs $tool (apt-get install $tool)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "image: needs root (mmdebstrap installs packages into a chroot)" >&2; exit 1; }
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)"
[ -n "$version" ] || { echo "image: no version in pyproject.toml" >&2; exit 1; }
name="docker.io/library/tidal:$version"
out="${1:-dist/tidal_$version.oci.tar}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}"
export SOURCE_DATE_EPOCH
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Every wheel is fetched here, on the host (its pip configuration, proxy and CA apply), for the
# image's Python (Debian bookworm's 3.11, manylinux x86_64); the chroot installs them with no index
# and never reaches the network.
echo "image: the Tidal wheel and its dependencies' wheels (for CPython 3.11, manylinux x86_64)"
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$work/wheel" . >/dev/null
python3 -m pip download --quiet --disable-pip-version-check --dest "$work/wheel" --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    "$work"/wheel/tidal-*.whl >/dev/null
echo "image: tidal-nri, Tidal's NRI plugin (cmd/tidal-nri, static)"
mkdir -p "$work/bin"
(cd cmd/tidal-nri && CGO_ENABLED=0 go build -trimpath -ldflags=-s -o "$work/bin/tidal-nri" .)
packages="$(grep -v '^[[:space:]]*#' deploy/image/packages.txt | grep -v '^[[:space:]]*$' | paste -sd, -)"

echo "image: root filesystem (Debian bookworm: $packages; Tidal and its dependencies from PyPI)"
mmdebstrap --quiet --variant=minbase --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --customize-hook="mkdir -p \"\$1/tmp/wheel\"" \
    --customize-hook="copy-in $work/wheel/. /tmp/wheel" \
    --customize-hook='chroot "$1" /usr/bin/env -i PATH=/usr/bin:/bin python3 -m venv /opt/tidal' \
    --customize-hook='chroot "$1" /usr/bin/env -i PATH=/usr/bin:/bin sh -c "/opt/tidal/bin/pip install --quiet --no-cache-dir --disable-pip-version-check --no-index --find-links /tmp/wheel /tmp/wheel/tidal-*.whl"' \
    --customize-hook='chroot "$1" ln -s /opt/tidal/bin/tidal /usr/local/bin/tidal' \
    --customize-hook="copy-in $work/bin/tidal-nri /opt/tidal/bin" \
    --customize-hook='rm -rf "$1/tmp/wheel" "$1/var/lib/apt/lists"/* "$1/var/cache/apt"/*' \
    --customize-hook='find "$1/opt/tidal" -name __pycache__ -prune -exec rm -rf {} +' \
    --customize-hook='chroot "$1" /usr/bin/env -i PATH=/usr/bin:/bin /opt/tidal/bin/python -S -m compileall -q --invalidation-mode unchecked-hash /opt/tidal/lib >/dev/null' \
    bookworm "$work/rootfs.tar" "$mirror"

echo "image: OCI layout"
umoci init --layout "$work/oci"
umoci new --image "$work/oci:$name"
umoci raw add-layer --image "$work/oci:$name" --history.created_by "mmdebstrap bookworm + pip install tidal $version" \
    "$work/rootfs.tar"
created="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
umoci config --image "$work/oci:$name" --created "$created" --history.created "$created" \
    --config.env PATH=/opt/tidal/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --config.entrypoint tidal --config.cmd agent --config.user 65532:65532 \
    --config.label org.opencontainers.image.title=tidal \
    --config.label org.opencontainers.image.version="$version"
umoci gc --layout "$work/oci"
mkdir -p "$(dirname "$out")"
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner -C "$work/oci" -cf "$out.tmp" .
mv "$out.tmp" "$out"
echo "image: $name in $out ($(du -h "$out" | cut -f1))"
