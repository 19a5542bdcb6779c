"""The checkpoint: atomic writes survive kills; bad files are recovered, never fatal."""

import json
import os
import random
import signal

import pytest

from agent.qrm.policy import State, allocate, initial_state
from agent.qrm.requests import parse_request
from agent.qrm.state import CheckpointStore, decode, encode, topology_fingerprint
from agent.topology.synthetic import Shape, build_topology

TOPO = build_topology(Shape(sockets=1, numa_per_socket=2, cores_per_numa=4))


def state_with(n_dedicated: int, marker: int) -> State:
    state = initial_state(TOPO, reclaim_cpus=marker)
    for i in range(n_dedicated):
        decision = allocate(TOPO, state, parse_request({"name": f"d{i}", "qos": "dedicated_cores", "cpus": 1}))
        state = state.with_allocation(decision)
    return state


def test_round_trip(tmp_path):
    store = CheckpointStore(str(tmp_path / "cp.json"))
    state = state_with(3, 5)
    store.save(state, TOPO)
    result = CheckpointStore(str(tmp_path / "cp.json")).load(TOPO)
    assert result.state == state and result.source == "checkpoint" and not result.warnings
    assert oct(os.stat(tmp_path / "cp.json").st_mode & 0o777) == "0o600"


def test_missing_checkpoint_starts_empty_without_warning(tmp_path):
    result = CheckpointStore(str(tmp_path / "none.json")).load(TOPO)
    assert result.source == "empty" and result.state.allocations == () and not result.warnings


@pytest.mark.parametrize("damage", [
    lambda raw: raw[: len(raw) // 2],
    lambda raw: b"",
    lambda raw: b"\x00" * 64,
    lambda raw: raw.replace(b'"reclaim_cpus":7', b'"reclaim_cpus":8'),
    lambda raw: raw.replace(b'"version":1', b'"version":99'),
    lambda raw: raw.replace(b'"policy":"tidal-qrm/v1"', b'"policy":"kubelet-static"'),
    lambda raw: b"[1, 2, 3]",
], ids=["truncated", "empty", "zeros", "bit-flip", "future-version", "other-policy", "wrong-shape"])
def test_corrupt_checkpoint_recovers_with_one_warning_and_keeps_a_copy(tmp_path, damage, caplog):
    path = tmp_path / "cp.json"
    store = CheckpointStore(str(path))
    store.save(state_with(2, 7), TOPO)
    raw = path.read_bytes()
    path.write_bytes(damage(raw))
    damaged = path.read_bytes()
    result = CheckpointStore(str(path)).load(TOPO)
    assert result.source == "empty" and result.state.allocations == ()
    assert len(result.warnings) == 1 and "kept as" in result.warnings[0]
    assert (tmp_path / "cp.json.bad-0").read_bytes() == damaged
    assert not path.exists()


def test_corrupt_checkpoint_uses_the_recover_hook(tmp_path):
    path = tmp_path / "cp.json"
    path.write_text("{garbage")
    rebuilt = state_with(1, 0)
    result = CheckpointStore(str(path)).load(TOPO, recover=lambda topo: rebuilt)
    assert result.state == rebuilt and result.source == "recovered" and "rebuilt from the kernel" in result.warnings[0]


def test_topology_change_keeps_what_still_fits(tmp_path):
    path = tmp_path / "cp.json"
    state = state_with(4, 0)
    CheckpointStore(str(path)).save(state, TOPO)
    lost_cpu = state.allocations[1].cpus[0]
    smaller = build_topology(Shape(sockets=1, numa_per_socket=2, cores_per_numa=4, offline=(lost_cpu,)))
    assert topology_fingerprint(smaller) != topology_fingerprint(TOPO)
    result = CheckpointStore(str(path)).load(smaller)
    assert result.source == "salvaged"
    assert [a.name for a in result.state.allocations] == ["d0", "d2", "d3"]
    assert "dropped d1" in result.warnings[0] and (tmp_path / "cp.json.bad-0").exists()


def test_every_kill_leaves_old_or_new_state(tmp_path):
    """Kill a writer at random points hundreds of times; every load sees a whole state."""
    path = str(tmp_path / "cp.json")
    states = [state_with(n % 5, n) for n in range(40)]
    CheckpointStore(path).save(states[0], TOPO)
    rng = random.Random(1234)
    kills = 300
    seen_markers = set()
    for _ in range(kills):
        start = rng.randrange(len(states) - 1)
        pid = os.fork()
        if pid == 0:  # child: write states start+1, start+2, ... until killed
            try:
                store = CheckpointStore(path)
                i = start + 1
                while True:
                    store.save(states[i % len(states)], TOPO)
                    i += 1
            finally:
                os._exit(0)
        delay = rng.random() * 0.004
        if delay > 0.0005:
            import time
            time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        result = CheckpointStore(path).load(TOPO)
        assert result.source == "checkpoint", result.warnings
        assert result.state in states
        seen_markers.add(result.state.reclaim_cpus)
        assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # stale temp files cleaned
    assert len(seen_markers) > 5  # the kills really landed at different points


def test_encode_decode_reject_tampering():
    raw = encode(state_with(1, 3), TOPO)
    doc = json.loads(raw)
    doc["data"]["allocations"][0]["cpus"] = [99]
    from agent.qrm.state import CorruptCheckpoint

    with pytest.raises(CorruptCheckpoint, match="checksum"):
        decode(json.dumps(doc).encode())


def test_unwritable_directory_is_a_clear_error(tmp_path):
    from agent.errors import StateError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    store = CheckpointStore(str(blocker / "cp.json"))
    with pytest.raises(StateError, match="cannot write checkpoint"):
        store.save(state_with(0, 0), TOPO)
