"""Reclaimed work never runs on the SMT sibling of a dedicated cpu (#37), on hwloc's SMT machines and
through the agent as it computes the cgroup tree; ``--reclaimed-on-smt-siblings`` gives them back."""

from __future__ import annotations

import dataclasses
import json

from click.testing import CliRunner

from agent.cli import main
from agent.qrm.assignment import reclaimed_cpus
from agent.qrm.model import QoS, Request
from agent.qrm.policy import allocate, initial_state, pools, smt_siblings_held_back
from agent.topology.parse import parse_cpulist
from tests.unit.test_qrm_properties import hwloc_topology

SMT = "16em64t-4s2c2t"  # 4 sockets x 2 cores x 2 threads: cpu n and n+8 share a core


def admit(topo, state, request):
    decision = allocate(topo, state, request)
    assert not hasattr(decision, "reason"), decision
    return state.with_allocation(decision), decision


def siblings(topo, cpu):
    return set(topo.cpus_in_core(topo.cpu(cpu).core)) - {cpu}


def test_a_dedicated_cpus_sibling_is_never_reclaimeds_lent_carved_or_harvested():
    topo = hwloc_topology(SMT)
    assert topo.threads_per_core == 2
    state, online = admit(topo, initial_state(topo), Request("online", QoS.DEDICATED, cpus=1, millicpu=1000))
    (cpu,) = online.cpus
    (sibling,) = siblings(topo, cpu)
    pool = pools(topo, state)
    assert pool.held_back == (sibling,) and smt_siblings_held_back(topo, state) == {sibling: "online"}
    assert sibling in pool.shared  # online work of the shared pool may run beside it: it is the node's own
    for harvest in (False, True):
        assert sibling not in reclaimed_cpus(pool, harvest) and cpu not in reclaimed_cpus(pool, harvest)
    # the whole reclaim pool, carved as far as it goes, takes every free whole core and never the sibling
    carved = pools(topo, state.with_reclaim_cpus(64))
    assert sibling not in carved.reclaimed and len(carved.reclaimed) == 16 - 2 - 2  # less reserved core, the pair
    # the option gives it back, harvested and carved
    allowed = dataclasses.replace(state, reclaim_siblings=True)
    assert pools(topo, allowed).held_back == () and sibling in reclaimed_cpus(pools(topo, allowed), True)
    assert sibling in pools(topo, allowed.with_reclaim_cpus(64)).reclaimed


def test_a_workload_that_lends_its_cpus_has_no_sibling_held_back_and_an_unlent_neighbour_wins():
    topo = hwloc_topology(SMT)
    state, lender = admit(topo, initial_state(topo), Request("lender", QoS.DEDICATED, cpus=1, millicpu=1000,
                                                             reclaim_allowed=True))
    (cpu,) = lender.cpus
    (sibling,) = siblings(topo, cpu)
    assert pools(topo, state).held_back == () and cpu in pools(topo, state).reclaimed
    # the sibling goes to a workload that does not lend: the lender's own cpu is now held back for it
    taken = initial_state(topo).reserved + (cpu,)
    pinned = Request("pinned", QoS.DEDICATED, cpus=1, millicpu=1000)
    decision = allocate(topo, dataclasses.replace(state, reserved=tuple(c for c in topo.online_cpus()
                                                                         if c != sibling and c not in taken)), pinned)
    assert decision.cpus == (sibling,)
    state = state.with_allocation(decision)
    pool = pools(topo, state)
    assert cpu in pool.held_back and cpu not in pool.reclaimed and cpu not in pool.lendable


def test_a_whole_numa_nodes_idle_siblings_stay_idle():
    topo = hwloc_topology(SMT)
    state, owner = admit(topo, initial_state(topo), Request("numa", QoS.DEDICATED, cpus=1, millicpu=1000, numa_binding=True,
                                                            numa_exclusive=True))
    (cpu,) = owner.cpus
    (sibling,) = siblings(topo, cpu)
    pool = pools(topo, state)
    assert sibling in pool.idle and sibling in pool.held_back and sibling not in pool.reclaimed
    rest = set(topo.cpus_in_numa(topo.cpu(cpu).numa)) - {cpu, sibling} - set(state.reserved)
    assert rest and rest <= set(pool.reclaimed)  # the node's other cores are lent as before


