# Every target creates and uses the project's virtual environment (.venv) itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard proto/fencemark/v1/*.proto)

.PHONY: help venv proto proto-check lint typecheck test test-fast check demo bench clean inspector buf mutate

help:
	@echo "make demo        the main job: agents in three local regions drain a backlog under faults"
	@echo "make test        run the whole test suite (what is missing is skipped and named)"
	@echo "make test-fast   the inner loop: laws, rules and in-process nodes, under a minute"
	@echo "make bench       the benchmarks against etcd and Redis (docs/performance.md)"
	@echo "make check       lint, type-check and verify generated code is fresh"
	@echo "make mutate      mutation testing of the rule modules; MODULE=fence for one (docs/testing.md)"
	@echo "make proto       regenerate fencemark.v1 from proto/"
	@echo "make image       build the fencemark:dev docker image air-gapped (docs/deploy.md)"
	@echo "make prometheus-image  the compose stack's Prometheus image, air-gapped too"
	@echo "make etcd-image  a region's etcd image (Debian's etcd-server), air-gapped too"
	@echo "make inspector   install Node 22 and the pinned MCP Inspector CLI into .tools/"
	@echo "make buf         install the pinned buf CLI (a reflection client) into .tools/"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "Fencemark needs Python >= 3.11 (found $$($(PYTHON) --version))"; exit 1; }
	@$(PYTHON) -m venv $(VENV) || \
	  { echo "python3 -m venv failed: on Debian run 'apt-get install -y python3-venv'"; exit 1; }
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	@touch $@

venv: $(STAMP)

# Regenerates the committed protobuf/gRPC modules and their typed stubs.
PROTO_OUT ?= proto
proto: $(STAMP)
	@mkdir -p $(PROTO_OUT)
	$(BIN)/python -m grpc_tools.protoc -I proto \
	  --plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy \
	  --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	  --python_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
	  --mypy_out=quiet:$(PROTO_OUT) --mypy_grpc_out=quiet:$(PROTO_OUT) \
	  $(PROTOS)

# Fails when the committed generated code differs from what `make proto` makes.
proto-check: $(STAMP)
	@rm -rf build/proto-gen
	@$(MAKE) --no-print-directory proto PROTO_OUT=build/proto-gen >/dev/null
	@stale=0; for f in build/proto-gen/fencemark/v1/*; do \
	  committed=proto/fencemark/v1/$$(basename $$f); \
	  cmp -s $$f $$committed || { echo "stale or missing: $$committed"; stale=1; }; done; \
	for f in proto/fencemark/v1/*_pb2*; do \
	  [ -e build/proto-gen/fencemark/v1/$$(basename $$f) ] || { echo "not generated any more: $$f"; stale=1; }; done; \
	if [ $$stale = 1 ]; then echo "generated code is stale: run 'make proto' and commit the result"; exit 1; fi
	@echo "generated code under proto/ is fresh"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy node/fencemark client/fencemark bench/fencemark tests

check: proto-check lint typecheck

# The suite runs side by side in pytest-xdist workers (docs/testing.md): most tests
# wait on sockets, leases and settles rather than the CPU, so twice as many workers
# as cores, at most 8; an idle worker takes tests queued for a busy one (worksteal).
# Container tests run alone, after the rest (tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(( $$(nproc) * 2 )); echo $$(( n > 8 ? 8 : n )))
# Bytecode is cached (__pycache__, ignored by git) even where the environment says not
# to: every worker imports the whole suite, and compiling it anew costs each one seconds.
PYTEST_ALONE := env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest
PYTEST := $(PYTEST_ALONE) --dist worksteal

# The region chaos tier (marked `alone`) runs after the rest, in a run of its own: it
# judges availability, and a busy machine's stalls would be naps (docs/testing.md).
# Exit 5 is a run that selected nothing (PYTEST_ARGS chose other tests).
test: $(STAMP)
	$(PYTEST) -n $(TEST_WORKERS) -m "not alone" $(PYTEST_ARGS)
	$(PYTEST_ALONE) -m alone $(PYTEST_ARGS) || [ $$? = 5 ]

# The inner loop: laws, rules and in-process nodes on loopback; no node processes,
# containers, benchmarks or waits through leases and settles (under a minute).
# Its tests are short and mostly wait on loopback sockets: three workers per core (at
# most 8) finish it sooner than two, whose start (importing the suite) is the same.
FAST_WORKERS ?= $(shell n=$$(( $$(nproc) * 3 )); echo $$(( n > 8 ? 8 : n )))
test-fast: $(STAMP)
	$(PYTEST) -n $(FAST_WORKERS) -m "not slow and not docker and not chaos" $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/fencemark demo

# Every scenario, full length (several minutes); BENCH_ARGS="--quick" for a short run.
bench: $(STAMP)
	$(BIN)/fencemark bench $(BENCH_ARGS)

# Mutation testing of the rule modules, each against its own fast tests (mutation/,
# docs/testing.md): hours for all of them; `make mutate MODULE=hlc` for one (quick mode).
RULE_MODULES := hlc lww tagset fence record codec admission claims integrity validation grant_gate queue work_queue lines
MODULE ?= $(RULE_MODULES)
mutate: $(STAMP)
	@for module in $(MODULE); do mutation/run.sh $$module || exit 1; done
	@cat $(foreach module,$(MODULE),build/mutation/$(module).txt) | grep ': score '

# Node >= 22 and the pinned MCP Inspector CLI, into .tools/node22 (gitignored),
# for tests/test_mcp_inspector.py (which skips locally without them, fails in CI).
inspector:
	bash .ci/ensure-inspector

# The pinned buf CLI, into .tools/buf (gitignored), for tests/test_reflection.py:
# `buf curl` asks reflection v1 and v1alpha (skips locally without it, fails in CI).
buf:
	bash .ci/ensure-buf

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis

# -- deployment (docs/deploy.md) ---------------------------------------------------
FENCEMARK_IMAGE      ?= fencemark:dev
FENCEMARK_BASE_IMAGE ?= fencemark/base:bookworm
FENCEMARK_PROMETHEUS_IMAGE ?= fencemark/prometheus:dev
FENCEMARK_ETCD_IMAGE ?= fencemark/etcd-server:dev

.PHONY: docker-engine base-image image prometheus-image etcd-image

# A Docker engine and the tools the deployment needs (installs and starts them as needed).
docker-engine:
	deploy/ensure-docker.sh

# The Debian base image, from Debian packages (no registry); kept once built.
base-image: docker-engine
	deploy/build-base-image.sh --tag $(FENCEMARK_BASE_IMAGE)

# The Fencemark image, air-gapped: base image, wheels built here, docker build.
image: $(STAMP) base-image
	PYTHON=$(BIN)/python deploy/build-image.sh \
	  --base-image $(FENCEMARK_BASE_IMAGE) --tag $(FENCEMARK_IMAGE)

# The compose stack's Prometheus (docker-compose.prometheus.yml): Debian's prometheus package on
# the same base, the packages fetched here, docker build with no network; kept while
# its recipe and base are unchanged.
prometheus-image: base-image
	deploy/build-package-image.sh --package prometheus \
	  --base-image $(FENCEMARK_BASE_IMAGE) --tag $(FENCEMARK_PROMETHEUS_IMAGE)

# A region's etcd (a region of several members): Debian's etcd-server package on the
# same base, built the same way; kept while its recipe and base are unchanged.
etcd-image: base-image
	deploy/build-package-image.sh --package etcd-server \
	  --base-image $(FENCEMARK_BASE_IMAGE) --tag $(FENCEMARK_ETCD_IMAGE)
