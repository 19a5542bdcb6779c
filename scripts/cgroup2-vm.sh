#!/bin/sh
# make test-cgroup2: the privileged tier on a pure cgroup v2 kernel, in a VM.
#
# virtme-ng (PyPI) boots a Debian kernel in qemu with this machine's root
# filesystem shared read-only (9p), so the checkout, its .venv and Python are
# the same inside; the kernel mounts only cgroup2 (no v1 hierarchy), with every
# controller. The tier's output comes back through one writable directory.
#
# Everything comes from the project's own lists: Debian packages
# (scripts/vm-debian-packages.txt), virtme-ng pinned below (its own venv in the
# cache), and the kernel: Debian's linux-image-amd64 from bookworm-backports
# (scripts/vm-kernel.sh, cached outside the repository); its modules go to
# /lib/modules/<version>, where virtme-ng looks for them.
#
#   TIDAL_VM_SUITE=bookworm          Debian's 6.1 instead (no remote partitions: Tidal falls back)
#   TIDAL_VM_ACCEL=tcg|kvm|auto      auto (default) tries KVM once, remembers whether it booted
#   TIDAL_VM_TESTS="tests/..."       what to run (default: every privileged test)
#   PYTEST_ARGS="-k ..."             passed to pytest inside the VM
#   TIDAL_VM_COMMAND="..."           a shell command to run inside instead of the tier (the benchmarks:
#                                    scripts/bench-hierarchies.py); its output and exit code come back
set -eu
cd "$(dirname "$0")/.."
REPO="$(pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tidal"
SUITE="${TIDAL_VM_SUITE:-bookworm-backports}"
VNG_VERSION=1.42
TESTS="${TIDAL_VM_TESTS:-tests/privileged}"
say() { echo "test-cgroup2: $*" >&2; }

[ "$(id -u)" = 0 ] || { say "needs root (modules under /lib/modules, real cgroups inside the VM)"; exit 2; }
[ -x .venv/bin/python ] || { say "no .venv: run 'make test' or 'make deps .venv/.installed' first"; exit 2; }
sh scripts/install-debian-packages.sh scripts/vm-debian-packages.txt

# virtme-ng, in its own venv (it is a tool for the host, not a dependency of Tidal)
VNG="$CACHE/vng-venv/bin/vng"
PATH="$CACHE/vng-venv/bin:$PATH"  # vng runs virtme-run from its own venv
if ! [ -x "$VNG" ] || ! "$CACHE/vng-venv/bin/pip" show virtme-ng 2>/dev/null | grep -q "^Version: $VNG_VERSION$"; then
    say "installing virtme-ng $VNG_VERSION into $CACHE/vng-venv"
    python3 -m venv "$CACHE/vng-venv"
    "$CACHE/vng-venv/bin/pip" install --quiet --disable-pip-version-check "virtme-ng==$VNG_VERSION"
fi

# the kernel: the newest linux-image-amd64 of $SUITE, once (scripts/vm-kernel.sh, shared with make test-systemd)
tree="$(TIDAL_VM_SUITE="$SUITE" sh scripts/vm-kernel.sh)"
version="$(basename "$tree")"
KERNELS="$(dirname "$tree")"
KERNEL="$KERNELS/$version/boot/vmlinuz-$version"
if ! [ -d "/lib/modules/$version/kernel" ]; then
    say "installing the modules of $version under /lib/modules (virtme-ng loads 9p and virtio from there)"
    mkdir -p /lib/modules
    cp -a "$KERNELS/$version/lib/modules/$version" /lib/modules/
    depmod "$version"
fi

