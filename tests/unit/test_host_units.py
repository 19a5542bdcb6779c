"""Holding the host's systemd units on the reserved cpus (services.host_units over isolation.systemd).

The client here is a stand-in for systemd's bus that records what it was asked; the real bus and a
real systemd are make test-systemd's (tests/systemd/test_unit.py)."""
import json
import os

import pytest
from hypothesis import given, strategies as st

from agent.isolation.systemd import SystemdError, cpus_to_mask, mask_to_cpus, unit_type
from agent.services.host_units import FILE, HostUnits


EVERY = [0, 1, 2, 3]


class FakeSystemd:
    def __init__(self, values):
        self.values = dict(values)
        self.calls = []
        self.refuse = set()

    def allowed_cpus(self, unit):
        self.calls.append(("get", unit))
        if "*" in self.refuse:
            raise SystemdError("systemd's bus (system): ConnectionRefusedError")
        return list(self.values.get(unit, []))

    def set_allowed_cpus(self, unit, cpus):
        self.calls.append(("set", unit, sorted(cpus)))
        if unit in self.refuse:
            raise SystemdError(f"systemd refused SetUnitProperties: org.freedesktop.DBus.Error.InvalidArgs: {unit}")
        self.values[unit] = sorted(cpus)


def test_the_mask_is_systemds_byte_order():
    assert cpus_to_mask([0]) == b"\x01"
    assert cpus_to_mask([0, 9]) == b"\x01\x02"
    assert cpus_to_mask([]) == b""
    assert mask_to_cpus(b"\x05\x80") == [0, 2, 15]
    with pytest.raises(ValueError):
        cpus_to_mask([8192])
    with pytest.raises(ValueError):
        mask_to_cpus(b"\xff" * 2000)


@given(st.sets(st.integers(0, 8191), max_size=64))
def test_masks_round_trip(cpus):
    assert mask_to_cpus(cpus_to_mask(cpus)) == sorted(cpus)


@pytest.mark.parametrize("name", ["system.slice", "user.slice", "init.scope", "cron.service"])
def test_unit_names(name):
    assert unit_type(name) in ("slice", "scope", "service")


@pytest.mark.parametrize("name", ["system", ".slice", "a/b.slice", "x.socket", "x" * 300 + ".slice", ""])
def test_not_unit_names(name):
    with pytest.raises(ValueError):
        unit_type(name)


def test_originals_are_saved_before_the_first_set_and_survive_a_restart(tmp_path):
    bus = FakeSystemd({"system.slice": [], "user.slice": [2, 3]})
    held = HostUnits(["system.slice", "user.slice"], bus, str(tmp_path), EVERY)
    assert held.hold([0])
    saved = json.loads((tmp_path / FILE).read_text())
    assert saved == {"original_allowed_cpus": {"system.slice": [], "user.slice": [2, 3]}}
    assert bus.values == {"system.slice": [0], "user.slice": [0]}
    assert not held.hold([0])  # unchanged: systemd is not asked again
    assert [c for c in bus.calls if c[0] == "set"] == [("set", "system.slice", [0]), ("set", "user.slice", [0])]
    # a restarted agent (or one after a crash) reads the saved values, never its own setting, as theirs
    again = HostUnits(["system.slice", "user.slice"], bus, str(tmp_path), EVERY)
    assert again.hold([0, 1])
    assert not any(c[0] == "get" for c in bus.calls[4:])
    assert again.release()
    assert bus.values == {"system.slice": [], "user.slice": [2, 3]}
    # a unit that had no value is opened to every cpu first (systemd 252 leaves the cgroup's cpuset as it
    # last wrote it when the property is cleared), then cleared
    assert [c for c in bus.calls if c[:2] == ("set", "system.slice")][-2:] == [("set", "system.slice", EVERY),
                                                                               ("set", "system.slice", [])]
    assert [c for c in bus.calls if c[:2] == ("set", "user.slice")][-1] == ("set", "user.slice", [2, 3])
    assert not (tmp_path / FILE).exists()


