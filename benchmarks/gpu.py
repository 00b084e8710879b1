"""``make gpu-bench``: the GPU paths at full scale, side by side in one run, with random weights,
and a trained teacher on real text where one is given.

Needs only torch, transformers, accelerate, pyarrow, and Hydra and OmegaConf for its configuration
(no Ray, Polars or datasets, no network), so it runs on a bare GPU machine::

    python -m benchmarks.gpu                  # writes bench-results/gpu-latest.json and .md
    python -m benchmarks.gpu smoke=true       # tiny shapes on CPU in seconds (code paths only)
    python -m benchmarks.gpu skip=[vllm,data] repeats=3 peak_tflops=989.4 out=bench-results/h100
    python -m benchmarks.gpu real_teacher=SmolLM2-135M-Instruct.Q4_1.gguf real_text=[a.parquet,b.parquet]
    python -m benchmarks.gpu merge=[run-a.json,run-b.json]     # two runs on one machine, one report

Settings: :class:`GpuBenchConfig` (``conf/gpu_bench.yaml`` overrides it; ``make gpu-bench
ARGS="smoke=true"``). Hydra and OmegaConf are pure Python: ``make gpu-bench-wheels`` writes their
wheels (hydra-core, omegaconf, antlr4-python3-runtime, and gguf for a GGUF teacher, the versions of
this project's environment) to ``.gpu-wheels/``; copy the repository with that folder to the GPU
machine and there run ``pip install --no-index --find-links .gpu-wheels hydra-core gguf`` (PyYAML,
packaging, requests and tqdm, which they also need, come with transformers).

Each part runs in a child process of its own with a time limit (``part_timeout_s``, else
:data:`PART_TIMEOUT_S`): a part that hangs or runs out of memory is recorded as such and the
others still run, each on a GPU with nothing of the previous part left in it. The report is
written again after every part, so a run stopped half-way keeps what it measured.

What is measured (after warm-up, CUDA-synchronised, the sides of each part interleaved A B, B A, ...):

* ``scoring``: teacher scoring at the Qwen2.5-7B shape (28 layers, hidden 3584, vocab 152,064) in
  bf16, on full windows of 2048 and 4096 random tokens (``score_windows``, the same tokens per
  repeat for each): a bare forward (``model(...).logits``, bf16 logits of every position, no loss)
  and the project's :class:`pipeline.score_teacher.backends.hf.TransformersScorer` (backbone, then
  float32 log-softmax over bounded chunks of the output head); tokens/s, MFU, peak memory;
* ``real_shape``: the same two sides at the real teacher's shape (SmolLM2-135M: 30 layers, hidden
  576, vocab 49,152, tied output head), where the output head is a third of the work;
* ``precision``: the Qwen2.5-7B shape in float32 and then the same weights in bfloat16 on the same
  windows: per-token loss differences and the share of top-40% selections that flip
  (:mod:`pipeline.inspection.parity`, the measures of ``inspect command=compare``). Random weights
  give near-uniform predictions, where a flip means little: the ``real_teacher`` part is the test;
* ``real_teacher`` (with ``real_teacher=`` a GGUF file or model folder and ``real_text=`` files of
  documents): stage 1's own path (corpus reader, tokenizer, window plan, stitching) with a trained
  teacher in float32 and in bfloat16 on the GPU, per file: tokens/s, the teacher's loss and bits
  per byte, the bf16/fp32 differences and flips; the per-token losses of the first
  ``real_keep_losses`` documents of each file go to ``<out>-real-losses.parquet``, for a comparison
  with the same documents scored elsewhere (a CPU's stage 1);
* ``training``: the student training step at the TinyLlama 1.1B shape, sequence 2048: float32
  master weights, bf16 autocast (what the Trainer's ``bf16=True`` does), fused AdamW, with the
  project's loss in ``guided`` mode and in ``cpt`` mode (:func:`pipeline.method.guided_loss.guided_loss`);
* ``data``: the student data pipeline (read + tokenize + align + pack, :mod:`pipeline.student_data.build`)
  in one process over a scored dataset written here (generated math text, random teacher losses),
  as packed tokens per CPU-second, next to the GPU's training tokens/s: the CPU cores one GPU needs;
* ``vllm``: where ``vllm`` imports, the project's :class:`pipeline.score_teacher.backends.vllm.VLLMScorer`
  at the Qwen2.5-7B shape (``load_format="dummy"``: random weights, no checkpoint).

FLOPs per token follow the PaLM appendix: forward ``2 N + 4 L d T`` with ``N`` the weights of the
linear layers (output head included, embedding excluded), ``L`` layers, ``d`` the attention width,
``T`` the sequence length (attention counted as if not causal); a training step is three forwards.
MFU = achieved FLOP/s / the GPU's dense bf16 peak (a table by device name, or ``peak_tflops``).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

from omegaconf import DictConfig

from benchmarks.results import figure, markdown_table
from pipeline.runtime.config import ConfigError, build, check_at_least, check_choice, raise_if
from stages.common import entry_point
from storage_schemas import strict_json

SHAPES = {
    "qwen2.5-7b": dict(arch="qwen2", vocab_size=152_064, hidden_size=3584, intermediate_size=18_944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32_768),
    "tinyllama-1.1b": dict(arch="llama", vocab_size=32_000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           max_position_embeddings=2048),
    # SmolLM2-135M (HuggingFaceTB/SmolLM2-135M's config): the real teacher of the real-model study
    "smollm2-135m": dict(arch="llama", vocab_size=49_152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, tie=True),
    "smoke-teacher": dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "smoke-tied": dict(arch="llama", vocab_size=448, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=128, tie=True),
    "smoke-student": dict(arch="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
}

# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets; SXM parts where a name is ambiguous).
PEAK_BF16_TFLOPS = (
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("GH200", 989.4),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("RTX 4090", 165.2), ("RTX A6000", 154.8), ("B200", 2250.0),
)


# In the order they run: vLLM first, on a GPU nothing else has touched yet
PARTS = ("vllm", "scoring", "real_shape", "precision", "training", "real_teacher", "data")
PART_TIMEOUT_S = {"vllm": 480, "scoring": 300, "real_shape": 150, "precision": 180, "training": 180,
                  "real_teacher": 360, "data": 300}
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class GpuBenchConfig:
    """What ``python -m benchmarks.gpu`` runs; the sizes of a full and a smoke run are
    :class:`Settings` and :data:`SMOKE`."""

    smoke: bool = False  # tiny shapes on CPU: the code paths, in seconds
    device: str | None = None  # None: cuda (cpu for a smoke run)
    dtype: str | None = None  # None: bfloat16 (float32 for a smoke run on CPU, where bf16 is slow)
    peak_tflops: float | None = None  # the device's dense bf16 peak; None: PEAK_BF16_TFLOPS by device name
    skip: list[str] = field(default_factory=list)  # parts left out (PARTS)
    repeats: int | None = None  # None: the mode's (Settings.repeats)
    part_timeout_s: int | None = None  # one time limit for every part; None: PART_TIMEOUT_S's
    teacher_tokenizer: str | None = None  # tokenizer folder/file for the data part; None: one trained here
    student_tokenizer: str | None = None  # e.g. TinyLlama's tokenizer folder; None: one trained here
    real_teacher: str | None = None  # a trained teacher: a .gguf file or a model folder (real_teacher part)
    real_text: list[str] = field(default_factory=list)  # Parquet/JSONL files of documents it scores
    real_keep_losses: int = 200  # documents per file whose per-token losses are written (<out>-real-losses.parquet)
    out: str | None = None  # prefix of the .json/.md; None: bench-results/gpu-latest (gpu-smoke for a smoke run)
    merge: list[str] = field(default_factory=list)  # reports (.json) of runs on one machine, merged into out
    cross_check: str | None = None  # a <out>-real-losses.parquet: its documents scored again here (cross_check_*)
    cross_check_docs: int = 12  # documents per file scored again (the first ones of at most cross_check_max_tokens)
    cross_check_max_tokens: int = 2048
    part_child: str | None = None  # internal: the JSON task of a part's child process

    def problems(self) -> list[str]:
        problems: list[str] = []
        if self.dtype is not None:
            check_choice(problems, "dtype", self.dtype, DTYPES)
        problems += [f"skip: {part!r} is not one of {', '.join(PARTS)}" for part in self.skip if part not in PARTS]
        check_at_least(problems, "repeats", self.repeats, 1)
        check_at_least(problems, "part_timeout_s", self.part_timeout_s, 1)
        check_at_least(problems, "real_keep_losses", self.real_keep_losses, 0)
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            problems.append(f"peak_tflops: {self.peak_tflops} must be > 0")
        if self.real_teacher is not None and not self.real_text:
            problems.append("real_text: the real_teacher part needs files of documents to score (real_text=[a.parquet])")
        problems += [f"merge: {path} is not a file" for path in self.merge if not Path(path).is_file()]
        if self.cross_check is not None:
            if not Path(self.cross_check).is_file():
                problems.append(f"cross_check: {self.cross_check} is not a file (a <out>-real-losses.parquet)")
            if not self.real_teacher or not self.real_text:
                problems.append("cross_check: needs real_teacher= (the same teacher: its .gguf or converted folder) "
                                "and real_text=[...] (the files the GPU run scored)")
        check_at_least(problems, "cross_check_docs", self.cross_check_docs, 1)
        check_at_least(problems, "cross_check_max_tokens", self.cross_check_max_tokens, 1)
        return problems


def gpu_bench_config(cfg: DictConfig) -> GpuBenchConfig:
    """The typed configuration; every problem is reported at once."""
    from omegaconf import OmegaConf

    problems: list[str] = []
    typed = build(GpuBenchConfig, OmegaConf.to_container(cfg, resolve=True), "", problems)
    raise_if(problems)
    return typed


@dataclass(frozen=True)
class Settings:
    teacher: str = "qwen2.5-7b"
    student: str = "tinyllama-1.1b"
    real_shape: str = "smollm2-135m"
    score_windows: tuple[int, ...] = (2048, 4096)  # the paper teachers' window is 4096
    score_batch_tokens: int = 16_384  # padded tokens per forward (scorer.max_batch_tokens' default)
    score_batches: int = 8  # forward batches per timed repeat
    real_shape_window: int = 2048  # the smollm2-135m preset's window
    precision_windows: int = 4  # windows of the largest score window, scored in float32 and in bfloat16
    real_window: int = 2048  # the real teacher's window plan (the smollm2-135m preset's)
    real_stride: int = 1024
    selection_ratio: float = 0.4  # the share whose flips are counted (the guided loss's ratio)
    train_seq: int = 2048
    train_micro_batch: int = 8  # the paper recipe's micro batch per GPU
    data_text_bytes: int = 8 * 2**20  # text of the scored dataset the data pipeline reads
    teacher_vocab: int = 32_000  # stand-in tokenizers trained here, unless paths are given
    student_vocab: int = 32_000
    repeats: int = 5
    warmup: int = 2
    vllm_gpu_memory_utilization: float = 0.85


SMOKE = Settings(teacher="smoke-teacher", student="smoke-student", real_shape="smoke-tied", score_windows=(32, 64),
                 score_batch_tokens=256, score_batches=2, real_shape_window=64, precision_windows=2, real_window=64,
                 real_stride=32, train_seq=64, train_micro_batch=2, data_text_bytes=48 * 2**10, teacher_vocab=600,
                 student_vocab=600, repeats=2, warmup=1)

GOALS = {  # key: (measure, target, op)
    "scorer_over_bare": ("teacher scoring: scorer tokens/s / bare forward tokens/s", 0.95, ">="),
    "scorer_mfu": ("teacher scoring: scorer MFU", 0.60, ">="),
    "scoring_memory": ("teacher scoring: peak memory / GPU memory", 1.0, "<="),
    "guided_over_cpt": ("training step: guided time / cpt time", 1.02, "<="),
}


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


# ---------------------------------------------------------------------------------------------
# Models and FLOPs


def build_model(shape: str, dtype, device):
    """A random-weight causal LM of the named shape, built directly on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = dict(SHAPES[shape])
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[spec.pop("arch")]
    config = config_cls(**spec, tie_word_embeddings=spec.pop("tie", False), use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def flops_per_token(model, seq_len: int) -> dict:
    """PaLM's count (module docstring) from the model's own linear layers and config."""
    import torch

    cfg = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    width = cfg.num_attention_heads * head_dim
    forward = 2 * linear + 4 * cfg.num_hidden_layers * width * seq_len
    return {"parameters": sum(p.numel() for p in model.parameters()), "linear_parameters": linear,
            "seq_len": seq_len, "forward": forward, "train_step": 3 * forward}


def throughput(tokens: int, seconds: list[float], flops: int, peak: float | None) -> dict:
    tps = tokens / statistics.median(seconds)
    return {"tokens_per_s": tps, "tflops": tps * flops / 1e12, "mfu": tps * flops / (peak * 1e12) if peak else None,
            "seconds": seconds}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(sides: dict, device, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Wall seconds of each side per repeat, the order alternating (A B, B A, ...)."""
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name]()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            sides[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def paired(numerator: list[float], denominator: list[float]) -> dict:
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _memory(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    total = torch.cuda.get_device_properties(device).total_memory
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_allocated_gib": peak / 2**30, "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "total_gib": total / 2**30, "peak_fraction": peak / total}


def _reset_memory(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _tf32(device, on: bool) -> None:
    """TensorFloat-32 for float32 matrix products: on for the bf16 parts (their float32 odds and
    ends), off where float32 is the measure (torch's default, what stage 1 runs with)."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = on


# ---------------------------------------------------------------------------------------------
# The parts


def random_windows(n: int, length: int, vocab: int, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length, dtype=np.int64) for _ in range(n)]


def bench_scoring(s: Settings, device, dtype_name: str, peak: float | None, shape: str,
                  windows: tuple[int, ...]) -> dict:
    """Bare forward against the project's scorer at each window length, one model."""
    import numpy as np
    import torch

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer, batches_by_tokens

    _reset_memory(device)
    _tf32(device, True)
    model = build_model(shape, getattr(torch, dtype_name), device).eval()
    out = {"shape": shape, "architecture": SHAPES[shape], "dtype": dtype_name, "batch_tokens": s.score_batch_tokens,
           "by_window": {}}
    for window in windows:
        _reset_memory(device)
        flops = flops_per_token(model, window)
        per_batch = max(1, s.score_batch_tokens // window)
        batch = random_windows(per_batch * s.score_batches, window, model.config.vocab_size)
        scorer = TransformersScorer(ScorerConfig(dtype=dtype_name, device=str(device), window=window,
                                                 max_batch_tokens=s.score_batch_tokens), model=model)
        groups = batches_by_tokens([len(w) for w in batch], s.score_batch_tokens)
        tensors = [torch.from_numpy(np.stack([batch[i] for i in g])).to(device) for g in groups]

        @torch.inference_mode()
        def bare():
            for ids in tensors:
                model(input_ids=ids, use_cache=False).logits  # (B, T, V) bf16, every position

        times = interleaved({"scorer": lambda: scorer.score(batch), "bare_forward": bare}, device, s.repeats,
                            s.warmup)
        tokens = len(batch) * window
        out["by_window"][str(window)] = {
            "window": window, "flops_per_token": flops, "tokens_per_repeat": tokens,
            "scorer": throughput(tokens, times["scorer"], flops["forward"], peak),
            "bare_forward": throughput(tokens, times["bare_forward"], flops["forward"], peak),
            "scorer_over_bare": paired(times["bare_forward"], times["scorer"]), "memory": _memory(device)}
        del scorer, tensors
    del model
    return out


def loss_differences(first: list, second: list, ratio: float) -> dict:
    """``inspect command=compare``'s per-token measures between two scorings of the same sequences
    (each a document): |difference| max / p99 / mean, and the share of tokens whose selection by a
    flat student at ``ratio`` flips (:mod:`pipeline.inspection.parity`)."""
    from pipeline.inspection.parity import Differences, flat_student_selection

    diff = Differences()
    for a, b in zip(first, second):
        diff.add(a, b, flat_student_selection(a, ratio), flat_student_selection(b, ratio))
    return diff.to_dict()


def bench_precision(s: Settings, device, peak: float | None) -> dict:
    """The same random weights and windows scored in float32, then in bfloat16."""
    import torch

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer

    _reset_memory(device)
    window = max(s.score_windows)
    model = build_model(s.teacher, torch.float32, device).eval()
    flops = flops_per_token(model, window)["forward"]
    batch = random_windows(s.precision_windows, window, model.config.vocab_size, seed=1)
    out = {"shape": s.teacher, "window": window, "windows": len(batch), "ratio": s.selection_ratio,
           "note": "random weights: near-uniform predictions, so selections rest on tiny differences; "
                   "the real_teacher part measures a trained model"}
    losses = {}
    for name in ("float32", "bfloat16"):
        _tf32(device, False)
        if name == "bfloat16":
            model = model.to(torch.bfloat16)  # the same weights, rounded
        scorer = TransformersScorer(ScorerConfig(dtype=name, device=str(device), window=window,
                                                 max_batch_tokens=s.score_batch_tokens), model=model)
        times = interleaved({name: lambda: scorer.score(batch)}, device, max(1, s.repeats - 2), 1)
        losses[name] = scorer.score(batch)
        out[name] = {**throughput(window * len(batch), times[name], flops, peak), "memory": _memory(device)}
        _reset_memory(device)
    out["differences"] = loss_differences(losses["float32"], losses["bfloat16"], s.selection_ratio)
    del model
    return out


def load_teacher(path: str, device, dtype_name: str = "float32"):
    """A trained teacher and its tokenizer from a model folder, or from a ``.gguf`` file
    (transformers dequantizes it: float32 weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.method.tokenization import load_tokenizer

    p = Path(path)
    tokenizer = load_tokenizer(str(p))
    kwargs = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(str(p.parent if kwargs else p), dtype=getattr(torch, dtype_name),
                                                 **kwargs)
    return model.to(device).eval(), tokenizer


def read_documents(path: str) -> list:
    """Every document of one file, read as stage 1 reads it (ids ``<file name>:<row>``)."""
    from pipeline.score_teacher.corpus import CorpusConfig
    from pipeline.score_teacher.shards import plan_shards, read_shard
    from pipeline.score_teacher.corpus_sources import resolve_sources

    sources = resolve_sources(CorpusConfig(files=[path]))
    return [doc for spec in plan_shards(sources, rows_per_shard=10**9) for doc in read_shard(spec)]


def bench_real_teacher(s: Settings, device, cfg: GpuBenchConfig, losses_path: Path) -> dict:
    """Stage 1's path with a trained teacher on real documents, float32 then bfloat16."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer
    from pipeline.score_teacher.teacher import WindowSettings, score_documents
    from pipeline.method.tokenization import bos_token_id

    if not cfg.real_teacher:
        return {"skipped": "no trained teacher given (real_teacher=<file.gguf or model folder>, real_text=[files])"}
    _reset_memory(device)
    t0 = time.perf_counter()
    model, tokenizer = load_teacher(cfg.real_teacher, device)
    settings = WindowSettings(window=s.real_window, stride=s.real_stride, bos_id=bos_token_id(tokenizer))
    out = {"teacher": cfg.real_teacher, "load_seconds": time.perf_counter() - t0,
           "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
           "windows": asdict(settings), "ratio": s.selection_ratio, "files": {}}
    docs = {Path(f).name: read_documents(f) for f in cfg.real_text}
    results: dict[str, dict] = {name: {} for name in docs}
    for dtype_name in ("float32", "bfloat16"):
        _tf32(device, False)
        if dtype_name == "bfloat16":
            model = model.to(torch.bfloat16)  # the same weights, rounded
        scorer = TransformersScorer(ScorerConfig(dtype=dtype_name, device=str(device), window=s.real_window),
                                    model=model)
        score_documents(docs[next(iter(docs))][:8], tokenizer, scorer, settings)  # warm-up
        for name, file_docs in docs.items():
            _sync(device)
            t1 = time.perf_counter()
            results[name][dtype_name] = score_documents(file_docs, tokenizer, scorer, settings).documents
            _sync(device)
            results[name][f"{dtype_name}_seconds"] = time.perf_counter() - t1
        out[f"{dtype_name}_memory"] = _memory(device)
    kept = []
    for name, r in results.items():
        fp32, bf16 = r["float32"], r["bfloat16"]
        if [d.doc_id for d in fp32] != [d.doc_id for d in bf16] or any(
                not np.array_equal(a.ids, b.ids) for a, b in zip(fp32, bf16)):
            raise RuntimeError(f"{name}: the two precisions stored other documents or tokens")
        tokens = sum(len(d.ids) for d in fp32)
        losses = np.concatenate([d.losses for d in fp32]) if fp32 else np.zeros(0, np.float32)
        finite = losses[np.isfinite(losses)].astype(np.float64)
        text_bytes = sum(len(d.text.encode()) for d in fp32 if d.text)
        out["files"][name] = {
            "documents": len(fp32), "tokens": tokens, "text_bytes": text_bytes,
            **{f"{k}_tokens_per_s": tokens / r[f"{k}_seconds"] for k in ("float32", "bfloat16")},
            **{f"{k}_seconds": r[f"{k}_seconds"] for k in ("float32", "bfloat16")},
            "mean_loss_nats": float(finite.mean()) if finite.size else None,
            "bits_per_byte": float(finite.sum() / math.log(2) / text_bytes) if text_bytes else None,
            "bits_per_byte_note": "the first token of each document has no loss and is left out",
            "differences": loss_differences([d.losses for d in fp32], [d.losses for d in bf16], s.selection_ratio)}
        for a, b in list(zip(fp32, bf16))[:cfg.real_keep_losses]:
            kept.append({"file": name, "doc_id": a.doc_id, "text_sha256": _sha256(a.text), "ids": a.ids,
                         "loss_float32": a.losses, "loss_bfloat16": b.losses})
    if kept:
        table = pa.Table.from_pylist(kept, schema=pa.schema([
            ("file", pa.string()), ("doc_id", pa.string()), ("text_sha256", pa.string()),
            ("ids", pa.list_(pa.int32())), ("loss_float32", pa.list_(pa.float32())),
            ("loss_bfloat16", pa.list_(pa.float32()))],
            metadata={"window": str(settings.window), "stride": str(settings.stride)}))
        pq.write_table(table, losses_path, compression="zstd")
        out["losses_file"] = {"path": losses_path.name, "documents": len(kept)}
    all_tokens = sum(f["tokens"] for f in out["files"].values())
    for k in ("float32", "bfloat16"):
        out[f"{k}_tokens_per_s"] = all_tokens / sum(f[f"{k}_seconds"] for f in out["files"].values())
    out["differences"] = loss_differences([d.losses for r in results.values() for d in r["float32"]],
                                          [d.losses for r in results.values() for d in r["bfloat16"]],
                                          s.selection_ratio)
    del model, scorer
    return out


def cross_check(cfg: GpuBenchConfig) -> dict:
    """The documents of a ``real_teacher`` run's losses file scored again by stage 1's path on this
    machine (``device``, float32 unless ``dtype``): the first ``cross_check_docs`` of each file with
    at most ``cross_check_max_tokens`` tokens. The same text (sha256) and token ids are required;
    the per-token differences from the other machine's float32 and bfloat16 losses are reported."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer
    from pipeline.score_teacher.teacher import WindowSettings, score_documents
    from pipeline.method.tokenization import bos_token_id

    s = Settings()
    table = pq.read_table(cfg.cross_check)
    meta = table.schema.metadata or {}  # the window plan it was scored with (a full run's where not recorded)
    window, stride = int(meta.get(b"window", s.real_window)), int(meta.get(b"stride", s.real_stride))
    stored = table.to_pylist()
    picked: dict[str, list[dict]] = {}
    for row in stored:
        rows = picked.setdefault(row["file"], [])
        if len(rows) < cfg.cross_check_docs and len(row["ids"]) <= cfg.cross_check_max_tokens:
            rows.append(row)
    texts = {Path(f).name: f for f in cfg.real_text}
    missing = sorted(set(picked) - set(texts))
    if missing:
        raise ConfigError(f"cross_check: {cfg.cross_check} holds documents of {missing}, which real_text does not name")
    device = torch.device(cfg.device or "cpu")
    dtype_name = cfg.dtype or "float32"
    t0 = time.perf_counter()
    model, tokenizer = load_teacher(cfg.real_teacher, device, dtype_name)
    settings = WindowSettings(window=window, stride=stride, bos_id=bos_token_id(tokenizer))
    scorer = TransformersScorer(ScorerConfig(dtype=dtype_name, device=str(device), window=window), model=model)
    here, there32, there16, tokens = [], [], [], 0
    for name, rows in picked.items():
        by_id = {doc.doc_id: doc for doc in read_documents(texts[name])}
        docs = []
        for row in rows:
            doc = by_id.get(row["doc_id"])
            if doc is None or _sha256(doc.text) != row["text_sha256"]:
                raise ConfigError(f"cross_check: {texts[name]} has no document {row['doc_id']} with the text the "
                                  "other machine scored (sha256 differs or the row is gone)")
            docs.append(doc)
        for row, scored in zip(rows, score_documents(docs, tokenizer, scorer, settings).documents):
            if scored.doc_id != row["doc_id"] or list(scored.ids) != list(row["ids"]):
                raise RuntimeError(f"cross_check: {row['doc_id']}: this machine's tokenizer gives other token ids "
                                   "than the other machine's; the losses do not compare")
            here.append(scored.losses)
            there32.append(np.asarray(row["loss_float32"], dtype=np.float32))
            there16.append(np.asarray(row["loss_bfloat16"], dtype=np.float32))
            tokens += len(row["ids"])
    return {"losses_file": Path(cfg.cross_check).name, "teacher": cfg.real_teacher, "device": str(device),
            "dtype": dtype_name, "machine": machine(device, None), "seconds": time.perf_counter() - t0,
            "windows": {"window": window, "stride": stride},
            "documents": {name: [r["doc_id"] for r in rows] for name, rows in picked.items()}, "tokens": tokens,
            "ratio": s.selection_ratio,
            "vs_float32": loss_differences(here, there32, s.selection_ratio),
            "vs_bfloat16": loss_differences(here, there16, s.selection_ratio)}


def cross_check_markdown(result: dict) -> str:
    lines = [f"# Cross-check of {result['losses_file']} ({result['machine']['date']})", "",
             f"The same {sum(len(v) for v in result['documents'].values())} documents ({result['tokens']:,} tokens) "
             f"scored again by stage 1's path on {result['machine']['device']} in {result['dtype']} "
             f"({result['teacher']}), compared token by token with the other machine's losses.", "",
             "| other machine's losses | max abs diff (nats) | p99 | mean | top-40% flips |", "|---|---|---|---|---|"]
    for key in ("vs_float32", "vs_bfloat16"):
        d = result[key]
        lines.append(f"| {key[3:]} | {d['max_abs']:.3g} | {d['p99_abs']:.3g} | {d['mean_abs']:.3g} | "
                     f"{d['flips']} of {d['tokens']:,} ({d['flip_share']:.3g}) |")
    return "\n".join(lines) + "\n"


def _sha256(text: str | None) -> str | None:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest() if text is not None else None


def bench_training(s: Settings, device, dtype_name: str, peak: float | None) -> dict:
    import torch

    from pipeline.method.guided_loss import SelectionConfig, guided_loss

    _reset_memory(device)
    _tf32(device, True)
    model = build_model(s.student, torch.float32, device).train()  # float32 master weights
    flops = flops_per_token(model, s.train_seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (s.train_micro_batch, s.train_seq)
    tokens = torch.randint(0, model.config.vocab_size, (shape[0], shape[1] + 1), generator=g)
    input_ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].contiguous().to(device)
    teacher_loss = torch.empty(shape).exponential_(generator=g)
    mapped = torch.rand(shape, generator=g) >= 0.2
    teacher_loss[~mapped] = float("nan")
    teacher_loss, mapped = teacher_loss.to(device), mapped.to(device)
    autocast = getattr(torch, dtype_name)

    def step(selection: SelectionConfig):
        with torch.autocast(device.type, dtype=autocast, enabled=dtype_name != "float32"):
            logits = model(input_ids=input_ids).logits  # (B, T, V)
        loss, _ = guided_loss(logits, labels, teacher_loss, mapped, selection)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    guided, cpt = SelectionConfig(mode="guided"), SelectionConfig(mode="cpt")
    times = interleaved({"cpt": lambda: step(cpt), "guided": lambda: step(guided)}, device, s.repeats, s.warmup)
    n = shape[0] * shape[1]
    out = {"shape": s.student, "architecture": SHAPES[s.student], "master_weights": "float32",
           "autocast": dtype_name if dtype_name != "float32" else None, "micro_batch": list(shape),
           "flops_per_token": flops,
           "cpt": throughput(n, times["cpt"], flops["train_step"], peak),
           "guided": throughput(n, times["guided"], flops["train_step"], peak),
           "guided_over_cpt": paired(times["guided"], times["cpt"]), "memory": _memory(device)}
    del model, optimizer
    return out


def bench_data(s: Settings, work: Path, teacher_tokenizer: str | None, student_tokenizer: str | None) -> dict:
    """Packed tokens per CPU-second of one process reading every sample of the student data."""
    import numpy as np
    import torch

    from benchmarks.inputs import math_texts
    from pipeline.embedded.tiny_student import train_student_tokenizer
    from pipeline.embedded.tiny_teacher import train_tokenizer
    from pipeline.score_teacher.teacher import ScoredDocument, ShardResult
    from pipeline.score_teacher.writer import write_manifest, write_shard
    from pipeline.student_data.build import build_student_data
    from pipeline.student_data.dataset import PackedDataset, collate_packed
    from pipeline.student_data.settings import AlignmentConfig, PackingConfig
    from pipeline.method.tokenization import encode_batch, load_tokenizer
    from storage_schemas.reader import open_scored_dataset

    texts = math_texts(s.data_text_bytes, kinds=("clean", "noise"))
    t_tok = load_tokenizer(teacher_tokenizer) if teacher_tokenizer else train_tokenizer(texts, s.teacher_vocab)
    s_tok = load_tokenizer(student_tokenizer) if student_tokenizer else train_student_tokenizer(texts, s.student_vocab)
    folder = work / "scored"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    identity = {"teacher": {"name": "bench", "vocab_size": len(t_tok), "bos_id": None}, "corpus": {"n_shards": 1}}
    docs = []
    for k, (text, enc) in enumerate(zip(texts, encode_batch(t_tok, texts))):
        losses = rng.gamma(2.0, 1.0, len(enc)).astype(np.float32)
        docs.append(ScoredDocument(f"bench:{k}", text, enc.ids, enc.starts, enc.ends, losses))
    entry = write_shard(folder, 0, ShardResult(documents=docs), identity, {"start": 0, "stop": len(docs)}, "gpu-bench")
    write_manifest(folder, identity, {0: entry}, 1, "gpu-bench")

    data = build_student_data(open_scored_dataset([folder]), s_tok, PackingConfig(seq_len=s.train_seq),
                              AlignmentConfig(), cache_dir=work / "lengths")  # the plan, as before training
    def read_all() -> int:
        dataset = PackedDataset(data.scored.shards, data.plan, s_tok, data.alignment)
        n = 0
        for batch in torch.utils.data.DataLoader(dataset, batch_size=s.train_micro_batch, collate_fn=collate_packed):
            n += batch["input_ids"].numel()
        return n

    read_all()  # warm-up
    cpu, wall, tokens = [], [], 0
    for _ in range(max(1, s.repeats - 2)):
        c0, w0 = time.process_time(), time.perf_counter()
        tokens = read_all()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    per_core = tokens / statistics.median(cpu)
    return {"documents": len(docs), "text_bytes": sum(len(t.encode()) for t in texts), "packed_tokens": tokens,
            "seq_len": s.train_seq,
            "teacher_tokenizer": teacher_tokenizer or f"byte-level BPE trained here on the text ({len(t_tok)} tokens)",
            "student_tokenizer": student_tokenizer or f"SentencePiece-style BPE with byte fallback trained here ({len(s_tok)} tokens)",
            "cpu_seconds": cpu, "wall_seconds": wall, "tokens_per_cpu_second": per_core,
            "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")}


def bench_vllm(s: Settings, device, dtype_name: str, peak: float | None, work: Path) -> dict:
    """The vLLM backend (its part runs in a process of its own, as every part: vLLM keeps GPU
    memory until its process ends)."""
    import numpy as np
    from transformers import Qwen2Config

    if find_spec("vllm") is None:
        return {"skipped": "vllm is not installed in this environment (it lives in its own; see README)"}
    if device.type != "cuda":
        return {"skipped": "vllm needs a CUDA device"}
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.vllm import VLLMScorer, engine_window

    shape = dict(SHAPES[s.teacher])
    if shape.pop("arch") != "qwen2":
        raise ValueError("the vLLM part builds Qwen2-architecture configs only")
    model_dir = work / "vllm-model"
    Qwen2Config(**shape, tie_word_embeddings=False, dtype=dtype_name,
                architectures=["Qwen2ForCausalLM"]).save_pretrained(model_dir)
    window = engine_window(max(s.score_windows), shape["max_position_embeddings"])
    cfg = ScorerConfig(backend="vllm", model=str(model_dir), dtype=dtype_name, window=window,
                       gpu_memory_utilization=s.vllm_gpu_memory_utilization)
    scorer = VLLMScorer(cfg, load_format="dummy")  # random weights
    rng = np.random.default_rng(0)
    n_windows = max(1, s.score_batch_tokens // window) * s.score_batches
    windows = [rng.integers(0, shape["vocab_size"], window, dtype=np.int64) for _ in range(n_windows)]

    linear = _linear_parameters(shape)  # as flops_per_token counts it, from the config
    forward = 2 * linear + 4 * shape["num_hidden_layers"] * shape["hidden_size"] * window
    for _ in range(s.warmup):
        scorer.score(windows)
    seconds = []
    for _ in range(s.repeats):
        t0 = time.perf_counter()
        scorer.score(windows)
        seconds.append(time.perf_counter() - t0)
    return {"engine": _engine_settings(scorer.llm), "vllm": metadata.version("vllm"), "window": window,
            "max_model_len": window + 1, "gpu_memory_utilization": s.vllm_gpu_memory_utilization,
            "flops_per_token": {"linear_parameters": linear, "forward": forward, "seq_len": window},
            **throughput(window * n_windows, seconds, forward, peak)}


def _engine_settings(llm) -> dict:
    """The scheduler limits the engine settled on (its defaults resolved), where they can be read."""
    scheduler = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "scheduler_config", None)
    keys = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill")
    return {k: getattr(scheduler, k, None) for k in keys} if scheduler is not None else {}


def _linear_parameters(shape: dict) -> int:
    """Linear weights of a Llama/Qwen2-style decoder from its config (as the torch count gives)."""
    d, layers, heads, kv = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = d // heads
    attention = d * heads * head_dim * 2 + d * kv * head_dim * 2  # q, o; k, v
    mlp = 3 * d * shape["intermediate_size"]
    return layers * (attention + mlp) + d * shape["vocab_size"]


# ---------------------------------------------------------------------------------------------
# Each part in a child process with a time limit


def part_command(task: Path, work: Path, name: str) -> list[str]:
    """The child's command line: this module with the task file as its one setting."""
    return [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "benchmarks.gpu", f"part_child={task}",
            f"hydra.run.dir={work / 'children' / name}", "hydra.output_subdir=null"]


def run_part(name: str, task: dict, work: Path, limit_s: int, smoke: bool) -> dict:
    """A part's result from its child process, or what stopped it (its exit status or the time
    limit, and the end of its log). A smoke run (the test suite's) raises instead."""
    task_path, result, log = work / f"{name}-task.json", work / f"{name}-result.json", work / f"{name}.log"
    task_path.write_text(json.dumps(strict_json({**task, "part": name, "out": str(result)})))
    print(f"gpu-bench: {name} (at most {limit_s} s) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as sink:
        child = subprocess.Popen(part_command(task_path, work, name), stdout=sink, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # its own group: a timeout ends its children too
        try:
            status = child.wait(timeout=limit_s)
            problem = f"exited with status {status}" if status else None
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            problem = f"stopped at its time limit of {limit_s} s"
    tail = log.read_text(errors="replace")[-4000:]
    print(f"gpu-bench: {name}: {problem or 'done'} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if problem is None and result.is_file():
        return json.loads(result.read_text())
    if smoke:
        raise RuntimeError(f"part {name} {problem or 'wrote no result'}:\n{tail}")
    print(tail[-1500:], file=sys.stderr, flush=True)
    return {"error": f"{name}: {problem or 'wrote no result'}", "log_tail": tail}


def _part_child(task: dict) -> None:
    """One part, run in this process; its result goes to ``task['out']``."""
    import torch

    s = Settings(**{**task["settings"], "score_windows": tuple(task["settings"]["score_windows"])})
    cfg = GpuBenchConfig(**task["config"])
    device, dtype, peak, work = torch.device(task["device"]), task["dtype"], task["peak"], Path(task["work"])
    if device.type == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    run = {
        "vllm": lambda: bench_vllm(s, device, dtype, peak, work),
        "scoring": lambda: bench_scoring(s, device, dtype, peak, s.teacher, s.score_windows),
        "real_shape": lambda: bench_scoring(s, device, dtype, peak, s.real_shape, (s.real_shape_window,)),
        "precision": lambda: bench_precision(s, device, peak),
        "training": lambda: bench_training(s, device, dtype, peak),
        "real_teacher": lambda: bench_real_teacher(s, device, cfg, Path(task["losses_path"])),
        "data": lambda: bench_data(s, work, cfg.teacher_tokenizer, cfg.student_tokenizer),
    }[task["part"]]
    result = run()
    Path(task["out"]).write_text(json.dumps(strict_json(result), indent=1))


# ---------------------------------------------------------------------------------------------
# Report


def _scoring_figures(part: dict, label: str, key: str, goals: bool) -> list[dict]:
    out = []
    for w, sc in part.get("by_window", {}).items():
        suffix = f"{key}_w{w}"
        where = f"{part['shape']}, {part['dtype']}, windows of {w}, {part['batch_tokens']} tokens per forward"
        m, t, op = GOALS["scorer_over_bare"]
        out.append(figure(f"scorer_over_bare_{suffix}", f"{label}: scorer / bare forward tokens/s (window {w})",
                          sc["scorer_over_bare"]["median"], *((t, op) if goals else (None, None)),
                          note=f"paired over {len(sc['scorer']['seconds'])} repeats, spread "
                               f"{sc['scorer_over_bare']['min']:.3f}-{sc['scorer_over_bare']['max']:.3f}"))
        for side in ("bare_forward", "scorer"):
            name = side.replace("_", " ")
            out.append(figure(f"{side}_tokens_per_s_{suffix}", f"{label}: {name} tokens/s (window {w})",
                              sc[side]["tokens_per_s"], unit="tokens/s", note=where))
        out.append(figure(f"bare_forward_mfu_{suffix}", f"{label}: bare forward MFU (window {w})",
                          sc["bare_forward"]["mfu"]))
        m, t, op = GOALS["scorer_mfu"]
        out.append(figure(f"scorer_mfu_{suffix}", f"{label}: scorer MFU (window {w})", sc["scorer"]["mfu"],
                          *((t, op) if goals else (None, None))))
        if sc.get("memory"):
            m, t, op = GOALS["scoring_memory"]
            out.append(figure(f"scoring_memory_{suffix}", f"{label}: peak memory / GPU memory (window {w})",
                              sc["memory"]["peak_fraction"], t, op,
                              note=f"{sc['memory']['peak_allocated_gib']:.1f} of {sc['memory']['total_gib']:.1f} GiB"))
    return out


def _difference_figures(key: str, label: str, d: dict, ratio: float, note: str = "") -> list[dict]:
    return [figure(f"{key}_max_abs", f"{label}: max |bf16 - fp32| loss", d["max_abs"], unit="nats", note=note),
            figure(f"{key}_p99_abs", f"{label}: p99 |bf16 - fp32| loss", d["p99_abs"], unit="nats"),
            figure(f"{key}_mean_abs", f"{label}: mean |bf16 - fp32| loss", d["mean_abs"], unit="nats"),
            figure(f"{key}_flip_share", f"{label}: share of tokens whose top-{ratio:.0%} selection flips",
                   d["flip_share"], note=f"{d['flips']:,} of {d['tokens']:,} tokens")]


def figures(report: dict) -> list[dict]:
    out = []
    for name in PARTS:
        part = report.get(name) or {}
        if "error" in part:
            out.append({**figure(f"{name}_error", f"{name} part", None, note=part["error"]), "status": "error"})
    sc, rs, pr, rt = (report.get(k) or {} for k in ("scoring", "real_shape", "precision", "real_teacher"))
    tr, da, vl = (report.get(k) or {} for k in ("training", "data", "vllm"))
    out += _scoring_figures(sc, "teacher scoring", "teacher", goals=True)
    out += _scoring_figures(rs, "real teacher's shape", "real_shape", goals=False)
    if "differences" in pr:
        out += _difference_figures("precision", f"{pr['shape']} random weights", pr["differences"], pr["ratio"],
                                   note=f"{pr['windows']} windows of {pr['window']}; {pr['note']}")
        for k in ("float32", "bfloat16"):
            out.append(figure(f"precision_{k}_tokens_per_s", f"{pr['shape']} scorer tokens/s in {k}",
                              pr[k]["tokens_per_s"], unit="tokens/s"))
    if "differences" in rt:
        out += _difference_figures("real_teacher", "trained teacher on real text", rt["differences"], rt["ratio"],
                                   note=f"{Path(rt['teacher']).name}, window {rt['windows']['window']} stride "
                                        f"{rt['windows']['stride']}, {sum(f['tokens'] for f in rt['files'].values()):,} tokens")
        for k in ("float32", "bfloat16"):
            out.append(figure(f"real_teacher_{k}_tokens_per_s", f"trained teacher: stage 1's path tokens/s in {k}",
                              rt[f"{k}_tokens_per_s"], unit="tokens/s", note="tokenization, windows, scoring, stitching"))
        for name, f in rt["files"].items():
            out.append(figure(f"real_teacher_bpb_{name}", f"trained teacher's bits per byte on {name}",
                              f["bits_per_byte"], note=f"{f['documents']} documents, {f['tokens']:,} tokens, float32"))
    elif rt:
        out.append(figure("real_teacher", "trained teacher on real text", None, note=rt.get("skipped") or ""))
    if "tokens_per_s" in vl:
        out.append(figure("vllm_tokens_per_s", "teacher scoring: vLLM backend tokens/s", vl["tokens_per_s"],
                          unit="tokens/s", note=f"vllm {vl['vllm']}, windows of {vl['window']}"))
        out.append(figure("vllm_mfu", "teacher scoring: vLLM backend MFU", vl["mfu"]))
    elif vl:
        out.append(figure("vllm_tokens_per_s", "teacher scoring: vLLM backend tokens/s", None,
                          note=vl.get("skipped") or vl.get("error", "")))
    if "guided" in tr:
        m, t, op = GOALS["guided_over_cpt"]
        out.append(figure("guided_over_cpt", m, tr["guided_over_cpt"]["median"], t, op,
                          note=f"paired, spread {tr['guided_over_cpt']['min']:.3f}-{tr['guided_over_cpt']['max']:.3f}"))
        for mode in ("cpt", "guided"):
            out.append(figure(f"{mode}_tokens_per_s", f"training step ({mode}) tokens/s", tr[mode]["tokens_per_s"],
                              unit="tokens/s", note=f"{tr['shape']}, micro batch {tr['micro_batch']}"))
            out.append(figure(f"{mode}_mfu", f"training step ({mode}) MFU", tr[mode]["mfu"]))
    if "tokens_per_cpu_second" in da:
        out.append(figure("data_tokens_per_core", "student data pipeline tokens/s per CPU core",
                          da["tokens_per_cpu_second"], unit="tokens/s",
                          note="read + tokenize + align + pack, one process, CPU time"))
        if "guided" in tr:
            out.append(figure("cores_per_gpu", "CPU cores to feed one GPU's guided training",
                              tr["guided"]["tokens_per_s"] / da["tokens_per_cpu_second"],
                              note="GPU training tokens/s / data pipeline tokens/s per core"))
    return out


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# GPU bench ({report['mode']} run, {m['date']})", "",
             f"Device: {m['device']} (peak dense bf16 {m['peak_bf16_tflops']} TFLOP/s); {m['cpu_count']} CPU cores; "
             f"torch {m['torch']} (CUDA {m['cuda']}), transformers {m['transformers']}, vllm {m.get('vllm') or 'not installed'}.",
             f"Total time: {report['seconds']:.0f} s. Random weights but in the real_teacher rows; FLOPs: "
             f"{report['flops_convention']}.", ""]
    if report.get("runs"):
        lines += ["Merged from runs on one machine: " + "; ".join(
            f"{r['file']} ({r['date']}, {', '.join(r['parts'])})" for r in report["runs"]) + ".", ""]
    if report["mode"] == "smoke":
        lines += ["Smoke run: tiny shapes, code paths only; the figures say nothing about a GPU.", ""]
    lines.append(markdown_table(report["figures"]))
    return "\n".join(lines) + "\n"


def machine(device, peak: float | None) -> dict:
    import torch

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "host": platform.node(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
            "device_type": device.type, "peak_bf16_tflops": peak, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            **{name: version(name) for name in ("transformers", "accelerate", "pyarrow", "tokenizers", "gguf", "vllm")}}


def write(report: dict, prefix: Path) -> tuple[Path, Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    report["figures"] = figures(report)
    paths = (prefix.with_suffix(".json"), prefix.with_suffix(".md"))
    for path, text in zip(paths, (json.dumps(strict_json(report), indent=1, allow_nan=False), markdown(report))):
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths


def merge_reports(paths: list[str]) -> dict:
    """One report from runs on one machine (the parts of a later run replace an earlier one's,
    unless the later one failed where the earlier one measured)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    devices = {(r["machine"]["device"], r["mode"]) for r in reports}
    if len(devices) > 1:
        raise ConfigError(f"merge: the runs are from different devices or modes ({sorted(devices)}); timings "
                          "compare only on one machine")
    merged = {k: v for k, v in reports[0].items() if k not in PARTS}
    merged["runs"] = []
    for path, report in zip(paths, reports):
        parts = [name for name in PARTS if name in report]
        merged["runs"].append({"file": Path(path).name, "date": report["machine"]["date"], "host": report["machine"]["host"],
                               "seconds": report["seconds"], "parts": parts})
        for name in parts:
            if "error" not in report[name] or "error" in merged.get(name, {"error": ""}):
                merged[name] = report[name]
    merged["seconds"] = sum(r["seconds"] for r in reports)
    return merged


# ---------------------------------------------------------------------------------------------
# Entry point


def run_gpu_bench(cfg: GpuBenchConfig) -> dict:
    """Every part not skipped, each in its own process; the report is written after each part."""
    import torch

    settings = SMOKE if cfg.smoke else Settings()
    if cfg.repeats:
        settings = replace(settings, repeats=cfg.repeats)
    device = torch.device(cfg.device or ("cpu" if cfg.smoke else "cuda"))
    dtype = cfg.dtype or ("float32" if cfg.smoke and device.type == "cpu" else "bfloat16")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: python -m benchmarks.gpu smoke=true runs the code paths on CPU")
    info = machine(device, None)
    peak = cfg.peak_tflops or (peak_tflops(info["device"]) if device.type == "cuda" else None)
    info["peak_bf16_tflops"] = peak
    prefix = Path(cfg.out or ("bench-results/gpu-smoke" if cfg.smoke else "bench-results/gpu-latest"))
    t0 = time.perf_counter()
    report = {"mode": "smoke" if cfg.smoke else "full", "machine": info, "settings": asdict(settings),
              "flops_convention": "forward 2N + 4 L d T per token (N: linear-layer weights incl. the output head; "
                                  "attention as if not causal); training step = 3 forwards"}
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as work:
        task = {"settings": asdict(settings), "config": {**asdict(cfg), "merge": [], "part_child": None},
                "device": str(device), "dtype": dtype, "peak": peak, "work": work,
                "losses_path": str(prefix.parent / f"{prefix.name}-real-losses.parquet")}
        for name in PARTS:
            if name not in cfg.skip:
                limit = cfg.part_timeout_s or PART_TIMEOUT_S[name]
                report[name] = run_part(name, task, Path(work), limit, cfg.smoke)
                report["seconds"] = time.perf_counter() - t0
                write(report, prefix)
    report["seconds"] = time.perf_counter() - t0
    json_path, md_path = write(report, prefix)
    print(markdown(report))
    print(f"written to {json_path} and {md_path}")
    return report


@entry_point("gpu_bench", asdict(GpuBenchConfig()), check=gpu_bench_config)
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    typed = gpu_bench_config(cfg)
    if typed.part_child:
        _part_child(json.loads(Path(typed.part_child).read_text()))
    elif typed.cross_check:
        result = cross_check(typed)
        prefix = Path(typed.out or str(Path(typed.cross_check).with_suffix("")) + "-cross-check")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        prefix.with_suffix(".json").write_text(json.dumps(strict_json(result), indent=1, allow_nan=False))
        prefix.with_suffix(".md").write_text(cross_check_markdown(result))
        print(cross_check_markdown(result))
    elif typed.merge:
        report = merge_reports(typed.merge)
        json_path, md_path = write(report, Path(typed.out or "bench-results/gpu-latest"))
        print(markdown(report))
        print(f"written to {json_path} and {md_path}")
    else:
        run_gpu_bench(typed)


if __name__ == "__main__":
    sys.exit(main())