OUT="$(mktemp -d /tmp/tidal-cgroup2-vm.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT
boot() {  # boot <accel flag> <timeout s> <script>: run a script in the VM; its own exit code in $OUT/rc
    rm -f "$OUT/rc"
    # the exit code twice: in a file of the shared directory, synced before the VM powers off, and on the
    # console, where it also arrives should the file's last write be lost with the VM; the kernel's own
    # messages (an OOM kill, a panic) on the console too (--verbose)
    # tsc=reliable: under a full emulated load the clocksource watchdog's reads come hundreds of ms apart, it
    # calls the TSC skewed and flips the sched_clock_stable static key at run time (scripts/systemd-vm.sh)
    timeout "$2" "$VNG" --run "$KERNEL" $1 --verbose --cpus 2 --memory 1G --rwdir "$OUT" --append tsc=reliable \
        --exec "sh $OUT/$3 > $OUT/log 2>&1; rc=\$?; echo \$rc > $OUT/rc; sync; echo tidal-vm-rc=\$rc" \
        > "$OUT/console" 2>&1 || true
    if ! [ -s "$OUT/rc" ] && grep -q "^tidal-vm-rc=[0-9]*" "$OUT/console"; then
        say "the exit code came by the console (the file's write was lost)"
        grep -o "^tidal-vm-rc=[0-9]*" "$OUT/console" | tail -1 | cut -d= -f2 > "$OUT/rc"
    fi
    [ -s "$OUT/rc" ]
}

# KVM when it works (nested KVM may not boot at all), software emulation otherwise
ACCEL="${TIDAL_VM_ACCEL:-auto}"
if [ "$ACCEL" = auto ]; then
    if [ -s "$CACHE/vm-accel" ]; then
        ACCEL="$(cat "$CACHE/vm-accel")"
    elif [ -w /dev/kvm ]; then
        echo 'true' > "$OUT/probe.sh"
        if boot "" 60 probe.sh; then ACCEL=kvm; else ACCEL=tcg; fi
        echo "$ACCEL" > "$CACHE/vm-accel"
        say "KVM probe: $ACCEL (remembered in $CACHE/vm-accel)"
    else
        ACCEL=tcg
    fi
fi
case "$ACCEL" in kvm) accel_flag="";; tcg) accel_flag="--disable-kvm";; *) say "TIDAL_VM_ACCEL: tcg, kvm or auto"; exit 2;; esac

cat > "$OUT/tier.sh" <<EOF
set -u
cd "$REPO"
echo "kernel: \$(uname -r); /sys/fs/cgroup: \$(stat -f -c %T /sys/fs/cgroup); controllers: \$(cat /sys/fs/cgroup/cgroup.controllers); cpus: \$(nproc)"
if awk '\$3 == "cgroup" { found = 1 } END { exit !found }' /proc/self/mounts; then echo "a cgroup v1 hierarchy is mounted: not a pure v2 host"; exit 3; fi
# virtme-ng hides the host's /etc/shadow behind an empty file mounted over it; useradd (the security
# test's) replaces that file by a rename, which a mount point refuses. /etc is a writable overlay here.
umount /etc/shadow 2>/dev/null || true
# /var/tmp is tmpfs here, and a tmpfs file's pages are never reclaimed: a disk-backed ext4 over it (a loop
# device on a file in the writable 9p directory), for what measures page cache (bench memory-isolation).
# The loop device reads its file with direct io, as a disk has no page cache of its own under the
# filesystem's: buffered, each block would be cached twice, and with the io controller enabled the loop
# device charges its file's cache to the cgroup that asked for the block (a box of the bench's size then
# holds half the pages it should).
if modprobe loop 2>/dev/null; truncate -s 4G "$OUT/var-tmp.img" && mkfs.ext4 -q -F "$OUT/var-tmp.img" \
        && dev=\$(losetup --direct-io=on -f --show "$OUT/var-tmp.img") && mount "\$dev" /var/tmp; then
    echo "/var/tmp: ext4 on a loop device (\$dev, direct io: \$(cat /sys/block/\${dev#/dev/}/loop/dio))"
else
    echo "/var/tmp: no loop device; stays tmpfs"
