"""Network namespaces made for a test or a benchmark, and removed after it.

``NetLab(dual=True)``::

    host ns                      peer ns
    a0 198.18.1.1/24  <--veth-->  a1 198.18.1.2/24      (the online NIC)
    b0 198.18.2.1/24  <--veth-->  b1 198.18.2.2/24      (the offline NIC)
                                  lo 198.19.0.1/32      (the service address)
    host: 198.19.0.0/24 via 198.18.1.2 (main table: online NIC)

``NetLab(wire_rate=200_000_000)`` puts a third namespace between host and
peer on the online path, forwarding, with a TBF at ``wire_rate`` on its way
to the peer: the link of known rate (and its switch buffer) that a host's own
shaping has to keep empty. Addresses are from 198.18.0.0/15 only; names are
``tdl<random>[hpw]`` so parallel runs never meet.

``far_cpus`` stand for the other machines' hardware: packets arriving at the
wire and at the peer are processed there (RPS). A veth otherwise runs the whole
far side (forwarding, the link's queue, the peer's TCP) on the cpu that
transmitted, in its time: with a shared qdisc that is whichever cpu ran it
last, often the online one, where a NIC would have cost a hand-off only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Dict, List, Optional, Set

SERVICE = "198.19.0.1"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")


class NetLab:
    def __init__(self, dual: bool = True, wire_rate: Optional[int] = None, wire_buffer: int = 256 * 1024,
                 single_segment: bool = False, far_cpus: Optional[Set[int]] = None) -> None:
        tag = uuid.uuid4().hex[:6]
        self.host, self.peer, self.wire = f"tdl{tag}h", f"tdl{tag}p", f"tdl{tag}w"
        self.dual = dual
        self.wire_rate = wire_rate
        self.wire_buffer = wire_buffer
        self.single_segment = single_segment
        self.far_cpus = far_cpus
        self.made: List[str] = []
        self.procs: List[subprocess.Popen] = []

    def __enter__(self) -> "NetLab":
        try:
            self.create()
        except Exception:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        names = [self.host, self.peer] + ([self.wire] if self.wire_rate else [])
        for ns in names:
            _ip("netns", "add", ns)
            self.made.append(ns)
            # IPv4 only: no link-local addresses appearing (after DAD) between two listings
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                            "net.ipv6.conf.default.disable_ipv6=1"], check=True)
            _ip("-n", ns, "link", "set", "lo", "up")
        h, p, w = self.host, self.peer, self.wire
        if self.wire_rate:
            _ip("link", "add", "a0", "netns", h, "type", "veth", "peer", "name", "w0", "netns", w)
            _ip("link", "add", "w1", "netns", w, "type", "veth", "peer", "name", "a1", "netns", p)
            _ip("-n", h, "addr", "add", "198.18.1.1/24", "dev", "a0")
            _ip("-n", w, "addr", "add", "198.18.1.2/24", "dev", "w0")
            _ip("-n", w, "addr", "add", "198.18.3.1/24", "dev", "w1")
            _ip("-n", p, "addr", "add", "198.18.3.2/24", "dev", "a1")
            for dev in ("w0", "w1"):
                _ip("-n", w, "link", "set", dev, "up")
            subprocess.run(["ip", "netns", "exec", w, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True)
            _ip("-n", p, "link", "set", "a1", "up")
            _ip("-n", w, "route", "add", "198.19.0.0/24", "via", "198.18.3.2")
            _ip("-n", p, "route", "add", "198.18.0.0/16", "via", "198.18.3.1")
            _tc(w, "qdisc", "add", "dev", "w1", "root", "tbf", "rate", f"{self.wire_rate}bit",
                "burst", "4kb", "limit", str(self.wire_buffer))
        else:
            _ip("link", "add", "a0", "netns", h, "type", "veth", "peer", "name", "a1", "netns", p)
            _ip("-n", h, "addr", "add", "198.18.1.1/24", "dev", "a0")
            _ip("-n", p, "addr", "add", "198.18.1.2/24", "dev", "a1")
        if self.dual:
            _ip("link", "add", "b0", "netns", h, "type", "veth", "peer", "name", "b1", "netns", p)
            _ip("-n", h, "addr", "add", "198.18.2.1/24", "dev", "b0")
            _ip("-n", p, "addr", "add", "198.18.2.2/24", "dev", "b1")
            _ip("-n", h, "link", "set", "b0", "up")
            _ip("-n", p, "link", "set", "b1", "up")
        _ip("-n", p, "addr", "add", f"{SERVICE}/32", "dev", "lo")
        _ip("-n", h, "link", "set", "a0", "up")
        _ip("-n", p, "link", "set", "a1", "up")
        _ip("-n", h, "route", "add", "198.19.0.0/24", "via", "198.18.1.2")
        if self.far_cpus:
            mask = f"{sum(1 << cpu for cpu in self.far_cpus):x}"
            for ns, dev in ((self.wire, "w0"), (self.peer, "a1")) if self.wire_rate else ((self.peer, "a1"),):
                subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",
                                f"echo {mask} > /sys/class/net/{dev}/queues/rx-0/rps_cpus"], check=True)
        if self.single_segment:
            # one MSS per packet: at test rates a 64 KiB GSO burst alone is milliseconds of queue
            for ns, dev in ((h, "a0"), (p, "a1")) + (((h, "b0"),) if self.dual else ()):
                _ip("-n", ns, "link", "set", dev, "gso_max_segs", "1")

    def link(self, ns: str, dev: str, up: bool) -> None:
        _ip("-n", ns, "link", "set", dev, "up" if up else "down")

    def spawn(self, ns: str, args: List[str], stdin: bool = False, cgroup_procs: Optional[str] = None,
              cpus: Optional[Set[int]] = None, sched_idle: bool = False) -> subprocess.Popen:
        """``python -m agent.bench.traffic ARGS`` inside ``ns`` (optionally in a cgroup2 cgroup
        first, optionally on ``cpus``, optionally under ``SCHED_IDLE``: it runs only when nothing
        else on its cpus wants to, as tasks of a ``cpu.idle`` cgroup do)."""
        argv = ["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-m", "agent.bench.traffic", *args]
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

        def into_cgroup() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)
            if sched_idle:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            if cgroup_procs:
                with open(cgroup_procs, "w") as handle:
                    handle.write(str(os.getpid()))

        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=into_cgroup if cgroup_procs or cpus or sched_idle else None)
        self.procs.append(proc)
        return proc

    def server(self, ns: str, args: List[str], cpus: Optional[Set[int]] = None) -> subprocess.Popen:
        proc = self.spawn(ns, args, cpus=cpus)
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"traffic {' '.join(args)} did not start: {proc.stderr.read()[:300]}")
        return proc

    def listing(self, ns: Optional[str] = None) -> Dict[str, str]:
        """What a revert must leave as it found: qdiscs, classes, filters, links, rules, routes, nft."""
        ns = ns or self.host

        def run(*argv: str) -> str:
            return subprocess.run(["nsenter", f"--net=/run/netns/{ns}", *argv], capture_output=True,
                                  text=True).stdout

        out = {"qdiscs": run("tc", "qdisc", "show"), "links": run("ip", "-o", "link", "show"),
               "rules": run("ip", "rule", "show"), "routes": run("ip", "route", "show", "table", "all"),
               "nft": run("nft", "list", "ruleset")}
        for dev in ("a0", "b0"):
            out[f"classes {dev}"] = run("tc", "class", "show", "dev", dev)
            out[f"filters {dev}"] = run("tc", "filter", "show", "dev", dev) + run("tc", "filter", "show", "dev",
                                                                                   dev, "ingress")
        # link lines carry counters and (for veths) the peer's ifindex, which do not change; strip nothing else
        return out

    def destroy(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream:
                    stream.close()
        self.procs.clear()
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()
