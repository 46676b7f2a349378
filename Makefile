# Two commands do all the set-up on a fresh machine: `make demo` (every stage of the study in
# minutes) and `make test`; `make study` runs the quick study (120 configurations).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTHON ?= python3

# The oldest torch rematlab supports (pyproject.toml), tested on CPU by `make test-oldest`: what
# common GPU images ship. PyPI has it only as a CUDA build (about 4.6 GB installed, a minute
# here); on a machine without a GPU it runs on the CPU like the pinned build.
OLDEST_TORCH := 2.11.0
OLD_VENV := .venv-torch$(OLDEST_TORCH)
OLD_STAMP := $(OLD_VENV)/.installed

.PHONY: demo study test test-slow test-oldest lint bench clean

# scripts/install.py: uv with pip's index settings (twice as fast), or pip where uv cannot
$(STAMP): pyproject.toml requirements.txt scripts/install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/install.py -r requirements.txt
	$(PY) scripts/install.py --no-deps -e .
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

$(OLD_STAMP): pyproject.toml requirements.txt scripts/install.py
	test -x $(OLD_VENV)/bin/python || $(PYTHON) -m venv $(OLD_VENV)
	sed 's/^torch==.*/torch==$(OLDEST_TORCH)/' requirements.txt > $(OLD_VENV)/requirements.txt
	$(OLD_VENV)/bin/python scripts/install.py -r $(OLD_VENV)/requirements.txt
	$(OLD_VENV)/bin/python scripts/install.py --no-deps -e .
	touch $(OLD_STAMP)

test-oldest: $(OLD_STAMP)
	$(OLD_VENV)/bin/python -m pytest -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/strategies.py
	$(PY) benchmarks/planner.py

clean:
	rm -rf $(VENV) $(OLD_VENV) results .pytest_cache
