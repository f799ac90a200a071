# The README's two commands: `make demo` and `make test`. Each builds .venv from the pinned constraints first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_OUT ?= rangefinder-demo
PYTEST_ARGS ?=

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, exactly pinned: here it resolves to the local CPU wheel, elsewhere to the normal build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rangefinder demo --out $(DEMO_OUT)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
