"""Node discovery: ``discover(HostFS(root)) -> Topology`` (read-only)."""

from agent.topology.discover import discover
from agent.topology.hostfs import HostFS
from agent.topology.model import Cpu, Gpu, Nic, NumaNode, Topology

__all__ = ["discover", "HostFS", "Topology", "Cpu", "NumaNode", "Gpu", "Nic"]
