# The two commands README.md promises: `make demo` (the main job) and `make test` (what CI runs:
# the type check beside the suite — mypy's half-minute on one core overlaps the suite's start —
# failing if either fails).
# Both create .venv on first use. torch is pinned to the CPU wheel on disk: an unpinned torch
# would pull a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: install demo test test-fast typecheck lint bench
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/meshtrain demo

# The suite runs on two pytest-xdist workers, a module at a time (tests/conftest.py hands out the
# modules that start processes or NAT labs first). Most of a process test's time is spent waiting
# on the daemons it starts, so two side by side keep the two cores about as busy as
# scripts/stress_suite.sh proves the suite against; the type check runs beside them. The target
# fails if the suite or the type check fails.
test: $(STAMP)
	@$(VENV)/bin/mypy > .typecheck.log 2>&1 & typecheck=$$!; \
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=20; tests=$$?; \
	wait $$typecheck; types=$$?; cat .typecheck.log; rm -f .typecheck.log; \
	test $$tests -eq 0 -a $$types -eq 0

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow and not nat"

# mypy over meshtrain/ ([tool.mypy] in pyproject.toml: collective/ and optim/ strict); under a minute cold, ~2 s warm (.mypy_cache).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

lint: $(STAMP)
	$(VENV)/bin/ruff check meshtrain tests scripts examples
	$(VENV)/bin/ruff format --check meshtrain tests scripts examples

bench: $(STAMP)
	$(PY) scripts/bench/bench_transport.py
	$(PY) scripts/bench/bench_allreduce.py
