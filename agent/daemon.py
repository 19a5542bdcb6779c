"""The node agent (``tidal agent``).

Today the agent discovers the node, prints what it found and where its socket
and state will live, and then waits for SIGTERM/SIGINT; the QoS manager,
isolation and the local API plug into ``Agent.run`` as they land.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from agent.topology import HostFS, Topology, discover

log = logging.getLogger("tidal.agent")

DEFAULT_SOCKET = "/run/tidal/tidal.sock"
DEFAULT_STATE_DIR = "/var/lib/tidal"


@dataclass(frozen=True)
class AgentConfig:
    root: str = "/"
    socket_path: str = DEFAULT_SOCKET
    state_dir: str = DEFAULT_STATE_DIR


class Agent:
    def __init__(self, config: AgentConfig, echo: Callable[[str], None] = print) -> None:
        self.config = config
        self.echo = echo
        self.topology: Optional[Topology] = None
        self._stop = threading.Event()

    def start(self) -> Topology:
        self.topology = discover(HostFS(self.config.root))
        topo = self.topology
        self.echo(
            f"tidal agent: {len(topo.socket_ids())} sockets, {len(topo.numa_nodes)} NUMA nodes, "
            f"{len(topo.core_ids())} cores, {len(topo.online_cpus())} cpus, "
            f"{len(topo.gpus)} GPUs, {len(topo.nics)} NICs")
        for warning in topo.warnings:
            self.echo(f"tidal agent: warning: {warning}")
        self.echo(f"tidal agent: socket {self.config.socket_path} (not served yet), "
                  f"state {self.config.state_dir}; pid {os.getpid()}; stop with SIGTERM or Ctrl-C")
        return topo

    def stop(self, *_args) -> None:
        self._stop.set()

    def run(self) -> int:
        self.start()
        previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not self._stop.wait(1.0):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.echo("tidal agent: stopped")
        return 0
