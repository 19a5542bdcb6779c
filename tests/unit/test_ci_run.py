"""CI's entry point (.ci/run) runs what `make test` runs, split in two runs so the systemd VM can go beside
the Kubernetes tier: the split must cover every directory of tests/ that holds tests, each once."""
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
    # the systemd VM beside the first run only, at idle priority; the VM tiers' own targets all run
    assert "chrt --idle 0 make test-systemd" in script and "make test-cgroup2" in script
    assert script.index("chrt --idle 0 make test-systemd") < script.index(runs[0])
    assert script.index('wait "$systemd_pid"') < script.index(runs[1])
