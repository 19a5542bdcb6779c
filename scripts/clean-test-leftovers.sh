#!/bin/sh
# What a test or benchmark run that was killed (SIGKILL, a lost session) could not remove:
# network namespaces named tdl<6 hex>[hpw] (agent/bench/netlab.py) and cgroup trees named
# tidal-test-* / tidal-bench-* at the top of each hierarchy, the memory tier's working-set files
# /var/tmp/tidal-test-working-set-*.bin (tests/privileged/test_memory_real.py). Only empty
# cgroups are removed (rmdir refuses others); run it when no test is running.
set -u
[ "$(id -u)" = 0 ] || { echo "clean-test-leftovers: needs root" >&2; exit 2; }
removed=0
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^tdl[0-9a-f]{6}[hpw]$'); do
    ip netns del "$ns" && removed=$((removed + 1)) && echo "netns $ns"
done
for top in /sys/fs/cgroup /sys/fs/cgroup/*; do
    [ -d "$top" ] || continue
    for tree in "$top"/tidal-test-* "$top"/tidal-bench-*; do
        [ -d "$tree" ] || continue
        if find "$tree" -depth -type d -exec rmdir {} \; 2>/dev/null && [ ! -d "$tree" ]; then
            removed=$((removed + 1)) && echo "cgroup $tree"
        else
            echo "cgroup $tree: still has tasks, left alone" >&2
        fi
    done
done
for file in /var/tmp/tidal-test-working-set-*.bin; do
    [ -f "$file" ] || continue
    rm -f "$file" && removed=$((removed + 1)) && echo "file $file"
done
echo "clean-test-leftovers: removed $removed"
