#!/bin/sh
# What a test or benchmark run that was killed (SIGKILL, a lost session) could not remove:
# network namespaces named tdl<6 hex>[hpw] (agent/bench/netlab.py) and cgroup trees named
# tidal-test-* / tidal-bench-* at the top of each hierarchy, the memory tier's working-set files
# /var/tmp/tidal-test-working-set-*.bin (tests/privileged/test_memory_real.py), the hwloc trees the
# unit tier and `tidal bench qrm --shapes` unpack (tidal-hwloc-*, tidal-shapes-*, ~120 MB each: left
# over many runs they fill /dev/shm), the benches' state directories (tidal-bench-*, tidal-overhead-*)
# and a control plane's directory (tidal-k8s-*); from the node tier
# (tests/node): its kubelet, containerd and their shims and containers (every process whose command
# line names a tidal-k8s-* directory in /tmp or /dev/shm: make test's TMPDIR), the mounts under those
# directories and the directories,
# its veth link tnd<8 hex>, and, when no kubelet runs, the kubepods cgroups and the host directories
# the tier marked (.tidal-node-tier). Only empty cgroups are removed (rmdir refuses others); run it
# when no test is running.
set -u
[ "$(id -u)" = 0 ] || { echo "clean-test-leftovers: needs root" >&2; exit 2; }
removed=0
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^tdl[0-9a-f]{6}[hpw]$'); do
    ip netns del "$ns" && removed=$((removed + 1)) && echo "netns $ns"
done
TEMPS="/tmp /dev/shm"
for pid in $(pgrep -f '(/tmp|/dev/shm)/tidal-k8s-' 2>/dev/null); do
    [ "$pid" = "$$" ] && continue
    kill -9 "$pid" 2>/dev/null && removed=$((removed + 1)) && echo "process $pid"
done
# the node tier's containers: their shims were killed above; what they ran is in the kubepods cgroups
for procs in $(find /sys/fs/cgroup/cpuset/kubepods /sys/fs/cgroup/kubepods -name cgroup.procs 2>/dev/null); do
    pgrep -x kubelet >/dev/null 2>&1 && break
    for pid in $(cat "$procs" 2>/dev/null); do kill -9 "$pid" 2>/dev/null && echo "process $pid (a pod's)"; done
done
sleep 1
for point in $(awk '{print $5}' /proc/self/mountinfo | grep -E '^(/tmp|/dev/shm)/tidal-k8s-' | sort -r); do
    umount -l "$point" 2>/dev/null && removed=$((removed + 1)) && echo "mount $point"
done
for dir in $(for t in $TEMPS; do echo "$t"/tidal-k8s-* "$t"/tidal-hwloc-* "$t"/tidal-shapes-* "$t"/tidal-bench-* "$t"/tidal-overhead-*; done); do
    [ -d "$dir" ] || continue
    grep -q " $dir[/ ]" /proc/self/mountinfo && { echo "directory $dir: still mounted, left alone" >&2; continue; }
    rm -rf "$dir" && removed=$((removed + 1)) && echo "directory $dir"
done
# the host directories the node tier used (the DaemonSet's hostPaths, the kubelet's root), marked by it
if ! pgrep -x kubelet >/dev/null 2>&1; then
    for dir in /var/lib/kubelet /var/lib/tidal /run/tidal /run/nri; do
        [ -f "$dir/.tidal-node-tier" ] || continue
        for point in $(awk '{print $5}' /proc/self/mountinfo | grep "^$dir\(/\|\$\)" | sort -r); do
            umount -l "$point" 2>/dev/null
        done
        rm -rf "$dir" && removed=$((removed + 1)) && echo "directory $dir"
    done
fi
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^tnd[0-9a-f]{8}$'); do
    ip link del "$link" 2>/dev/null && removed=$((removed + 1)) && echo "link $link"
done
remove_cgroup_tree() {  # TREE: rmdir deepest first; a cgroup with tasks refuses and is left alone
    [ -d "$1" ] || return 0
    if find "$1" -depth -type d -exec rmdir {} \; 2>/dev/null && [ ! -d "$1" ]; then
        removed=$((removed + 1)) && echo "cgroup $1"
    else
        echo "cgroup $1: still has tasks, left alone" >&2
    fi
}
if ! pgrep -x kubelet >/dev/null 2>&1; then
    for tree in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
        remove_cgroup_tree "$tree"
    done
fi
for top in /sys/fs/cgroup /sys/fs/cgroup/*; do
    [ -d "$top" ] || continue
    for tree in "$top"/tidal-test-* "$top"/tidal-bench-*; do
        remove_cgroup_tree "$tree"
    done
done
for file in /var/tmp/tidal-test-working-set-*.bin; do
    [ -f "$file" ] || continue
    rm -f "$file" && removed=$((removed + 1)) && echo "file $file"
done
echo "clean-test-leftovers: removed $removed"
