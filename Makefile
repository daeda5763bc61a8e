# Two commands for a new user: `make tune` (the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: tune test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[cpu,dev,torchrec]"
	$(BIN)/pip install -q --no-deps torchrec==1.8.0  # its declared fbgemm-gpu (CUDA) would replace fbgemm-gpu-cpu
	$(BIN)/python -m cubic_kernels.native_backend  # compile the native kernels into numba's cache once
	$(BIN)/python -m cubic_harness.synthetic  # ... and the synthetic batches' (harness/synthetic.py)
	touch $(STAMP)

SEED ?= 0
RUN_DIR ?= runs/dlrm_cpu
QUALITY_STORE ?= runs/quality.db
tune: $(STAMP)  # make tune [SEED=1 RUN_DIR=runs/seed1]: another searcher seed, in its own study
	mkdir -p $(dir $(QUALITY_STORE))
	$(BIN)/cubic tune --space search_spaces/dlrm_cpu.yaml --run-dir $(RUN_DIR) --seed $(SEED) \
		--quality-store $(QUALITY_STORE)  # quality runs paid once, shared by every make tune

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile --no-loadscope-reorder --durations=15 -m "not slow"  # a file's tests share a worker

test-slow: $(STAMP)  # the long end-to-end tests `make test` leaves out
	$(BIN)/python -m pytest -q -x --durations=15 --timeout=1800 -m slow

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_torchrec.py

clean:
	rm -rf $(VENV) runs
