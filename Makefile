# Two commands for a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODELS_DIR ?= models
PORT ?= 8080

.PHONY: install serve test lint format bake bench clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 exactly: its CPU wheel is on local disk (a looser pin pulls a CUDA build)
	$(PY) -m pip install --quiet -e '.[test]'
	# the sampler-side client, its own distribution (httpx + numpy): `decode --url`, its tests
	$(PY) -m pip install --quiet -e ./clients/python
	touch $(STAMP)

install: $(STAMP)

bake: $(STAMP)
	$(PY) -m app bake --synthetic --models-dir $(MODELS_DIR)

serve: $(STAMP)
	@test -n "$$(ls $(MODELS_DIR)/*/decoder.safetensors 2>/dev/null)" || $(MAKE) bake
	PORT=$(PORT) $(PY) -m app serve --models-dir $(MODELS_DIR)

# Test files whose path depends on the CPU (native bf16 or not): run again as if this CPU were
# the other kind, so both branches are tested on any machine (app/runtime/device.cpu_has_fast_bf16).
CPU_DEPENDENT_TESTS := tests/test_gate.py

test: $(STAMP)
	$(PY) -m ruff check app tests bench scripts clients/python
	$(PY) -m pytest -q
	VAE_CPU_FAST_BF16=$$($(PY) -c 'from app.runtime.device import cpu_has_fast_bf16 as f; print(int(not f()))') \
		$(PY) -m pytest -q $(CPU_DEPENDENT_TESTS)

lint: $(STAMP)
	$(PY) -m ruff check app tests bench scripts clients/python
	$(PY) -m ruff format --check app tests bench scripts clients/python

format: $(STAMP)
	$(PY) -m ruff format app tests bench scripts clients/python
	$(PY) -m ruff check --fix app tests bench scripts clients/python

bench: $(STAMP)
	$(PY) -m bench flux --size 512

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
