#!/bin/sh
# make dist: what a release ships, in dist/, with checksums.
#
#   dist/tidal-<version>-py3-none-any.whl, dist/tidal-<version>.tar.gz   (python -m build: pip/pipx install)
#   dist/tidal-<version>.tgz                                               (the Helm chart: helm package)
#   dist/tidal_<version>.oci.tar                                           (scripts/image.sh; root, mmdebstrap)
#   dist/SHA256SUMS
#
# The version is pyproject.toml's, and only there: `tidal --version` reads the installed package's
# metadata, the image is tagged from it, and the manifests in deploy/ are held to it by a test.
# TIDAL_DIST_IMAGE=0 leaves the image out (no root needed then).
set -eu
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)"
[ -n "$version" ] || { echo "dist: no version in pyproject.toml" >&2; exit 1; }
mkdir -p dist
rm -f "dist/tidal-$version-py3-none-any.whl" "dist/tidal-$version.tar.gz" "dist/tidal-$version.tgz" dist/SHA256SUMS
echo "dist: wheel and sdist of tidal $version"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
"$python" -m build --outdir dist . >"$log" 2>&1 || { cat "$log" >&2; echo "dist: the build failed" >&2; exit 1; }
files="tidal-$version-py3-none-any.whl tidal-$version.tar.gz tidal-$version.tgz"
echo "dist: the Helm chart"
helm="$(sh scripts/helm.sh)"
"$helm" package deploy/helm/tidal --destination dist >/dev/null
if [ "${TIDAL_DIST_IMAGE:-1}" = 1 ]; then
    sh scripts/image.sh "dist/tidal_$version.oci.tar"
    files="$files tidal_$version.oci.tar"
fi
(cd dist && sha256sum $files > SHA256SUMS)
echo "dist: $(wc -l < dist/SHA256SUMS) files, dist/SHA256SUMS"
cat dist/SHA256SUMS
