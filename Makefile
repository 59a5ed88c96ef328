# Two commands for a fresh machine with only Python: `make demo` and `make test`.
# Both create .venv and install requirements.txt first; the install is skipped while
# requirements.txt is unchanged (a stamp file named after its hash).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
REQ_HASH := $(shell sha1sum requirements.txt | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQ_HASH)

.PHONY: install demo test test-fast bench

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/accelerate launch train_grpo.py

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"
