# Two entry points; both set up .venv from the project's own files first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench lint

$(BIN)/shardpoint: pyproject.toml setup.py src/shardpoint/_native.c src/shardpoint/_native_fold.h requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	touch $(BIN)/shardpoint

setup: $(BIN)/shardpoint

demo: setup
	$(BIN)/shardpoint demo

# Two workers, each test file on one of them (a module's fixtures built once): most of the
# suite's time is processes starting and waiting on each other, so 2 workers on 2 cores run
# it in ~12 minutes instead of ~15.
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: setup
	$(BIN)/python benchmarks/save_load.py

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
