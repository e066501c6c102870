# Two commands: `make run` trains the default preset on a local Ray, `make test` runs the tests.
# Each creates .venv when missing and installs the pinned CPU torch first (an unpinned torch would
# pull a multi-GB CUDA build), then the project with its dev extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: run test install clean bench bench-learning bench-sync

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

run: $(BIN)/.installed
	$(BIN)/jointrl train --config shapes

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q --durations=25

bench: $(BIN)/.installed
	$(BIN)/python bench/perf.py

bench-learning: $(BIN)/.installed
	$(BIN)/python bench/learning.py

bench-sync: $(BIN)/.installed
	$(BIN)/python bench/sync.py

clean:
	rm -rf $(VENV) runs .pytest_cache
