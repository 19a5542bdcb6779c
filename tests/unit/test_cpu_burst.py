"""CPU burst for limited online work (#37): a shared_cores workload with ``limit_millicpu`` gets its quota and
a burst of ``--online-cpu-burst`` percent of it, on either cgroup version; never reclaimed work."""

from __future__ import annotations

import pytest

from agent.errors import AdmissionError
from agent.isolation.cgroups.desired import CgroupOptions
from agent.isolation.cgroups.knobs import files_for
from agent.isolation.cgroups.recording import RecordingCgroups
from agent.qrm.model import Allocation, QoS
from agent.qrm.policy import initial_state
from agent.qrm.requests import Limits, parse_request
from agent.qrm.state import CorruptCheckpoint, decode, encode, validate
from agent.topology.synthetic import Shape, build_topology
from agent.isolation.cgroups.detect import CgroupError

TOPO = build_topology(Shape(sockets=1, numa_per_socket=1, cores_per_numa=4, threads_per_core=1))


def test_a_limit_is_shared_works_own_above_its_request():
    request = parse_request({"name": "web", "qos": "shared_cores", "millicpu": 200, "limit_millicpu": 500},
                            Limits(cpus=4))
    assert request.limit_millicpu == 500
    for doc, message in (({"qos": "shared_cores", "millicpu": 600, "limit_millicpu": 500}, "below its millicpu"),
                         ({"qos": "reclaimed_cores", "millicpu": 100, "limit_millicpu": 500}, "shared_cores only"),
                         ({"qos": "dedicated_cores", "cpus": 1, "limit_millicpu": 1000}, "shared_cores only"),
                         ({"qos": "shared_cores", "millicpu": 100, "limit_millicpu": 10 ** 400}, "this node has"),
                         ({"qos": "shared_cores", "millicpu": 1, "limit_millicpu": 5}, "least quota"),
                         ({"qos": "shared_cores", "millicpu": 100, "limit_millicpu": "500"}, "must be a number")):
        with pytest.raises(AdmissionError, match=message):
            parse_request({"name": "web", **doc}, Limits(cpus=4))


def test_the_knob_on_each_version():
    assert files_for(1, "cpu_burst", 20000) == [("cpu", "cpu.cfs_burst_us", "20000")]
    assert files_for(2, "cpu_burst", 20000) == [("", "cpu.max.burst", "20000")]


@pytest.mark.parametrize("version", [1, 2])
def test_the_agent_writes_the_quota_and_its_burst(make_agent, version):
    driver = RecordingCgroups(version=version)
    agent = make_agent(TOPO, driver=driver)
    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 200, "limit_millicpu": 500})
    agent.admit({"name": "plain", "qos": "shared_cores", "millicpu": 200})
    agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 100})
    agent.reconcile()
    quota = ("cpu", "cpu.cfs_quota_us") if version == 1 else ("", "cpu.max")
    burst = ("cpu", "cpu.cfs_burst_us") if version == 1 else ("", "cpu.max.burst")
    web = driver.files["tidal/shared/web"]
    assert web[quota] == ("50000" if version == 1 else "50000 100000") and web[burst] == "50000"
    assert agent.describe(agent.state.get("web"))["limit_millicpu"] == 500
    # no limit, no quota and no burst; reclaimed work never gets one
    assert quota not in driver.files["tidal/shared/plain"] and burst not in driver.files["tidal/shared/plain"]
    assert not [p for p, files in driver.files.items() if "reclaimed" in p and burst in files]


def test_burst_off_and_a_kernel_without_it(make_agent):
    off = RecordingCgroups(version=2)
    agent = make_agent(TOPO, driver=off, name="off", extra=("cgroup_options",),
                       cgroup_options=CgroupOptions(online_cpu_burst_percent=0))
    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 200, "limit_millicpu": 500})
    agent.reconcile()
    assert off.files["tidal/shared/web"][("", "cpu.max.burst")] == "0"
    old = RecordingCgroups(version=2, features={"cpu.idle": True, "memory": True})  # Linux < 5.14: no burst file
    agent = make_agent(TOPO, driver=old, name="old")
    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 200, "limit_millicpu": 500})
    report = agent.reconcile()
    assert ("", "cpu.max.burst") not in old.files["tidal/shared/web"] and not report.failed
    assert old.files["tidal/shared/web"][("", "cpu.max")] == "50000 100000"


class StrictBurst(RecordingCgroups):
    """As the kernel: a burst above its quota is refused (EINVAL), on either file."""

    def write(self, controller, path, file, text):
        files = self.files.get(path, {})
        quota = text if file == "cpu.max" else files.get(("", "cpu.max"), "max 100000")
        burst = text if file == "cpu.max.burst" else files.get(("", "cpu.max.burst"), "0")
        if file in ("cpu.max", "cpu.max.burst") and quota.split()[0] != "max" and int(burst) > int(quota.split()[0]):
            raise CgroupError(f"{path}/{file}: Invalid argument")
        return super().write(controller, path, file, text)


def test_a_larger_burst_found_there_is_lowered_before_the_quota(make_agent):
    driver = StrictBurst(version=2)
    agent = make_agent(TOPO, driver=driver)
    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 200, "limit_millicpu": 500})
    agent.reconcile()
    # someone raised the quota and the burst under the workload: Tidal takes both back without a refusal
    driver.files["tidal/shared/web"][("", "cpu.max")] = "200000 100000"
    driver.files["tidal/shared/web"][("", "cpu.max.burst")] = "150000"
    report = agent.reconcile(verify=True)  # the drift check's full read
    assert not report.failed, report.failed
    assert driver.files["tidal/shared/web"][("", "cpu.max")] == "50000 100000"
    assert driver.files["tidal/shared/web"][("", "cpu.max.burst")] == "50000"


def test_the_checkpoint_keeps_a_limit_and_refuses_one_on_other_work():
    state = initial_state(TOPO).with_allocation(Allocation("web", QoS.SHARED, 200, mems=(0,), limit_millicpu=500))
    assert decode(encode(state, TOPO))[0].get("web").limit_millicpu == 500
    bad = initial_state(TOPO).with_allocation(Allocation("batch", QoS.RECLAIMED, 200, mems=(0,), limit_millicpu=500))
    with pytest.raises(CorruptCheckpoint, match="cpu limit"):
        validate(bad, TOPO)
