PYTHON ?= python3

.PHONY: install install-test demo lint test test-all

# Runtime dependencies only.
install:
	PYTHON=$(PYTHON) bash scripts/install.sh

# Runtime dependencies plus the test extras.
install-test:
	PYTHON=$(PYTHON) bash scripts/install.sh --test

demo: install
	$(PYTHON) -m tokenmill chat "What is the capital of France?" --max-tokens 48

# ruff's lint rules are in pyproject.toml ([tool.ruff.lint]).
lint:
	$(PYTHON) -m ruff check .

# --fail-on-skip: a skipped test fails the run unless it is marked gpu (tests/conftest.py).
# The suite CI runs: everything but the tests marked slow (more stress seeds, the long
# speculative-decoding guard, lm-eval).
test: install-test lint
	$(PYTHON) -m pytest -q --fail-on-skip -m "not slow"

# Everything, the slow tests included.
test-all: install-test lint
	$(PYTHON) -m pytest -q --fail-on-skip
