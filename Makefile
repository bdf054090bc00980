PYTHON ?= python3

.PHONY: install demo test test-fast

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

demo: install
	$(PYTHON) -m tokenmill chat "What is the capital of France?" --max-tokens 48

# --fail-on-skip: a skipped test fails the run unless it is marked gpu (tests/conftest.py).
test: install
	$(PYTHON) -m pytest -q --fail-on-skip

test-fast: install
	$(PYTHON) -m pytest -q --fail-on-skip -m "not slow"
