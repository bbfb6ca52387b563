# Two entry points: `make demo` (local stack: Envoy + kv-picker + simulated vLLM endpoints)
# and `make test`. Both create .venv when missing and install the project into it.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint install proto

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kv-picker demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

# Regenerate picker/api/ from proto/ (a test fails when they differ).
proto: $(STAMP)
	$(VENV)/bin/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. \
		--pyi_out=. proto/picker/api/admin.proto

lint: $(STAMP)
	$(VENV)/bin/ruff check picker scorers benchmarks tests
	$(VENV)/bin/ruff format --check picker scorers benchmarks tests
	$(VENV)/bin/mypy
