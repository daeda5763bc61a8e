# Two commands for a new user: `make tune` (the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: tune test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[cpu,dev]"
	$(BIN)/python -m kernels.native_backend  # compile the native kernels into numba's cache once
	touch $(STAMP)

tune: $(STAMP)
	$(BIN)/cubic tune --space search_spaces/dlrm_cpu.yaml --run-dir runs/dlrm_cpu

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -x --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_torchrec.py

clean:
	rm -rf $(VENV) runs
