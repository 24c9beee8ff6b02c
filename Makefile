# The two commands of the README work on a fresh machine: each creates .venv when missing.
# These pins are for CPU CI, not the range treadle supports (pyproject.toml: torch 2.11 to 2.15): .venv holds the
# newest supported releases (constraints.txt), .venv-oldest the oldest (constraints-oldest.txt). PIP_CONSTRAINT,
# not -c: it replaces a machine-wide pip constraint (this machine caps torch at 2.14.1) instead of adding to it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OLDEST := .venv-oldest
OLDEST_STAMP := $(OLDEST)/.installed
PYTEST := -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

.PHONY: install venv demo test test-oldest bench gpu-check slurm-check clean-venv lint

# $(call venv,DIR,CONSTRAINTS): DIR holds treadle (editable, with the test extras) on the CONSTRAINTS' releases.
define venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	PIP_CONSTRAINT=$(2) $(1)/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $(1)/.installed
endef

$(STAMP): pyproject.toml constraints.txt
	$(call venv,$(VENV),constraints.txt)

$(OLDEST_STAMP): pyproject.toml constraints-oldest.txt constraints-speculators.txt
	$(call venv,$(OLDEST),constraints-oldest.txt)
	PIP_CONSTRAINT= $(OLDEST)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
		--target $(OLDEST)/speculators -r constraints-speculators.txt

install: $(STAMP)  ## create .venv (when missing) and install treadle into it, editable, with the test extras
venv: install

demo: $(STAMP)  ## train the tiny Llama on the built-in corpus, then a GLIDE draft against it, then measure tau
	$(BIN)/treadle train configs/demo.toml
	$(BIN)/treadle train configs/demo-draft.toml
	$(BIN)/treadle spec-eval --target runs/demo --draft runs/demo-draft --gamma 4 --json runs/demo-draft/spec-eval.json

test: $(STAMP)  ## the whole test suite on the newest supported torch and transformers (exit code 5, "no tests ran", counts as a failure)
	$(BIN)/python $(PYTEST)

test-oldest: $(OLDEST_STAMP)  ## the same suite on the oldest supported torch and transformers, in .venv-oldest
	$(OLDEST)/bin/python $(PYTEST)

bench: $(STAMP)  ## treadle's loop against a bare PyTorch loop; drafters compared (needs runs/demo: make demo); engines at 1 and 2 ranks; packed-document attention (dense vs varlen); a draft beside its target (step time, fresh drafts, MTP joint)
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/spec.py
	$(BIN)/python bench/scaling.py
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/draft_beside.py

gpu-check: $(STAMP)  ## one GPU, a few minutes: tiny + 1.1B Llama (bf16, compile, act. ckpt, chunked loss), torchrun/NCCL, GLIDE + EAGLE-3 drafts, spec-eval -> one table (tokens/s, MFU, peak memory) on stdout and in runs/gpu-check/gpu-check.md; no CUDA: one line, exit 0
	$(BIN)/python bench/gpu.py

slurm-check: $(STAMP)  ## as root, ~5 min: docs/cluster.md's sbatch recipe on a one-host SLURM it starts and stops (scripts/slurm_local.sh): time-limit signal -> checkpoint + requeue -> resume, scancel -> exit 75, equal losses (needs: apt-get install -y slurm-wlm munge)
	$(BIN)/python scripts/slurm_check.py

clean-venv:
	rm -rf $(VENV) $(OLDEST)
