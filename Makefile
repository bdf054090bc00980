PYTHON ?= python3

.PHONY: install demo test test-fast

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

demo: install
	$(PYTHON) -m tokenmill chat "What is the capital of France?" --max-tokens 48

test: install
	$(PYTHON) -m pytest -q

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"