def test_tidal_plan_shows_the_held_back_cpus_and_the_flag_gives_them(hwloc_trees, tmp_path):
    requests = tmp_path / "r.json"
    requests.write_text(json.dumps([{"name": "db", "qos": "dedicated_cores", "cpus": 3},
                                    {"name": "batch", "qos": "reclaimed_cores", "millicpu": 1000}]))
    root = hwloc_trees[SMT]
    runner = CliRunner()
    out = runner.invoke(main, ["plan", "--root", root, "--requests", str(requests), "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    db = next(a for a in report["assignments"] if a["name"] == "db")
    batch = next(a for a in report["assignments"] if a["name"] == "batch")
    assert len(report["pools"]["held_back"]) == 1  # three cpus: one core whole, one thread of the next
    assert not set(batch["cpus"]) & (set(report["pools"]["held_back"]) | set(db["cpus"]))
    text = runner.invoke(main, ["plan", "--root", root, "--requests", str(requests)]).output
    assert "held back" in text and "s shared, never reclaimed's" in text
    allowed = runner.invoke(main, ["plan", "--root", root, "--requests", str(requests), "--json",
                                   "--reclaimed-on-smt-siblings"])
    assert json.loads(allowed.output)["pools"]["held_back"] == []


def test_the_agent_keeps_reclaimed_work_off_the_sibling_and_says_so(make_agent, hwloc_topologies):
    topo = hwloc_topologies[SMT]
    agent = make_agent(topo)
    online = agent.admit({"name": "online", "qos": "dedicated_cores", "cpus": 1})
    agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 200})
    (sibling,) = siblings(topo, online["cpus"][0] if isinstance(online["cpus"], list)
                          else parse_cpulist(online["cpus"])[0])
    agent.reconcile()
    status = agent.status()
    assert status["smt"] == {"threads_per_core": 2, "reclaimed_on_siblings": False,
                             "held_back": [{"cpu": sibling, "sibling_of": "online"}]}
    assert list(parse_cpulist(status["pools"]["held_back"])) == [sibling]
    written = agent.driver.read("cpuset", "tidal/reclaimed", "cpuset.cpus")
    assert written and sibling not in parse_cpulist(written), written
    assert sibling not in parse_cpulist(agent.capacity_doc()["reclaimed"]["cpus"])


def test_the_agents_flag_lets_reclaimed_work_on_the_siblings(make_agent, hwloc_topologies):
    topo = hwloc_topologies[SMT]
    agent = make_agent(topo, reclaimed_on_smt_siblings=True, extra=("reclaimed_on_smt_siblings",))
    agent.admit({"name": "online", "qos": "dedicated_cores", "cpus": 1})
    agent.reconcile()
    assert agent.status()["smt"]["held_back"] == [] and agent.status()["smt"]["reclaimed_on_siblings"] is True


def test_with_only_siblings_left_reclaimed_work_is_refused_with_why():
    topo = hwloc_topology("2i386-2t-hugepagesizecount")  # one core of two threads
    assert topo.threads_per_core == 2 and len(topo.online_cpus()) == 2
    state = initial_state(topo, reserved=())
    state, _ = admit(topo, state, Request("online", QoS.DEDICATED, cpus=1, millicpu=1000))
    decision = allocate(topo, state, Request("batch", QoS.RECLAIMED, millicpu=100))
    assert "SMT sibling of a dedicated cpu" in decision.reason
    allowed = dataclasses.replace(state, reclaim_siblings=True)
    assert not hasattr(allocate(topo, allowed, Request("batch", QoS.RECLAIMED, millicpu=100)), "reason")
