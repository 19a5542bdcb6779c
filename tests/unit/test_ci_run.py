"""CI's entry point (.ci/run) runs what `make test` runs, split in two runs so both VM tiers can go beside
the Kubernetes tier: the split must cover every directory of tests/ that holds tests, each once, and the
second run (the node tier and the host's benches, which measure cpu time and latency) goes alone."""
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_two_runs_of_make_test_are_the_whole_of_it():
    with open(os.path.join(REPO, ".ci", "run")) as handle:
        script = handle.read()
    runs = re.findall(r'make test PYTEST_ARGS="\$PYTEST_ARGS ([^"]+)"', script)
    assert len(runs) == 2, runs
    named = [d for run in runs for d in run.split()]
    assert len(named) == len(set(named)), named
    # tests/systemd runs only in its VM (tests/conftest.py ignores it): every other directory holding tests
    holding = {f"tests/{d}" for d in os.listdir(os.path.join(REPO, "tests"))
               if os.path.isdir(os.path.join(REPO, "tests", d)) and d != "systemd"
               and any(f.startswith("test_") and f.endswith(".py") for f in os.listdir(os.path.join(REPO, "tests", d)))}
    assert set(named) == holding, (sorted(named), sorted(holding))
    # both VMs beside the first run only, the systemd VM at idle priority, their kernel fetched once before
    # either starts; the second run waits for both
    first, second = (script.index(f'make test PYTEST_ARGS="$PYTEST_ARGS {run}"') for run in runs)
    for start, waited in (("chrt --idle 0 make test-systemd >", 'wait "$systemd_pid"'),
                          ("make test-cgroup2 >", 'wait "$cgroup2_pid"')):
        assert script.count(start) == 1, start
        assert script.index("make vm-kernel") < script.index(start) < first, start
        assert first < script.index(waited) < second, waited
    assert "cgroup2_rc" in script[script.index('wait "$cgroup2_pid"'):second]
