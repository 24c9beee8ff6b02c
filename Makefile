# The two commands of the README work on a fresh machine: each creates .venv when missing.
# torch is pinned through constraints.txt so no other requirement can pull a CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install venv demo test bench gpu-check clean-venv lint

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)  ## create .venv (when missing) and install treadle into it, editable, with the test extras
venv: install

demo: $(STAMP)  ## train the tiny Llama on the built-in corpus, then a GLIDE draft against it, then measure tau
	$(BIN)/treadle train configs/demo.toml
	$(BIN)/treadle train configs/demo-draft.toml
	$(BIN)/treadle spec-eval --target runs/demo --draft runs/demo-draft --gamma 4 --json runs/demo-draft/spec-eval.json

test: $(STAMP)  ## the whole test suite (exit code 5, "no tests ran", counts as a failure)
	$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

bench: $(STAMP)  ## treadle's loop against a bare PyTorch loop; drafters compared (needs runs/demo: make demo); engines at 1 and 2 ranks
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/spec.py
	$(BIN)/python bench/scaling.py

gpu-check: $(STAMP)  ## one GPU, a few minutes: tiny + 1.1B Llama (bf16, compile, act. ckpt, chunked loss), torchrun/NCCL, GLIDE + EAGLE-3 drafts, spec-eval -> one table (tokens/s, MFU, peak memory) on stdout and in runs/gpu-check/gpu-check.md; no CUDA: one line, exit 0
	$(BIN)/python bench/gpu.py

clean-venv:
	rm -rf $(VENV)
