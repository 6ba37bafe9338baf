# Two set-up commands (README.md): `make demo` and `make test`. Both create .venv when
# missing. torch is installed first and pinned so pip takes the local CPU wheel here and
# never pulls a CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo
# The committed model trained on Python sources (issue 6, models/tiny-dsv32-trained/README.md):
# its indexer's top-128 moves the way a real one does. `make demo DEMO_MODEL=demo/tiny-dsv32`
# runs the generated random-weight model instead.
DEMO_MODEL ?= models/tiny-dsv32-trained
DEMO_TOKENS ?= 64
# ECHO's device cache in the demo: the legal minimum, 4 requests x top-k 128 (the contexts
# reach ~1,900 tokens, so every layer evicts and recalls).
DEMO_DEV_CACHE ?= 512

# The default suite (pyproject's testpaths: tests/, the product's tests, and tests/repo/, the
# repository tooling's; tests/sglang/ skips there and runs in test-sglang) runs on two
# workers (the machine's two cores); the files that launch our kernels share one worker
# with the sm_90 compile check (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: demo test test-slow test-gpu lint format venv clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -r requirements.txt -r requirements-test.txt
	$(PIP) install -q --disable-pip-version-check --no-deps -e .
	touch $@

$(DEMO_DIR)/tiny-dsv32/config.json: | $(STAMP)
	$(PY) scripts/make_tiny_checkpoint.py --out $(DEMO_DIR)/tiny-dsv32 --layers 4 --index-topk 32

# The main job on the embedded default: greedy generation with the no-offload pool, then
# with ECHO at a device cache far smaller than the contexts; outputs must be identical.
demo: $(STAMP) $(DEMO_MODEL)/config.json
	@mkdir -p $(DEMO_DIR)
	$(PY) -m sglang_echo.generate --model-path $(DEMO_MODEL) --prompts-file scripts/demo_prompts.jsonl \
		--max-new-tokens $(DEMO_TOKENS) --batch-size 4 --ignore-eos --output $(DEMO_DIR)/no-offload.jsonl
	NSA_KV_OFFLOAD=1 NSA_DEV_CACHE_SIZE=$(DEMO_DEV_CACHE) $(PY) -m sglang_echo.generate --model-path $(DEMO_MODEL) \
		--prompts-file scripts/demo_prompts.jsonl --max-new-tokens $(DEMO_TOKENS) --batch-size 4 \
		--chunked-prefill-size $(DEMO_DEV_CACHE) --ignore-eos --output $(DEMO_DIR)/offload.jsonl
	cmp $(DEMO_DIR)/no-offload.jsonl $(DEMO_DIR)/offload.jsonl && echo "demo: offload output identical to no-offload ($(DEMO_DIR)/offload.jsonl)"

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup
	@$(MAKE) --no-print-directory test-sglang

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

lint: $(STAMP)
	$(VENV)/bin/ruff format --check python tests scripts benchmark research
	$(VENV)/bin/ruff check python tests scripts benchmark research

format: $(STAMP)
	$(VENV)/bin/ruff format python tests scripts benchmark research
	$(VENV)/bin/ruff check --fix python tests scripts benchmark research

clean:
	rm -rf $(DEMO_DIR) .pytest_cache

# --- The SGLang plugin (issue 5): its tests run against the real sglang 0.5.23 in a second
# environment (sglang's pinned torch 2.14.1), built once outside the checkout and reused.
# `make test` FAILS when they do not run: the environment cannot be built (disk,
# registry), or pytest collects nothing or passes nothing (require_tests_ran.py). Only
# ECHO_SKIP_SGLANG_TESTS=1 (make variable or environment) skips them, and says so.
SGLANG_VERSION ?= 0.5.23
SGLANG_ENV ?= $(HOME)/.cache/sglang-echo/sglang-$(SGLANG_VERSION)
SGLANG_PY := $(SGLANG_ENV)/bin/python
# The environment builder and the test directory (tests/repo/test_make_sglang_gate.py points
# them at stand-ins so that it checks this gate without building anything).
SGLANG_ENV_SCRIPT ?= scripts/sglang_env.sh
SGLANG_TESTS ?= tests/sglang
ECHO_SKIP_SGLANG_TESTS ?=

.PHONY: sglang-env test-sglang

sglang-env:
	bash "$(SGLANG_ENV_SCRIPT)" "$(SGLANG_ENV)" "$(SGLANG_VERSION)" "$(CURDIR)"

ifeq ($(strip $(ECHO_SKIP_SGLANG_TESTS)),1)
test-sglang:
	@echo ""
	@echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
	@echo "!! SKIPPED BY ECHO_SKIP_SGLANG_TESTS=1: the SGLang plugin tests ($(SGLANG_TESTS))"
	@echo "!! did NOT run, so this run did not test the plugin. Unset it to run them."
	@echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
	@echo "test-sglang: SKIPPED by ECHO_SKIP_SGLANG_TESTS=1 (the SGLang plugin tests did not run)"
else
test-sglang:
	@if bash "$(SGLANG_ENV_SCRIPT)" "$(SGLANG_ENV)" "$(SGLANG_VERSION)" "$(CURDIR)"; then \
		echo "== $(SGLANG_TESTS) with sglang $(SGLANG_VERSION) ($(SGLANG_PY))"; \
		PYTHONPATH="$(CURDIR)/tests/sglang$${PYTHONPATH:+:$$PYTHONPATH}" ECHO_REQUIRE_SGLANG=1 \
			"$(SGLANG_PY)" -m pytest -q -p no:warnings -p no:cacheprovider -p require_tests_ran \
			--confcutdir="$(SGLANG_TESTS)" "$(SGLANG_TESTS)"; \
		rc=$$?; \
		if [ $$rc -ne 0 ]; then \
			echo "test-sglang: FAILED: the SGLang plugin tests failed or did not run (pytest exit $$rc: 1 = a test failed or none passed, 5 = none collected)"; \
			exit $$rc; \
		fi; \
	else \
		echo ""; \
		echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"; \
		echo "!! FAILED: the SGLang plugin tests ($(SGLANG_TESTS)) did NOT run: the sglang"; \
		echo "!! $(SGLANG_VERSION) environment could not be built (reason above)."; \
		echo "!! Retry with: make sglang-env && make test-sglang"; \
		echo "!! To accept a run without them: make test ECHO_SKIP_SGLANG_TESTS=1"; \
		echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"; \
		echo "test-sglang: FAILED: the SGLang plugin tests did not run (set ECHO_SKIP_SGLANG_TESTS=1 to skip them)"; \
		exit 1; \
	fi
endif

# The generated documents (docs/DEVELOPMENT.md): README's results, docs/EVIDENCE.md and
# docs/ERRORS.md from benchmark/evidence/, docs/CONFIGURATION.md from the registry.
.PHONY: docs
docs: $(STAMP)
	$(PY) -m benchmark.evidence --write README.md docs/EVIDENCE.md docs/ERRORS.md
	$(PY) -m sglang_echo.config --markdown > docs/CONFIGURATION.md
