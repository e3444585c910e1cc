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
	@# a fresh clone: bake without the gate references (the first start computes them after
	@# /readyz is 200 and stores them); `make bake` computes them at once
	@test -n "$$(ls $(MODELS_DIR)/*/decoder.safetensors 2>/dev/null)" || \
		$(PY) -m app bake --synthetic --no-references --models-dir $(MODELS_DIR)
	PORT=$(PORT) $(PY) -m app serve --models-dir $(MODELS_DIR)

# The whole suite once. The tests whose run reads the bf16 candidate order (marked
# `bf16_order`; a test that reads it unmarked fails, tests/order.py) run twice in it, in this
# machine's order and in the other (VAE_CPU_FAST_BF16, app/runtime/modes.py): on any machine
# every order-dependent outcome is checked in both orders. One test process per core plus two
# (pytest-xdist; the suite spends about half its time waiting on servers, readers and sleeps,
# so two more processes fill the cores): the tests pick free ports and temporary folders. `--dist
# worksteal`: each worker starts on one contiguous part of the suite (a module's shared server
# or import is built once, not once per worker) and an idle worker takes half of another's
# queue. Measured times: docs/BENCHMARKS.md.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 2 )))
PYTEST_XDIST = -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(PY) -m ruff check app tests bench scripts clients/python
	$(PY) -m pytest -q $(PYTEST_XDIST)

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
