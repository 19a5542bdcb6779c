#!/bin/sh
# The kernel the VM tiers boot (make test-cgroup2, make test-systemd): Debian's linux-image-amd64 of
# $TIDAL_VM_SUITE (default bookworm-backports: 6.12, where cpuset partitions under a non-partition
# parent need Linux >= 6.7), fetched with apt (signatures checked by apt) into a private apt state,
# unpacked with dpkg -x and cached outside the repository. Prints the cached tree's directory
# (boot/vmlinuz-<version>, lib/modules/<version>); its base name is the version.
set -eu
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tidal"
SUITE="${TIDAL_VM_SUITE:-bookworm-backports}"
say() { echo "vm-kernel: $*" >&2; }
APT="$CACHE/vm-apt/$SUITE"
KERNELS="$CACHE/kernel"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$KERNELS"
echo "deb http://deb.debian.org/debian $SUITE main" > "$APT/sources.list"
apt_opts="-o Dir::Etc::SourceList=$APT/sources.list -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists=$APT/lists
 -o Dir::Cache=$APT/cache -o Debug::NoLocking=1 -o APT::Sandbox::User=root"
if [ -s "$APT/kernel" ] && [ -f "$KERNELS/$(cat "$APT/kernel")/done" ]; then
    version="$(cat "$APT/kernel")"
else
    say "resolving linux-image-amd64 in $SUITE"
    # shellcheck disable=SC2086
    apt-get $apt_opts update -qq
    # shellcheck disable=SC2086
    package="$(apt-cache $apt_opts depends linux-image-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)"
    [ -n "$package" ] || { say "no linux-image-amd64 in $SUITE"; exit 1; }
    version="${package#linux-image-}"
    if ! [ -f "$KERNELS/$version/done" ]; then
        say "downloading $package"
        work="$(mktemp -d)"
        # shellcheck disable=SC2086
        (cd "$work" && apt-get $apt_opts download "$package" >/dev/null)
        rm -rf "$KERNELS/$version"
        dpkg -x "$work"/*.deb "$KERNELS/$version"
        rm -rf "$work"
        touch "$KERNELS/$version/done"
    fi
    echo "$version" > "$APT/kernel"
fi
echo "$KERNELS/$version"