fi
export TIDAL_REQUIRE_CGROUP2=1 PYTHONUNBUFFERED=1
# -v: a line per test as it ends, what a second boot leaves out should the kernel panic (below); @file: its
# --deselect arguments, one per line (pytest reads them from the file)
${TIDAL_VM_COMMAND:-.venv/bin/python -m pytest -p no:cacheprovider -m privileged -v -ra $TESTS ${PYTEST_ARGS:-} \$( [ -s "$OUT/ended" ] && echo "@$OUT/ended")}
EOF
# the project's modules and its tests' rewritten assertions compiled here, on the host's own cpus, before the
# VM boots: the checkout is read-only in the VM, and with no .pyc (CI's environment sets
# PYTHONDONTWRITEBYTECODE) every agent a test starts compiled its modules again under emulation
if [ -z "${TIDAL_VM_COMMAND:-}" ]; then
    say "compiling the project's modules and collecting $TESTS (bytecode for the VM)"
    PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q -j 0 agent cluster contracts common kube > /dev/null
    PYTHONDONTWRITEBYTECODE= .venv/bin/python -m pytest -p no:cacheprovider --collect-only -q -m privileged $TESTS \
        > /dev/null || true  # a collection error is the VM's run's to report
fi
say "booting $version ($ACCEL) with 2 vCPUs and 1 GiB; running ${TIDAL_VM_COMMAND:-$TESTS}"
start=$(date +%s)
ended='^(tests/[^ ]+::.*) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)'
oops() {  # the kernel's report of what went wrong: its first lines (what, where, the call trace)
    grep -n -m1 -E "BUG:|Oops:|general protection|kernel BUG|Kernel panic" "$OUT/console" | cut -d: -f1 |
        { read -r n && sed -n "$n,$((n + 45))p" "$OUT/console"; } >&2 || true
}
first_failed=0
if ! boot "$accel_flag" 3000 tier.sh && [ -z "${TIDAL_VM_COMMAND:-}" ] && grep -q "Kernel panic" "$OUT/console"; then
    # the guest kernel panicked under emulation: TCG runs each emulated cpu on its own host thread, and a
    # static key flipped at run time (code patched by one cpu while another runs it) has oopsed here and in
    # the systemd tier. Not Tidal's fault, nor the tier's result: the tests that had not ended run in a
    # second boot, and those that had keep their results (a failure among them still fails the tier)
    say "the kernel panicked under emulation after $(( $(date +%s) - start )) s; what the tier printed, then the kernel's report:"
    cat "$OUT/log" >&2 2>/dev/null || true; echo >&2
    oops
    grep -E "$ended" "$OUT/log" 2>/dev/null | sed -E "s#$ended.*#--deselect\n\1#" > "$OUT/ended" || true
    grep -qE "$ended" "$OUT/log" 2>/dev/null && grep -E "$ended" "$OUT/log" | grep -qE " (FAILED|ERROR)( |$)" &&
        first_failed=1
    # a panic before the tier printed anything leaves no log (CI, 2026-11-29: 13 s into the boot); the mv of
    # a missing file stopped the script here instead of booting again
    for name in log console; do
        if [ -e "$OUT/$name" ]; then mv "$OUT/$name" "$OUT/$name.panic"; else : > "$OUT/$name.panic"; fi
    done
    say "booting again: the $(grep -cE "$ended" "$OUT/log.panic" || true) tests that had ended are deselected"
    start=$(date +%s)
    boot "$accel_flag" 3000 tier.sh || true
fi
if ! [ -s "$OUT/rc" ]; then
    # what the tier printed before the VM went away says where it was; the console, why it went
    say "the VM did not finish (after $(( $(date +%s) - start )) s); the tier's output:"
    tail -60 "$OUT/log" >&2 2>/dev/null && echo >&2 || say "(no output from the tier)"
    say "its console (the kernel's report first, where it made one):"
    oops
    tail -40 "$OUT/console" >&2
    exit 1
fi
cat "$OUT/log"
rc="$(cat "$OUT/rc")"
say "exit $rc after $(( $(date +%s) - start )) s"
if [ "$first_failed" = 1 ]; then
    say "tests failed in the boot that panicked (above): the tier fails"
    exit 1
fi
if [ -z "${TIDAL_VM_COMMAND:-}" ] && [ "$rc" = 0 ] && grep -q "^SKIPPED" "$OUT/log" ${OUT}/log.panic 2>/dev/null; then
    say "tests were skipped on cgroup v2: every privileged test must run here"
    exit 1
fi
exit "$rc"
