# Two commands for a fresh clone (see README.md):
#   make book   build the book on the embedded default (CPU, offline): _build/html/index.html
#   make test   install and run the tests (what CI runs)
#
# Torch: TORCH_SPEC is installed first unless .venv already has a torch. The default pin matches
# the CPU wheel that this project's machines carry; elsewhere add a wheel index, e.g.
#   make book TORCH_INDEX=https://download.pytorch.org/whl/cpu            (CPU build, ~200 MB)
#   make book TORCH_SPEC=torch==2.11.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128   (GPU)
# or install any torch into .venv yourself before running make.

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
PROFILE     ?= default
PYTEST_ARGS ?=
JOBS        ?= auto

BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip

.PHONY: book test install lab browser clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(PIP) install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@touch $@

$(VENV)/.installed-%: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e ".[$*]"
	@touch $@

install: $(VENV)/.installed-book

book: $(VENV)/.installed-book
	$(BIN)/lpfa book --profile $(PROFILE)

# Debian's Chromium for the rendered-page test (the tests drive it through Playwright).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

test: $(VENV)/.installed-test browser
	$(BIN)/python -m pytest -n $(JOBS) $(PYTEST_ARGS)

lab: $(VENV)/.installed-lab $(VENV)/.installed-book
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf _build .pytest_cache
