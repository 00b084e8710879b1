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

.PHONY: setup score-teacher convert-teacher train-student inspect validate vocab-overlap align-report test test-slow mutation bench gpu-bench gpu-bench-wheels repro eval-student compare clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)"))
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

score-teacher: setup
	$(PY) -m stages.score_teacher $(ARGS)

# A safetensors copy of a teacher that ships only .bin weights (then teacher.model=<printed folder>)
convert-teacher: setup
	$(PY) -m stages.convert_teacher $(ARGS)

train-student: setup
	$(PY) -m stages.train_student $(ARGS)

inspect: setup
	$(PY) -m stages.inspect $(ARGS)

validate: setup
	$(PY) -m stages.inspect command=validate $(ARGS)

vocab-overlap: setup
	$(PY) -m stages.inspect command=vocab-overlap $(ARGS)

align-report: setup
	$(PY) -m stages.inspect command=align-report $(ARGS)

test: setup
	$(PY) -m pytest -q -m "not slow"

test-slow: setup
	$(PY) -m pytest -q -m slow

# Break the core on purpose (mutation/mutants.toml) and check the default suite notices:
# mutation-results/latest.md. ARGS="only=[W1,T1]" for some mutants, ARGS="check=true" to check the table.
mutation: setup
	$(PY) -m mutation $(ARGS)

bench: setup
	$(PY) -m benchmarks $(ARGS)

# The GPU paths at full scale (7B teacher scoring, 1.1B training step, data pipeline per core):
# bench-results/gpu-latest.{json,md}; settings in conf/gpu_bench.yaml. Needs only torch, transformers,
# accelerate, pyarrow, Hydra and OmegaConf, so it runs with the machine's own Python (no make setup, no
# network; Hydra's wheels: make gpu-bench-wheels here, then there pip install --no-index --find-links
# .gpu-wheels hydra-core); run it with a vLLM environment's Python (GPU_PYTHON=/path/to/vllm-env/bin/python)
# to add the vLLM backend. ARGS="smoke=true": tiny shapes on CPU; ARGS="skip=[vllm,data]": some parts only.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-bench:
	$(GPU_PYTHON) -m benchmarks.gpu $(ARGS)

# Wheels of Hydra, OmegaConf and ANTLR's runtime (pure Python, the versions in $(VENV)) for a GPU
# machine that lacks them: .gpu-wheels/ (see benchmarks/gpu.py)
GPU_WHEELS := hydra-core omegaconf antlr4-python3-runtime
gpu-bench-wheels: setup
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir .gpu-wheels $$($(PY) -c 'import sys, importlib.metadata as m; print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' $(GPU_WHEELS))

# Few-shot chain-of-thought math accuracy of a checkpoint; results side by side
eval-student: setup
	$(PY) -m stages.eval_student $(ARGS)

compare: setup
	$(PY) -m stages.compare_evals $(ARGS)

# The paper's claims at toy scale (stage 1 + stage 2 + evaluation; design in conf/repro.yaml):
# repro-results/report.md, the claims table alone in repro-results/summary.md
repro: setup
	$(PY) -m repro $(ARGS)

clean:
	rm -rf outputs .pytest_cache
