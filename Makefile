# Every target creates and uses the project's virtual environment (.venv) itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard proto/fencemark/v1/*.proto)

.PHONY: help venv proto proto-check lint typecheck test check demo clean

help:
	@echo "make demo        start a local node and run the SPEC walkthrough against it"
	@echo "make test        run the whole test suite"
	@echo "make check       lint, type-check and verify generated code is fresh"
	@echo "make proto       regenerate fencemark.v1 from proto/"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "Fencemark needs Python >= 3.11 (found $$($(PYTHON) --version))"; exit 1; }
	@$(PYTHON) -m venv $(VENV) || \
	  { echo "python3 -m venv failed: on Debian run 'apt-get install -y python3-venv'"; exit 1; }
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

venv: $(STAMP)

# Regenerates the committed protobuf/gRPC modules and their typed stubs.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto \
	  --plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy \
	  --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	  --python_out=proto --grpc_python_out=proto \
	  --mypy_out=proto --mypy_grpc_out=proto \
	  $(PROTOS)

# Fails when the committed generated code differs from what `make proto` makes.
proto-check: $(STAMP)
	@rm -rf build/proto-check && mkdir -p build/proto-check && cp -r proto build/proto-check/
	@$(MAKE) --no-print-directory proto >/dev/null
	@if ! diff -r -x __pycache__ build/proto-check/proto proto >/dev/null; then \
	  echo "generated code under proto/ is stale: run 'make proto' and commit the result"; \
	  diff -r -x __pycache__ build/proto-check/proto proto | head -40; \
	  rm -rf proto && cp -r build/proto-check/proto proto; exit 1; fi
	@echo "generated code is fresh"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy node/fencemark client/fencemark tests

check: proto-check lint typecheck

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/fencemark demo

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis
