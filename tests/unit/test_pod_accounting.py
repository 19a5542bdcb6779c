"""Pods in the kubelet's cgroups (Kubernetes mode): what reclaimed and dedicated pods use is not online
demand, and online pods' memory is protected where their pages are charged, with the cgroups above them.

Found on the real node tier: a reclaimed pod alone on the node got 0.34-0.57 of the one free cpu,
because its own use was counted as online and shrank the capacity it ran on, period after period."""

from agent.isolation.cgroups.recording import RecordingCgroups
from agent.qrm.model import KUBERNETES
from agent.reporter.usage import UsageSample
from tests.unit.test_capacity_api import TOPO

MIB = 1 << 20
GIB = 1 << 30
BATCH = ("kubepods/besteffort/podb", "kubepods/besteffort/podb/c1")
DB = ("kubepods/poddb", "kubepods/poddb/c1")
API = ("kubepods/burstable/poda", "kubepods/burstable/poda/c1", "kubepods/burstable/poda/c2")


class NodeSampler:
    """The node's busy millicpu as the test says (the pods' cgroups are not Tidal's trees)."""

    def __init__(self) -> None:
        self.busy = 0

    def sample(self, now, cgroups):
        return UsageSample({}, {"tidal/reclaimed": 0, "tidal/dedicated": 0}, self.busy)

    def forget(self, keep):
        pass


def pod_agent(make_agent, version):
    features = {"cpu.idle": True, "memory": True, "memory_protection": version == 2}
    driver = RecordingCgroups(version=version, features=features)
    agent = make_agent(TOPO, driver=driver, empty_grace=3600, memory_reserved_bytes=0)
    agent.usage.sampler = NodeSampler()
    for name, doc, paths in (("pod/batch", {"qos": "reclaimed_cores", "millicpu": 100, "tier": "low"}, BATCH),
                             ("pod/db", {"qos": "dedicated_cores", "cpus": 2}, DB),
                             ("pod/api", {"qos": "shared_cores", "millicpu": 500}, API)):
        agent.admit({"name": name, **doc}, source=KUBERNETES)
        for path in paths:  # the kubelet made them
            driver.create(path)
            if version == 2:
                driver.files[path][("", "memory.low")] = "0"  # as the kernel has it
        agent.admission.place(name, paths)
    return agent, driver


def test_reclaimed_and_dedicated_pods_use_is_not_online_demand(tmp_path, make_agent):
    agent, driver = pod_agent(make_agent, version=1)
    try:
        usage = {BATCH[0]: 0, DB[0]: 0}
        driver.usage.update(usage)
        agent.tick(now=100.0, epoch=1e9)
        agent.tick(now=101.0, epoch=1e9 + 1)
        # one second: the reclaimed pod used 3 cpus, the dedicated pod 2, online work 0.5
        driver.usage.update({BATCH[0]: 3 * 10 ** 9, DB[0]: 2 * 10 ** 9})
        agent.usage.sampler.busy = 5500
        driver.memory.update({BATCH[0]: 2 * GIB, DB[0]: GIB})
        driver.ceiling = (8 * GIB, 3 * GIB)  # the node's memory: 8 GiB, 3 available (a limit above the tree)
        agent.tick(now=102.0, epoch=1e9 + 2)
        assert agent.usage.offline_usage == {BATCH[0]: 3000, DB[0]: 2000}
        assert agent.usage.online_millicpu == 500
        # memory: the reclaimed pod's is offline's; the dedicated pod's is online's (it is online work)
        assert agent.usage.online_bytes == 8 * GIB - 3 * GIB - 2 * GIB
        assert agent.memory_status()["reclaimed_bytes"] == 2 * GIB
        # the pod ends: it is no longer read, and what it used no longer counts
        agent.release("pod/batch")
        agent.tick(now=103.0, epoch=1e9 + 3)
        assert set(agent.usage.offline_usage) == {DB[0]}
    finally:
        agent.shutdown()


