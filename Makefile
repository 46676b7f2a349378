# Two commands do all the set-up on a fresh machine: `make demo` (every stage of the study in
# minutes) and `make test`; `make study` runs the quick study (120 configurations).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTHON ?= python3

.PHONY: demo study test test-slow lint bench clean

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rematlab study --grid demo --db results/demo.duckdb --out results/demo --device cpu

study: $(STAMP)
	$(VENV)/bin/rematlab study --grid quick --db results/quick.duckdb --out results/study --device cpu

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(PY) -m pytest -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

bench: $(STAMP)
	$(PY) benchmarks/strategies.py
	$(PY) benchmarks/planner.py

clean:
	rm -rf $(VENV) results .pytest_cache
