# The two commands a fresh clone needs (see README):
#   make demo   - capture a small model with %%chakra_trace in a headless notebook
#   make test   - the whole test suite (installs Debian chromium for the browser tests)
# Both create and reuse .venv, installing everything pinned by constraints.txt.

PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test venv browser clean

$(STAMP): pyproject.toml setup.py constraints.txt scripts/setup_venv.sh tracemagic/trace/_scan.c tracemagic/trace/_nesting.c
	PY=$(PY) bash scripts/setup_venv.sh
	touch $(STAMP)

venv: $(STAMP)

browser:
	bash scripts/install_chromium.sh

demo: $(STAMP)
	$(VPY) -m tracemagic demo demo-output

test: $(STAMP) browser
	$(VPY) -m pytest -ra --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) demo-output artifacts .pytest_cache