def test_online_pods_memory_is_protected_down_to_their_containers_and_up_to_kubepods(tmp_path, make_agent):
    agent, driver = pod_agent(make_agent, version=2)
    try:
        # a pod's cgroup holds what its containers use (the kernel's figures are hierarchical)
        driver.memory.update({API[0]: 110 * MIB, API[1]: 100 * MIB, API[2]: 10 * MIB, DB[0]: 300 * MIB,
                              DB[1]: 300 * MIB, BATCH[0]: GIB, BATCH[1]: GIB, "tidal/system": 5 * MIB})
        for path in ("kubepods", "kubepods/burstable"):
            driver.create(path)
        for path in ("kubepods", "kubepods/burstable"):
            driver.files[path][("", "memory.low")] = "0"
        read, measure = [], driver.memory_usage_bytes
        driver.memory_usage_bytes = lambda path: read.append(path) or measure(path)
        agent.tick(now=100.0, epoch=1e9)
        low = {path: driver.read("", path, "memory.low") for path in
               (*API, *DB, "kubepods/burstable", "kubepods", "tidal/system", "tidal")}
        # measured: each online pod's own cgroup and Tidal's system tree, rounded up to 64 MiB; above them
        # the sum; the containers, where the pages are charged, their share of their pod's ("max")
        assert low == {API[0]: str(128 * MIB), API[1]: "max", API[2]: "max", DB[0]: str(320 * MIB), DB[1]: "max",
                       "kubepods/burstable": str(128 * MIB), "kubepods": str(448 * MIB),
                       "tidal/system": str(64 * MIB), "tidal": str(64 * MIB)}
        assert agent.memory_status()["protected_bytes"] == (128 + 320 + 64) * MIB  # the measured cgroups
        # a period reads one figure per online pod, none of an online pod's containers
        assert API[0] in read and DB[0] in read and not {API[1], API[2], DB[1]} & set(read)
        # offline: never protected
        assert not [op for op in driver.ops if op[0] == "write" and op[3] == "memory.low" and op[1] in BATCH]
        assert driver.read("", BATCH[1], "memory.low") == "0"
        assert driver.read("", BATCH[0], "memory.high") == driver.read("", "tidal/reclaimed", "memory.high")
        # revert puts the kubelet's cgroups back as found
        agent.shutdown()
        agent.enforcement.reconciler.revert()
        assert [driver.read("", p, "memory.low") for p in ("kubepods", "kubepods/burstable", *API)] == ["0"] * 5
    finally:
        agent.shutdown()


def test_v1_writes_no_protection_and_the_reclaimed_pod_goes_first_under_pressure(tmp_path, make_agent):
    agent, driver = pod_agent(make_agent, version=1)
    try:
        driver.memory.update({API[1]: 100 * MIB})
        driver.create("kubepods")
        agent.tick(now=100.0, epoch=1e9)
        assert not [op for op in driver.ops if op[0] == "write" and op[3] == "memory.low"]
        assert agent.memory_status()["protected_bytes"] is None
        assert driver.read("memory", BATCH[0], "memory.soft_limit_in_bytes") == "0"
    finally:
        agent.shutdown()


def test_the_nri_plugins_answer_for_a_pod_is_what_the_reconciler_writes(make_agent):
    """The plugin used to send a reclaimed pod's request-derived shares while the Reconciler wrote
    cpu.shares=2 (kernels without cpu.idle): the two flip-flopped the value. Now the answer is the
    Reconciler's own, on either kernel."""
    for version, idle in ((1, True), (1, False), (2, True)):
        features = {"cpu.idle": idle, "memory": True, "memory_protection": version == 2}
        driver = RecordingCgroups(version=version, features=features)
        agent = make_agent(TOPO, driver=driver, name=f"n{version}{idle}", empty_grace=3600)
        try:
            for name, doc, paths in (("pod/batch", {"qos": "reclaimed_cores", "millicpu": 500}, BATCH),
                                     ("pod/api", {"qos": "shared_cores", "millicpu": 500}, API)):
                agent.admit({"name": name, **doc}, source=KUBERNETES)
                for path in paths:
                    driver.create(path)
                agent.admission.place(name, paths)
            from agent.isolation.cgroups.knobs import files_for

            shares_file = files_for(version, "cpu_shares", 2)[0][:2]  # (controller, file) on this version
            idle_file = files_for(version, "cpu_idle", 1)[0][:2]
            given = agent.assignments()["assignments"]
            container = BATCH[-1]
            written = driver.files[container].get(shares_file)
            if idle:
                assert given["pod/batch"]["cpu_shares"] is None and written is None  # cpu.idle, the kubelet's weight
                assert driver.files[container].get(idle_file) == "1"
            else:
                assert given["pod/batch"]["cpu_shares"] == 2 and written == files_for(version, "cpu_shares", 2)[0][2]
            assert given["pod/api"]["cpu_shares"] is None  # an online pod's weight is the kubelet's
            assert shares_file not in driver.files[API[-1]]
        finally:
            agent.shutdown()
