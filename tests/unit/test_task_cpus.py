"""Per-cpu offline run time without per-cpu cgroup counters (v2): threads charged where they last ran."""

import os

from agent.reporter.task_cpus import TaskCpuAttribution, read_thread, scale_to


def fake_thread(proc, pid, tid, cpu, run_ns, start=100, comm="a) b (c"):
    base = proc / str(pid) / "task" / str(tid)
    base.mkdir(parents=True, exist_ok=True)
    # fields 3.. after the command: state, then 18 fields up to starttime (22), then 16 up to processor (39)
    after = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 16 + [str(cpu)] + ["0"] * 13
    (base / "stat").write_text(f"{tid} ({comm}) " + " ".join(after) + "\n")
    (base / "schedstat").write_text(f"{run_ns} 0 0\n")


def test_a_command_with_parentheses_and_spaces_parses():
    proc = "/proc"
    start, cpu, run_ns = read_thread(os.getpid(), os.getpid(), proc)
    assert 0 <= cpu < os.cpu_count() and run_ns > 0 and start > 0


def test_threads_are_charged_to_the_cpu_they_last_ran_on(tmp_path):
    pids = [10]
    fake_thread(tmp_path, 10, 10, cpu=0, run_ns=1_000)
    fake_thread(tmp_path, 10, 11, cpu=1, run_ns=5_000, comm="x) y")
    tasks = TaskCpuAttribution(lambda: pids, proc=str(tmp_path))
    assert tasks.sample() == {}  # the first sample is the baseline
    fake_thread(tmp_path, 10, 10, cpu=0, run_ns=4_000)
    fake_thread(tmp_path, 10, 11, cpu=3, run_ns=6_000, comm="x) y")  # migrated: charged where it ended
    fake_thread(tmp_path, 20, 20, cpu=2, run_ns=700)  # a process new in the tree: all of its run time
    pids.append(20)
    assert tasks.sample() == {0: 3_000, 3: 1_000, 2: 700}
    fake_thread(tmp_path, 10, 10, cpu=0, run_ns=50, start=999)  # tid reused by a new thread
    assert tasks.sample() == {0: 50}


def test_a_tree_empty_at_first_charges_what_arrives_later(tmp_path):
    pids = []
    tasks = TaskCpuAttribution(lambda: pids, proc=str(tmp_path))
    assert tasks.sample() == {}
    fake_thread(tmp_path, 7, 7, cpu=1, run_ns=900)
    pids.append(7)
    assert tasks.sample() == {1: 900}


def test_gone_processes_are_skipped_and_charges_scale_to_the_tree_total(tmp_path):
    tasks = TaskCpuAttribution(lambda: [12345678], proc=str(tmp_path))
    assert tasks.sample() == {}
    assert scale_to({0: 3, 1: 1}, 800) == {0: 600.0, 1: 200.0}
    assert scale_to({}, 800) == {} and scale_to({0: 5}, 0) == {}


def test_an_idle_threads_stat_is_not_read_and_its_next_run_is_charged_from_where_it_was(tmp_path):
    fake_thread(tmp_path, 10, 10, cpu=0, run_ns=1_000)
    tasks = TaskCpuAttribution(lambda: [10], proc=str(tmp_path))
    assert tasks.sample() == {}
    stat = tmp_path / "10" / "task" / "10" / "stat"
    stat.unlink()  # a read of it would find nothing and drop the thread
    assert tasks.sample() == {}  # it did not run: schedstat alone
    fake_thread(tmp_path, 10, 10, cpu=2, run_ns=1_600)
    assert tasks.sample() == {2: 600}  # still known: charged what it ran since, not all of its run time


def _harvest_like(nodes, tasks, offline_millicpu):
    """What ``Usage.online_per_node`` reads on v2: no per-cpu counters, the threads' attribution, the
    trees' totals, and a topology of ``nodes`` NUMA nodes with two cpus each."""
    from types import SimpleNamespace

    cpus = {cpu: SimpleNamespace(numa=node) for node in range(nodes) for cpu in (2 * node, 2 * node + 1)}
    topology = SimpleNamespace(numa_nodes=[SimpleNamespace(id=n) for n in range(nodes)],
                               online_cpus=lambda: tuple(cpus), cpu=lambda c: cpus[c])
    usage = SimpleNamespace(_percpu_readers=[lambda: None], _tasks=tasks, offline_usage={},
                              enforcement=SimpleNamespace(base="t"), owner=SimpleNamespace(topology=topology))
    sample = SimpleNamespace(per_cpu_millicpu={cpu: 500 for cpu in cpus},
                             per_cgroup_millicpu={"t/reclaimed": offline_millicpu})
    return usage, sample


class _Walks:
    def __init__(self, charged):
        self.charged, self.walks = charged, 0

    def sample(self):
        self.walks += 1
        return self.charged


def test_online_per_numa_node_on_v2_walks_threads_only_where_it_must():
    from agent.services.usage import Usage

    def per_node(usage, sample):
        usage._offline_per_cpu = lambda s, now: Usage._offline_per_cpu(usage, s, now)
        return Usage.online_per_node(usage, sample, 0.0)

    # one NUMA node: the node's figure is every cpu's busy less the trees' total, with no walk
    walks = _Walks({0: 1})
    assert per_node(*_harvest_like(1, walks, 300)) == {0: 700} and walks.walks == 0
    # two nodes, offline idle: nothing to charge, no walk
    walks = _Walks({0: 1})
    assert per_node(*_harvest_like(2, walks, 0)) == {0: 1000, 1: 1000} and walks.walks == 0
    # two nodes, offline ran on cpu 3 (node 1): the walk charges it there
    walks = _Walks({3: 5_000})
    assert per_node(*_harvest_like(2, walks, 400)) == {0: 1000, 1: 600} and walks.walks == 1
    # the first walk is only a baseline: not known yet
    walks = _Walks({})
    assert per_node(*_harvest_like(2, walks, 400)) is None and walks.walks == 1
