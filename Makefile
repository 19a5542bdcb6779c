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

.PHONY: all install deps test run bench clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

install: $(STAMP)

deps:
	@sh scripts/install-debian-packages.sh scripts/debian-packages.txt

test: deps $(STAMP)
	TMPDIR=$(TEST_TMP) $(BIN)/python -m pytest $(PYTEST_ARGS)

run: deps $(STAMP)
	$(BIN)/tidal agent

bench: $(STAMP)
	$(BIN)/tidal bench topology --root tests/fixtures/hwloc --json || true

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
