#!/bin/sh
# make test-systemd: Tidal as a systemd host runs it. A Debian root filesystem with systemd as PID 1
# (mmdebstrap, cached outside the repository) boots under qemu on the v2 tier's kernel
# (scripts/vm-kernel.sh) with pure cgroup v2; Tidal is installed there as the README says (make install
# from a copy of this checkout, its dependencies' wheels from a wheelhouse fetched on the host) and the
# tests in tests/systemd drive the shipped unit with systemctl (pytest -m systemd, inside the VM).
#
# The checkout and the wheelhouse reach the VM read-only over 9p; the tier's output comes back through
# one writable directory. Every boot starts from the cached image unchanged (qemu -snapshot).
#
#   TIDAL_VM_ACCEL=tcg|kvm|auto   as make test-cgroup2 (auto: what its KVM probe remembered, else tcg)
#   PYTEST_ARGS="-k ..."          passed to pytest inside the VM
#   TIDAL_VM_KEEP=1               keep the output directory (console, journal) and say where it is
#   TIDAL_VM_KUBE=1               make test-systemd-kubelet: no make install; a kubelet (K8S_VERSION, 1.35.4 by
#                                 default) with the systemd cgroup driver and containerd 2.x with NRI run as
#                                 systemd units in the VM against a control plane on this host
#                                 (tests/systemd/kubeplane.py, over qemu's user network), and
#                                 tests/systemd/test_kubelet.py installs Tidal's chart there (pytest -m kubelet)
set -eu
cd "$(dirname "$0")/.."
REPO="$(pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tidal"
# the image's recipe: a change to it (this file, the package list, the dependencies) builds a new one
ROOTFS_REV=3
say() { echo "test-systemd: $*" >&2; }

[ "$(id -u)" = 0 ] || { say "needs root (mmdebstrap, the image's chroot)"; exit 2; }
[ -x .venv/bin/python ] || { say "no .venv: run 'make test' or 'make deps .venv/.installed' first"; exit 2; }
sh scripts/install-debian-packages.sh scripts/vm-debian-packages.txt

tree="$(sh scripts/vm-kernel.sh)"
version="$(basename "$tree")"
packages="$(grep -v '^[[:space:]]*#' scripts/systemd-vm-packages.txt | grep -v '^[[:space:]]*$' | paste -sd, -)"
key="$( (echo "$ROOTFS_REV $version $packages"; sed -n '/^dependencies = \[/,/^\]/p' pyproject.toml;
         sed -n '/^\[build-system\]/,/^$/p' pyproject.toml) | sha256sum | cut -c1-16)"
VMDIR="$CACHE/systemd-vm/$key"
WHEELS="$VMDIR/wheels"

# the wheels make install and the tests take, for the image's Python (Debian bookworm's 3.11,
# manylinux x86_64), fetched here on the host (its pip configuration applies); nothing in the VM
# reaches a network
if ! [ -f "$WHEELS/done" ]; then
    say "wheelhouse: Tidal's dependencies, setuptools, pytest (CPython 3.11, manylinux x86_64)"
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    deps="$(.venv/bin/python - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as handle:
    project = tomllib.load(handle)
print("\n".join(project["project"]["dependencies"]))
PY
)"
    echo "$deps" > "$WHEELS/requirements.txt"  # Tidal's own; the build's and the tests' beside them
    printf '%s\n' "$deps" "$(sed -n 's/^requires = \[\(.*\)\]$/\1/p' pyproject.toml | tr -d '"' | tr ',' '\n')" \
        "pytest>=7.0" > "$WHEELS/all.txt"
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --dest "$WHEELS" --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -r "$WHEELS/all.txt"
    touch "$WHEELS/done"
fi

# the image: Debian bookworm with systemd, the kernel's modules and an initramfs made in it, Tidal's
# dependencies already in /opt/tidal/venv (as on a host that had an earlier release: make install in the
# VM then builds and installs Tidal alone, 157 s -> ~40 s under TCG), pytest in a venv of its own
# (/opt/tidal-test: the tests' tool, not Tidal's), a unit that runs the tier once booted
IMAGE="$VMDIR/rootfs.img"
if ! [ -f "$VMDIR/done" ]; then
    say "image: Debian bookworm with systemd and $version ($packages)"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    cat > "$work/tidal-tier.service" <<'UNIT'
