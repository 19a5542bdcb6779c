#!/bin/sh
# Install the Debian packages listed in $1 that are missing. Needs root and
# apt-get; otherwise says why it skips (the tests that need a package skip
# with that reason too). A failed install as root is an error: CI must not
# pass by silently skipping what it was meant to run.
set -eu
list="$1"
missing=""
for pkg in $(grep -v '^[[:space:]]*#' "$list" | grep -v '^[[:space:]]*$'); do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing="$missing $pkg"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: not root or no apt-get: not installing Debian packages:$missing" >&2
    exit 0
fi
echo "installing Debian packages:$missing"
export DEBIAN_FRONTEND=noninteractive
for attempt in 1 2; do
    if apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null; then
        exit 0
    fi
    echo "apt-get failed (attempt $attempt)" >&2
    sleep 5
done
exit 1
