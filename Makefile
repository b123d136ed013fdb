# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv if missing and installs the project from the CPU lock (constraints/cpu.txt),
# plus the pinned upstream engine wheels the wire tests read, without their dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rollsafe-installed
MERMAID := tools/mermaid/node_modules/.package-lock.json
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint typecheck pytest diagrams-check verify diagrams bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints/cpu.txt constraints/upstream.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints/cpu.txt -e ".[dev]"
	$(BIN)/pip install -q --no-deps -r constraints/upstream.txt
	touch $(STAMP)

$(MERMAID): tools/mermaid/package.json tools/mermaid/package-lock.json
	cd tools/mermaid && npm ci --no-audit --no-fund --loglevel=error

demo: $(STAMP)
	$(BIN)/rollsafe demo

test: $(STAMP) $(MERMAID)
	$(BIN)/ruff check rollsafe tests benchmarks examples
	$(BIN)/ruff format --check rollsafe tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/python -m pytest -q
	$(BIN)/rollsafe diagrams --check

verify: $(STAMP)
	$(BIN)/rollsafe verify

diagrams: $(STAMP)
	$(BIN)/rollsafe diagrams

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_transitions.py

clean:
	rm -rf $(VENV) tools/mermaid/node_modules .pytest_cache .mypy_cache .hypothesis