[Unit]
Description=Tidal's systemd tier (tests/systemd), run once the system is up
After=multi-user.target systemd-udev-settle.service
[Service]
Type=oneshot
StandardOutput=journal+console
ExecStart=/usr/local/sbin/tidal-tier
[Install]
WantedBy=multi-user.target
UNIT
    cat > "$work/tidal-tier" <<'TIER'
#!/bin/sh
# mounts the host's output directory and runs what the host wrote there; the machine powers off after
mkdir -p /mnt/out
# the virtio transport binds its devices as udev's coldplug reaches them: wait for them, then mount
modprobe 9pnet_virtio; udevadm settle --timeout=60
for try in $(seq 30); do
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out /mnt/out 2>/dev/null && break
    sleep 1
done
mountpoint -q /mnt/out || { echo "tidal-tier: cannot mount the host's output directory"; systemctl poweroff; exit 1; }
sh /mnt/out/tier.sh > /mnt/out/log 2>&1
echo $? > /mnt/out/rc
journalctl -b --no-pager -o short-monotonic > /mnt/out/journal 2>&1
sync
systemctl poweroff --no-block
TIER
    mmdebstrap --quiet --variant=minbase --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook="mkdir -p \"\$1/lib/modules\" && cp -a $tree/lib/modules/$version \"\$1/lib/modules/\"" \
        --customize-hook="cp $tree/boot/config-$version \"\$1/boot/\"" \
        --customize-hook="chroot \"\$1\" depmod $version" \
        --customize-hook="chroot \"\$1\" mkinitramfs -o /boot/initrd.img-$version $version" \
        --customize-hook="copy-in $work/tidal-tier.service /etc/systemd/system" \
        --customize-hook="copy-in $work/tidal-tier /usr/local/sbin" \
        --customize-hook='chmod 0755 "$1/usr/local/sbin/tidal-tier"' \
        --customize-hook='chroot "$1" systemctl enable tidal-tier.service' \
        --customize-hook='echo "/dev/vda / ext4 rw,relatime 0 0" > "$1/etc/fstab"' \
        --customize-hook='echo tidal-vm > "$1/etc/hostname"' \
        --customize-hook="copy-in $WHEELS /mnt" \
        --customize-hook='chroot "$1" python3 -m venv /opt/tidal/venv' \
        --customize-hook='chroot "$1" /opt/tidal/venv/bin/pip install --quiet --disable-pip-version-check --no-index --find-links /mnt/wheels -r /mnt/wheels/requirements.txt' \
        --customize-hook='chroot "$1" python3 -m venv /opt/tidal-test' \
        --customize-hook='chroot "$1" /opt/tidal-test/bin/pip install --quiet --disable-pip-version-check --no-index --find-links /mnt/wheels pytest' \
        --customize-hook='rm -rf "$1/mnt/wheels" "$1/var/lib/apt/lists"/* "$1/var/cache/apt"/*' \
        bookworm "$work/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    cp "$work/rootfs/boot/initrd.img-$version" "$VMDIR/initrd.img"
    # a file system image of the tree (no loop mount); room for the install and the tier's writes
    rm -f "$IMAGE.tmp"
    truncate -s 4G "$IMAGE.tmp"
    mkfs.ext4 -q -F -d "$work/rootfs" "$IMAGE.tmp"
    mv "$IMAGE.tmp" "$IMAGE"
    rm -rf "$work"
    trap - EXIT
    touch "$VMDIR/done"
    # older recipes' images go
    for old in "$CACHE"/systemd-vm/*; do [ "$old" = "$VMDIR" ] || rm -rf "$old"; done
fi

KUBE="${TIDAL_VM_KUBE:-0}"
if [ "$KUBE" = 1 ]; then
    # the node's parts, built and cached as the node tier's are: the kubelet and the plane at one version
    K8S_VERSION="${K8S_VERSION:-1.35.4}"
    KBIN="$CACHE/k8s-testbin/v$K8S_VERSION"
    K8S_VERSION="$K8S_VERSION" TIDAL_K8S_TESTBIN="$KBIN" sh scripts/k8s-testbin.sh >&2
    sh scripts/node-testbin.sh >&2
    NBIN="$CACHE/node-testbin/containerd-v${CONTAINERD_VERSION:-2.2.9}"
    HELM="$(sh scripts/helm.sh)"
    sh scripts/image.sh >&2  # from this checkout, as make image in CI
fi

OUT="$(mktemp -d /tmp/tidal-systemd-vm.XXXXXX)"
PLANE=""
cleanup() {
    if [ -n "$PLANE" ]; then kill "$PLANE" 2>/dev/null; wait "$PLANE" 2>/dev/null || true; fi
    [ "${TIDAL_VM_KEEP:-0}" = 1 ] || rm -rf "$OUT"
}
trap cleanup EXIT
if [ "${TIDAL_VM_KEEP:-0}" = 1 ]; then say "output in $OUT"; fi
# the files make install copies: what git tracks and what it does not ignore (the checkout as a user has it)
git ls-files -co --exclude-standard > "$OUT/files"
cat > "$OUT/tier.sh" <<EOF
set -u
mkdir -p "$REPO" /mnt/wheels
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro repo "$REPO"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro wheels /mnt/wheels
echo "kernel: \$(uname -r); pid 1: \$(cat /proc/1/comm) \$(systemctl --version | head -1); /sys/fs/cgroup: \$(stat -f -c %T /sys/fs/cgroup); cpus: \$(nproc)"
if awk '\$3 == "cgroup" { found = 1 } END { exit !found }' /proc/self/mounts; then echo "a cgroup v1 hierarchy is mounted: not a pure v2 host"; exit 3; fi
export PYTHONDONTWRITEBYTECODE=1
if [ "$KUBE" = 1 ]; then
    # the node's network: qemu's user network, its host (this machine's loopback) at 10.0.2.1
    dev="\$(ls /sys/class/net | grep -v '^lo\$' | head -1)"
    ip link set lo up; ip link set "\$dev" up
    ip addr add 10.0.2.15/24 dev "\$dev"; ip route add default via 10.0.2.1
    mkdir -p /mnt/kbin /mnt/nbin /mnt/helm
    for tag in kbin nbin helm; do mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro \$tag /mnt/\$tag; done
    cd "$REPO"
    systemctl set-property --runtime tidal-tier.service AllowedCPUs=0 CPUQuota=200%
    TIDAL_KUBELET_HOLD=${TIDAL_KUBELET_HOLD:-180} TIDAL_KUBECONFIG=/mnt/out/kubeconfig /opt/tidal-test/bin/python -m pytest -p no:cacheprovider --confcutdir=tests/systemd -m kubelet -rsP -s tests/systemd/test_kubelet.py ${PYTEST_ARGS:-}
    exit \$?
fi
# Tidal as the README installs it: make install from the checkout (a copy: the build writes in it),
# the dependencies from the wheelhouse (PIP_NO_INDEX: nothing reaches a network)
mkdir -p /root/tidal
tar -C "$REPO" -cf - -T /mnt/out/files | tar -C /root/tidal -xf -
start=\$(date +%s)
if ! (cd /root/tidal && PIP_NO_INDEX=1 PIP_FIND_LINKS=/mnt/wheels make install > /mnt/out/install.log 2>&1); then
    cat /mnt/out/install.log; echo "make install failed"; exit 4
fi
echo "make install: \$(( \$(date +%s) - start )) s; \$(tail -1 /mnt/out/install.log)"
cd "$REPO"
# the harness is the node's system work: it runs on the reserved cpu (0, Tidal's default), off the shared
# pool whose idle the agent measures (under emulation its polling would leave no reclaimed capacity)
# CPUQuota: two cpus' worth on one cpu, bounding nothing. Under emulation (TCG) a kernel that flips a static key
# patches its code while other vCPUs run it, and one may still execute the patch's int3 once it is gone (oopses
# in enqueue_entity and set_next_task_fair here): the node's first cpu quota turns the cfs bandwidth key on,
# its last one off, and the tests set and remove quotas under load (the agent's reclaimed tree, each of bench
# cpu-isolation's scenarios). Held from here, before any test, that key never flips again; real cpus need none of it.
systemctl set-property --runtime tidal-tier.service AllowedCPUs=0 CPUQuota=200%
/opt/tidal-test/bin/python -m pytest -p no:cacheprovider --confcutdir=tests/systemd -m systemd -rsP tests/systemd ${PYTEST_ARGS:-}
EOF

vm_memory=2G nic="-nic none" shares=""
if [ "$KUBE" = 1 ]; then
    # the control plane on this host; the VM's kubelet, containerd, Tidal's pod and the tier's pods in 4 GiB
    .venv/bin/python -m tests.systemd.kubeplane "$KBIN" "$OUT" > "$OUT/kubeplane.log" 2>&1 &
    PLANE=$!
    for _ in $(seq 240); do [ -f "$OUT/kubeconfig" ] || ! kill -0 "$PLANE" 2>/dev/null && break; sleep 0.5; done
    [ -f "$OUT/kubeconfig" ] || { say "the control plane did not start:"; cat "$OUT/kubeplane.log" >&2; exit 1; }
    vm_memory=4G
    nic="-nic user,model=virtio-net-pci,net=10.0.2.0/24,host=10.0.2.1"
    shares="-virtfs local,path=$KBIN,mount_tag=kbin,security_model=none,readonly=on
            -virtfs local,path=$NBIN,mount_tag=nbin,security_model=none,readonly=on
            -virtfs local,path=$(dirname "$HELM"),mount_tag=helm,security_model=none,readonly=on"
fi

ACCEL="${TIDAL_VM_ACCEL:-auto}"
if [ "$ACCEL" = auto ]; then ACCEL="$(cat "$CACHE/vm-accel" 2>/dev/null || echo tcg)"; fi
case "$ACCEL" in kvm) accel="-accel kvm -cpu host";; tcg) accel="-accel tcg";; *) say "TIDAL_VM_ACCEL: tcg, kvm or auto"; exit 2;; esac
say "booting $version ($ACCEL) with systemd as PID 1, 6 vCPUs (3 cores of 2 SMT threads) and $vm_memory of memory"
start=$(date +%s)
# tsc=reliable: emulated vCPUs all busy (the foreign-load bench) leave the clocksource watchdog's reads
# hundreds of ms apart; it then calls the TSC skewed (666 us over 480 ms) and marks it unstable, which flips
# the sched_clock_stable static key at run time, a code patch another vCPU may run mid-way (an int3 oops in
# sched_clock_cpu here, the same hazard as the cpu quota's key below). QEMU's TSC is the host's clock for
# every vCPU: no watchdog is needed on it.
boot() {
    # shellcheck disable=SC2086
    # SMT, as the nodes users run: what reclaimed work may not share with a dedicated cpu is a sibling thread
    timeout 2400 qemu-system-x86_64 $accel -smp 6,sockets=1,cores=3,threads=2 -m $vm_memory -nographic -vga none -no-reboot -snapshot \
        -kernel "$tree/boot/vmlinuz-$version" -initrd "$VMDIR/initrd.img" \
        -append "root=/dev/vda rw console=ttyS0 panic=-1 systemd.unified_cgroup_hierarchy=1 cgroup_no_v1=all tsc=reliable" \
        -drive "file=$IMAGE,if=virtio,format=raw" \
        -virtfs "local,path=$REPO,mount_tag=repo,security_model=none,readonly=on" \
        -virtfs "local,path=$WHEELS,mount_tag=wheels,security_model=none,readonly=on" \
        -virtfs "local,path=$OUT,mount_tag=out,security_model=none" $shares \
        $nic > "$OUT/console" 2>&1 || true
}
boot
# emulation has oopsed in the kernel's first seconds (an int3 in a timer softirq, once in the first six boots here:
# code patched by one emulated cpu while another runs it); the tier had not started: boot once more
if ! [ -e "$OUT/log" ] && grep -q "Kernel panic" "$OUT/console"; then
    say "the kernel panicked while booting under emulation ($(grep -m1 -o 'Oops: [^[]*' "$OUT/console" || echo panic)); booting again"
    mv "$OUT/console" "$OUT/console.panic"
    boot
fi
if ! [ -s "$OUT/rc" ]; then
    say "the VM did not finish the tier; its console:"
    tail -60 "$OUT/console" >&2
    exit 1
fi
cat "$OUT/log"
rc="$(cat "$OUT/rc")"
if [ "$rc" != 0 ] && [ -f "$OUT/journal" ]; then
    if [ "$KUBE" = 1 ]; then
        say "the tier failed; the VM's journal for containerd and the kubelet:"
        grep -E "(containerd|kubelet)(\.service|\[)" "$OUT/journal" | tail -60 >&2
    else
        say "the tier failed; the VM's journal for tidal.service:"
        grep -E "tidal(\.service|\[)" "$OUT/journal" | tail -60 >&2
    fi
fi
say "exit $rc after $(( $(date +%s) - start )) s"
if [ "$rc" = 0 ] && grep -q "^SKIPPED" "$OUT/log"; then
    say "tests were skipped under systemd: every test of the tier must run here"
    exit 1
fi
exit "$rc"