def test_a_unit_added_later_is_read_and_saved_then(tmp_path):
    bus = FakeSystemd({"system.slice": [], "init.scope": [1]})
    HostUnits(["system.slice"], bus, str(tmp_path), EVERY).hold([0])
    HostUnits(["system.slice", "init.scope"], bus, str(tmp_path), EVERY).hold([0])
    saved = json.loads((tmp_path / FILE).read_text())["original_allowed_cpus"]
    assert saved == {"system.slice": [], "init.scope": [1]}


def test_a_refusal_is_one_warning_and_retried_while_the_others_are_held(tmp_path):
    lines = []
    bus = FakeSystemd({})
    bus.refuse.add("init.scope")
    held = HostUnits(["system.slice", "init.scope"], bus, str(tmp_path), EVERY, lines.append)
    held.hold([0])
    held.hold([0])  # retried (an error stands), the warning not repeated
    assert bus.values["system.slice"] == [0]
    assert [c for c in bus.calls if c[:2] == ("set", "init.scope")] == [("set", "init.scope", [0])] * 2
    warnings = [line for line in lines if "warning" in line]
    assert len(warnings) == 1 and "init.scope" in warnings[0]
    assert held.status()["errors"]["init.scope"].startswith("systemd refused")
    bus.refuse.clear()
    held.hold([0])
    assert held.status()["errors"] == {} and bus.values["init.scope"] == [0]


def test_no_bus_sets_nothing_and_saves_nothing(tmp_path):
    bus = FakeSystemd({})
    bus.refuse.add("*")
    held = HostUnits(["system.slice"], bus, str(tmp_path), EVERY)
    assert not held.hold([0])
    assert not os.path.exists(tmp_path / FILE) and not any(c[0] == "set" for c in bus.calls)
    assert "*" in held.status()["errors"]


def test_a_corrupt_saved_file_is_kept_aside_and_the_current_values_taken(tmp_path):
    (tmp_path / FILE).write_text('{"original_allowed_cpus": {"system.slice": [-1]}}')
    lines = []
    bus = FakeSystemd({"system.slice": [3]})
    HostUnits(["system.slice"], bus, str(tmp_path), EVERY, lines.append).hold([0])
    assert any("unusable" in line for line in lines)
    assert json.loads((tmp_path / FILE).read_text())["original_allowed_cpus"] == {"system.slice": [3]}
    assert [p for p in os.listdir(tmp_path) if ".bad-" in p]


def test_an_empty_reserved_pool_gives_the_units_back(tmp_path):
    bus = FakeSystemd({"system.slice": [5]})
    held = HostUnits(["system.slice"], bus, str(tmp_path), EVERY)
    held.hold([0])
    held.hold([])
    assert bus.values["system.slice"] == [5]


def test_the_agent_refuses_before_making_anything_where_systemd_does_not_run(tmp_path, monkeypatch):
    from agent.daemon import Agent, AgentConfig
    from agent.errors import TidalError

    monkeypatch.setattr("agent.daemon.os.path.isdir", lambda path: path != "/run/systemd/system")
    agent = Agent(AgentConfig(state_dir=str(tmp_path / "state"), socket_path=str(tmp_path / "s.sock"),
                              host_units=("system.slice",)))
    with pytest.raises(TidalError, match="systemd does not run this host"):
        agent.start()
    assert agent.driver is None and not (tmp_path / "state").exists()


def test_a_unit_moved_off_by_someone_else_is_held_again_at_the_next_check(tmp_path):
    lines = []
    bus = FakeSystemd({"system.slice": [], "user.slice": []})
    held = HostUnits(["system.slice", "user.slice"], bus, str(tmp_path), EVERY, lines.append)
    held.hold([0])
    bus.values["user.slice"] = []  # an operator's systemctl set-property --runtime user.slice AllowedCPUs=
    assert not held.hold([0])  # between checks nothing is read
    assert bus.values["user.slice"] == []
    assert held.hold([0], verify=True)
    assert bus.values == {"system.slice": [0], "user.slice": [0]}
    assert held.status()["drift_repairs"] == 1 and any("user.slice" in line and "again" in line for line in lines)
    assert not held.hold([0], verify=True)  # in place: read, nothing set
    # what the units had before Tidal is still what was saved first, not the operator's later change
    assert json.loads((tmp_path / FILE).read_text())["original_allowed_cpus"]["user.slice"] == []
