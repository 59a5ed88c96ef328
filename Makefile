# Two commands for a fresh machine with only Python: `make demo` and `make test`.
# Both create .venv and install the pinned requirements first; an install is skipped while its
# requirements file is unchanged (a stamp file named after its hash).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
REQ_HASH := $(shell cat requirements.txt | sha1sum | cut -c1-12)
DEV_HASH := $(shell cat requirements.txt requirements-dev.txt requirements-rewards.txt | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQ_HASH)
DEV_STAMP := $(VENV)/.dev-installed-$(DEV_HASH)
FLAG_SOURCES := train_grpo:GRPOConfig train_sft:SFTConfig evaluate:EvalConfig train_mixgrpo:MixGRPOConfig distill:DistillConfig iterate:IterateConfig vllm_serve:ServeConfig

.PHONY: install install-dev demo test test-full test-unit test-build lint docs

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	rm -f $(VENV)/.installed-* && touch $(STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.txt requirements-rewards.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	rm -f $(VENV)/.dev-installed-* && touch $(DEV_STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

demo: install
	$(VENV)/bin/accelerate launch train_grpo.py

lint: install-dev
	$(VENV)/bin/ruff check .

# The test tiers (fast, full, unit, build) and what each runs: docs/testing.md.
test: lint
	$(PY) -m pytest -q -m "not full and not build"

# The full tier on two workers, one test file each at a time: half its launches are one process of one thread.
test-full: lint
	$(PY) -m pytest -q -m "full and not build" -n 2 --dist loadfile

test-unit: lint
	$(PY) -m pytest -q -m "not slow and not full and not build"

test-build: lint
	$(PY) -m pytest -q -m build

# docs/flags.md is generated from the config dataclasses; tests/test_docs.py fails when it is stale.
docs: install
	$(PY) -m utils.core.config docs/flags.md $(FLAG_SOURCES)
