# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install, train a small model with async checkpoints (run it twice: it resumes)
#   make test   - create .venv, install, run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

NEWEST := .venv-newest
NEWEST_STAMP := $(NEWEST)/.installed

.PHONY: demo test test-newest lint install bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[xla,gcs,s3,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PJRT_DEVICE=CPU $(PY) examples/train.py $(ARGS)

test: $(STAMP) lint
	PJRT_DEVICE=CPU $(PY) -m pytest -q -ra $(PYTEST_ARGS)

# The same suite on the newest torch the registry serves (constraints-newest.txt), without
# torch_xla (it pins torch 2.9.0): XLA tests skip; with torchtitan (it needs torch >= 2.11: the
# torch 2.9 leg skips tests/frameworks/test_torchtitan.py). CI runs it after `make test`.
$(NEWEST_STAMP): pyproject.toml constraints-newest.txt
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q -c constraints-newest.txt -e ".[gcs,s3,dev]"
	# torchtitan and datasets without their dependencies: datasets 4.7's pins would hold fsspec, gcsfs
	# and s3fs back (2026.2.0); what torchtitan's trainer, checkpointer and models import is added by name.
	$(NEWEST)/bin/python -m pip install -q -c constraints-newest.txt --no-deps torchtitan==0.3.0 spmd_types==0.2.3 datasets==4.7.0
	$(NEWEST)/bin/python -m pip install -q -c constraints-newest.txt "tyro>=0.9" torchdata "pyarrow>=21.0.0" \
		"dill>=0.3.0,<0.4.1" "multiprocess<0.70.19" pandas xxhash "httpx<1.0.0"
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP)
	$(NEWEST)/bin/python -c "import torch; print('test-newest: torch', torch.__version__)"
	PJRT_DEVICE=CPU $(NEWEST)/bin/python -m pytest -q -ra $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check async_ckpt
	$(VENV)/bin/mypy async_ckpt

bench: $(STAMP)
	PJRT_DEVICE=CPU $(PY) benchmarks/bench_save.py $(ARGS)

clean:
	rm -rf checkpoints
