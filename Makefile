# VBS: `make run` runs the embedded service, `make test` the whole suite; both set up what is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATA_DIR ?= ./var
PORT ?= 8770

.PHONY: setup deb venv csi-toolchain run test test-fast lint demo bench bench-quick clean

setup: deb venv csi-toolchain

deb:
	@./scripts/install-debian-packages

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,bench,csi-build]'
	touch $@

# The CSI driver's generated modules (csi.proto of the spec's Go module, compiled by grpcio-tools), the
# upstream csi-sanity in .tools/bin, and the references deploy/kubernetes is checked against (the sidecars'
# RBAC, the snapshot CRDs, KubeVirt's OpenAPI document) in .tools/kubernetes, all from the Go module proxy;
# none is committed (docs/kubernetes.md).
csi-toolchain: venv
	./scripts/csi-toolchain $(BIN)/python

run: setup
	$(BIN)/vbs up --data-dir $(DATA_DIR) --port $(PORT)

lint: venv
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/mypy

# One worker more than the machine has cores (TEST_WORKERS), a test module each at a time: most tests
# wait on daemons and guests, not on a CPU (on 2 cores, a fresh clone's run: 40:31 with 2 workers, 33:59
# with 3). The longest modules go first (tests/conftest.py LONGEST_MODULES), not xdist's most-tests-first.
# The modules that wait for minutes of schedule (ASLEEP_MODULES: one-minute lifecycle policies, some 14
# minutes mostly asleep) run in a pytest of their own beside the rest (scripts/run-tests), so that they
# hold none of its workers; their output follows the rest's, and make test fails if either run fails.
# PYTEST_ARGS: extra pytest options, e.g. make test PYTEST_ARGS=--durations=50 to see what the time goes to.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
ASLEEP_MODULES ?= tests/test_lifecycle_policies.py tests/test_lifecycle_runs.py
test: setup lint
	$(BIN)/python scripts/run-tests --pytest $(BIN)/pytest --workers $(TEST_WORKERS) \
		$(ASLEEP_MODULES:%=--asleep %) -- $(PYTEST_ARGS)

# The unit tier: no root, no daemons, no guests; what a developer runs on every change (on two workers:
# half the time on two cores). The CSI driver's unit tests need its generated modules (csi-toolchain).
test-fast: venv csi-toolchain
	$(BIN)/pytest -q -n 2 -m 'unit and not integration'

# Crash at every step: the whole matrix of tests/test_torture.py (the default run keeps a subset), and
# every test marked torture elsewhere (RBD crashes, moves of volumes and of instances); the hostile-input
# fuzzers with four times the cases of make test.
.PHONY: torture
torture: setup
	$(BIN)/pytest -q -m 'torture or not torture' tests/test_torture.py
	$(BIN)/pytest -q -m torture --ignore tests/test_torture.py tests
	VBS_FUZZ_EXAMPLES=60 $(BIN)/pytest -q tests/test_hostile_input.py

# The install guide run word for word on a cluster of network namespaces (docs/install.md "Trying it in
# network namespaces"): the namespace rig's test, then the cluster's, then partitions on a cluster of its
# own, with the iSCSI case make test leaves to make torture (all also part of make test).
.PHONY: cluster-test
cluster-test: setup
	$(BIN)/pytest -q tests/test_netns_rig.py tests/test_netns_cluster.py
	$(BIN)/pytest -q -m 'torture or not torture' tests/test_netns_partitions.py

# The upstream csi-sanity suite against `vbs csi` on a real `vbs up` (docs/kubernetes.md "Proof").
.PHONY: csi-sanity
csi-sanity: setup
	$(BIN)/pytest -q tests/test_csi_sanity.py

# Every benchmark, one after the other (bench/run_all.py --list); figures and logs under var/bench.
# make bench-quick: the five-minute set (each performance target once). make bench BENCH_ARGS="--only
# datapath,rtt": some of them.
bench: setup
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

bench-quick: setup
	$(BIN)/python bench/run_all.py --quick $(BENCH_ARGS)

# make demo ARGS="--hypervisor libvirt" (or --export iscsi): see scripts/demo.py --help.
demo: setup
	$(BIN)/python scripts/demo.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .tools src/vbs/csi/_generated
