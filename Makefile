# Tidal — the two commands a fresh machine needs:
#   make run    installs Tidal in .venv and starts the agent with embedded defaults
#   make test   installs Tidal with its test extras (and the Debian packages the
#               tests use, when root) and runs the whole suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# synthetic sysfs trees are thousands of small files: build them on tmpfs when there is one
TEST_TMP := $(shell [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm || echo $${TMPDIR:-/tmp})
PYTEST_ARGS ?=

PREFIX ?= /opt/tidal
UNIT_DIR ?= /etc/systemd/system
BIN_DIR ?= /usr/local/bin
CONFIG_DIR ?= /etc/tidal
COMPLETION_DIR ?= /usr/share/bash-completion/completions

.PHONY: all install deps test docs dist helm kwok koordlet manifests test-cgroup2 test-systemd test-systemd-kubelet test-systemd-full bench-hierarchies run bench clean clean-test-leftovers k8s-testbin metrics-server nrt-scheduler yarn-testbin node-testbin image vm-kernel

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

# A system-wide install with the systemd unit (root): a venv in $(PREFIX), `tidal` in $(BIN_DIR), the unit in $(UNIT_DIR),
# its configuration in $(CONFIG_DIR)/agent.yaml (kept if there).
install:
	$(PYTHON) -m venv $(PREFIX)/venv
	$(PREFIX)/venv/bin/pip install --quiet --disable-pip-version-check .
	@# the CLI on PATH (`tidal status` right after the install; make test-systemd runs it so)
	mkdir -p $(BIN_DIR) && ln -sf $(PREFIX)/venv/bin/tidal $(BIN_DIR)/tidal
	install -D -m 0644 systemd/tidal.service $(UNIT_DIR)/tidal.service
	@# the operator's configuration is kept: the shipped one is written only where none exists
	[ -e $(CONFIG_DIR)/agent.yaml ] || install -D -m 0644 systemd/agent.yaml $(CONFIG_DIR)/agent.yaml
	@# bash completion from click (zsh and fish: docs/install.md)
	mkdir -p $(COMPLETION_DIR) && _TIDAL_COMPLETE=bash_source $(PREFIX)/venv/bin/tidal > $(COMPLETION_DIR)/tidal
	install -D -m 0644 README.md /usr/local/share/doc/tidal/README.md
	mkdir -p /usr/local/share/doc/tidal && cp -r docs CHANGELOG.md /usr/local/share/doc/tidal/
	@if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then \
		systemctl daemon-reload && echo "installed; start with: systemctl enable --now tidal"; \
	else echo "installed $(UNIT_DIR)/tidal.service (no running systemd here to load it)"; fi

deps:
	@sh scripts/install-debian-packages.sh scripts/debian-packages.txt

test: deps $(STAMP)
	TMPDIR=$(TEST_TMP) $(BIN)/python -m pytest $(PYTEST_ARGS)

# the privileged tier again on a pure cgroup v2 kernel, in a qemu VM (root; the kernel and
# virtme-ng are cached outside the repository; see scripts/cgroup2-vm.sh)
test-cgroup2: deps $(STAMP)
	sh scripts/cgroup2-vm.sh

# what both VM tiers take first: the Debian packages they need and the kernel they boot (cached outside the
# repository; each tier's script does the same, so this only lets CI fetch them once before both start)
vm-kernel:
	sh scripts/install-debian-packages.sh scripts/vm-debian-packages.txt
	sh scripts/vm-kernel.sh > /dev/null

# the shipped unit under systemd as PID 1 on pure cgroup v2, in a qemu VM (root): make install there and
# tests/systemd drive it with systemctl (scripts/systemd-vm.sh; the image and wheels cached outside the repository)
test-systemd: deps $(STAMP)
	sh scripts/systemd-vm.sh

# the DaemonSet on a kubeadm-style node in the same VM: a kubelet >= 1.35 with the systemd cgroup driver and
# containerd 2.x as systemd units, the control plane on this host (root; k8s-testbin at the kubelet's version,
# node-testbin, the image and helm, built when missing). Not in CI (~10 min under emulation); make test-systemd-full runs both systemd tiers
test-systemd-kubelet: deps $(STAMP)
	TIDAL_VM_KUBE=1 sh scripts/systemd-vm.sh

# every systemd tier: run before each closing note
test-systemd-full: test-systemd test-systemd-kubelet

# the cpu benchmarks on this host's hierarchy and on pure cgroup v2 in the same VM, side by side (root)
bench-hierarchies: deps $(STAMP)
	$(BIN)/python scripts/bench-hierarchies.py

# kube-apiserver, kube-scheduler and etcd built from source for the Kubernetes end-to-end tier
# (pytest -m k8s), cached outside the repository: the first build takes ~10 minutes, later runs none.
k8s-testbin:
	sh scripts/k8s-testbin.sh

# a kube-scheduler with the upstream NodeResourceTopologyMatch plugin (sigs.k8s.io/scheduler-plugins),
# for the tier that checks it reads Tidal's reports; cached outside the repository like k8s-testbin
nrt-scheduler:
	sh scripts/nrt-scheduler.sh

# Hadoop YARN's ResourceManager, NodeManager and distributed shell (jars from Maven Central) for the YARN
# tier (tests/yarn); cached outside the repository like k8s-testbin
yarn-testbin:
	sh scripts/yarn-testbin.sh

# containerd 2.x, runc and the pause and busybox images (OCI archives) for the node tier (pytest -m node:
# a kubelet from k8s-testbin runs Tidal's image as the DaemonSet); cached outside the repository
node-testbin: deps
	sh scripts/node-testbin.sh

# Tidal's image with no registry and no container engine (mmdebstrap + umoci, root):
# dist/tidal_<version>.oci.tar, docker.io/library/tidal:<version>, the name deploy/ uses
image: deps
	sh scripts/image.sh

# KWOK (sigs.k8s.io/kwok from the Go module proxy, cached in ~/.cache/tidal/kwok) for the scheduler tier
# (pytest -m sched) and tidal bench scheduler
kwok:
	sh scripts/kwok.sh

# helm (helm.sh/helm/v3 from the Go module proxy, cached in ~/.cache/tidal/helm) for the chart's tests
helm:
	sh scripts/helm.sh

# metrics-server, the peer of `tidal cluster metrics`, for the node tier's HPA test, cached outside the repository
metrics-server:
	sh scripts/metrics-server.sh

# Koordinator's koordlet for the node tier's peers benchmark (tests/node/test_peers.py), cached outside the repository
koordlet:
	sh scripts/koordlet.sh

# deploy/'s plain manifests, rendered from the chart (deploy/helm/tidal), their one source
manifests:
	sh scripts/render-manifests.sh

# a release: the wheel and sdist, the image, SHA256SUMS, in dist/ (scripts/dist.sh)
dist: deps $(STAMP)
	sh scripts/dist.sh

run: deps $(STAMP)
	$(BIN)/tidal agent

bench: $(STAMP)
	$(BIN)/tidal bench topology --root tests/fixtures/hwloc --json || true

# the generated pages of docs/ (CLI and HTTP API references), from the code they describe
docs: $(STAMP)
	$(BIN)/python scripts/gen-docs.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .schemathesis

# network namespaces and empty cgroups that a killed test or benchmark run left behind (root)
clean-test-leftovers:
	sh scripts/clean-test-leftovers.sh
