"""The PM QoS hold the network benchmark keeps for its whole run (``agent/bench/wakeup.py``)."""

import os
import struct

import pytest

from agent.bench.wakeup import WakeupLatencyHold


def test_the_request_is_written_once_and_held_until_the_block_ends(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    with WakeupLatencyHold(0, device=str(device)) as hold:
        assert hold.held and hold.describe() == {"held": True, "max_us": 0}
        fd = hold.fd
        os.fstat(fd)  # still open: the kernel keeps the request only while it is
    assert struct.unpack("=i", device.read_bytes()) == (0,)
    assert not hold.held
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_host_without_the_device_says_why_and_the_benchmark_goes_on(tmp_path):
    with WakeupLatencyHold(0, device=str(tmp_path / "missing")) as hold:
        assert not hold.held
    assert hold.describe()["held"] is False
    assert "No such file" in hold.describe()["reason"]


def test_a_negative_latency_is_refused():
    with pytest.raises(ValueError, match="must be 0 or more"):
        WakeupLatencyHold(-1)
