"""``make gpu-bench``: the GPU paths at full scale, side by side in one run, with random weights.

Needs only torch, transformers, accelerate, pyarrow, and Hydra and OmegaConf for its configuration
(no Ray, Polars or datasets, no network), so it runs on a bare GPU machine::

    python -m benchmarks.gpu                  # writes bench-results/gpu-latest.json and .md
    python -m benchmarks.gpu smoke=true       # tiny shapes on CPU in seconds (code paths only)
    python -m benchmarks.gpu skip=[vllm,data] repeats=3 peak_tflops=989.4 out=bench-results/h100

Settings: :class:`GpuBenchConfig` (``conf/gpu_bench.yaml`` overrides it; ``make gpu-bench
ARGS="smoke=true"``). Hydra and OmegaConf are pure Python: ``make gpu-bench-wheels`` writes their
wheels (hydra-core, omegaconf, antlr4-python3-runtime, the versions of this project's environment)
to ``.gpu-wheels/``; copy the repository with that folder to the GPU machine and there run
``pip install --no-index --find-links .gpu-wheels hydra-core`` (PyYAML and packaging, which they
also need, come with transformers).

What is measured (after warm-up, CUDA-synchronised, the sides of each part interleaved A B, B A, ...):

* teacher scoring at the Qwen2.5-7B shape (28 layers, hidden 3584, vocab 152,064) in bf16, on
  full windows of ``score_seq`` random tokens: a bare forward (``model(...).logits``, bf16 logits of
  every position, no loss), the project's :class:`pipeline.score_teacher.backends.hf.TransformersScorer` (backbone,
  then float32 log-softmax over bounded chunks of the output head), and, where ``vllm`` imports, the
  project's :class:`pipeline.score_teacher.backends.vllm.VLLMScorer` in a child process (``load_format="dummy"``:
  random weights, no checkpoint);
* the student training step at the TinyLlama 1.1B shape, sequence 2048: float32 master weights,
  bf16 autocast (what the Trainer's ``bf16=True`` does), fused AdamW, with the project's loss in
  ``guided`` mode and in ``cpt`` mode (:func:`pipeline.guided_loss.guided_loss`);
* the student data pipeline (read + tokenize + align + pack, :mod:`pipeline.student_side`) in one
  process over a scored dataset written here (generated math text, random teacher losses), as packed
  tokens per CPU-second, next to the GPU's training tokens/s: the CPU cores one GPU needs.

FLOPs per token follow the PaLM appendix: forward ``2 N + 4 L d T`` with ``N`` the weights of the
linear layers (output head included, embedding excluded), ``L`` layers, ``d`` the attention width,
``T`` the sequence length (attention counted as if not causal); a training step is three forwards.
MFU = achieved FLOP/s / the GPU's dense bf16 peak (a table by device name, or ``peak_tflops``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
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
from pipeline.config import build, check_at_least, check_choice, raise_if
from stages.common import entry_point
from storage_schemas import strict_json

SHAPES = {
    "qwen2.5-7b": dict(arch="qwen2", vocab_size=152_064, hidden_size=3584, intermediate_size=18_944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32_768),
    "tinyllama-1.1b": dict(arch="llama", vocab_size=32_000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           max_position_embeddings=2048),
    "smoke-teacher": dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "smoke-student": dict(arch="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
}

# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets; SXM parts where a name is ambiguous).
PEAK_BF16_TFLOPS = (
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("GH200", 989.4),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("RTX 4090", 165.2), ("RTX A6000", 154.8), ("B200", 2250.0),
)


PARTS = ("vllm", "scoring", "training", "data")  # in the order they run: vLLM's child needs the GPU free
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
    teacher_tokenizer: str | None = None  # tokenizer folder/file for the data part; None: one trained here
    student_tokenizer: str | None = None  # e.g. TinyLlama's tokenizer folder; None: one trained here
    out: str | None = None  # prefix of the .json/.md; None: bench-results/gpu-latest (gpu-smoke for a smoke run)
    vllm_child: str | None = None  # internal: the JSON task of the vLLM part's child process (bench_vllm)

    def problems(self) -> list[str]:
        problems: list[str] = []
        if self.dtype is not None:
            check_choice(problems, "dtype", self.dtype, DTYPES)
        problems += [f"skip: {part!r} is not one of {', '.join(PARTS)}" for part in self.skip if part not in PARTS]
        check_at_least(problems, "repeats", self.repeats, 1)
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            problems.append(f"peak_tflops: {self.peak_tflops} must be > 0")
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
    score_seq: int = 4096  # the paper teachers' window
    score_batch_tokens: int = 16_384  # padded tokens per forward (scorer.max_batch_tokens' default)
    score_batches: int = 8  # forward batches per timed repeat
    train_seq: int = 2048
    train_micro_batch: int = 8  # the paper recipe's micro batch per GPU
    data_text_bytes: int = 8 * 2**20  # text of the scored dataset the data pipeline reads
    teacher_vocab: int = 32_000  # stand-in tokenizers trained here, unless paths are given
    student_vocab: int = 32_000
    repeats: int = 5
    warmup: int = 2
    vllm_gpu_memory_utilization: float = 0.85


SMOKE = Settings(teacher="smoke-teacher", student="smoke-student", score_seq=64, score_batch_tokens=256,
                 score_batches=2, train_seq=64, train_micro_batch=2, data_text_bytes=48 * 2**10, teacher_vocab=600,
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
    config = config_cls(**spec, tie_word_embeddings=False, use_cache=False)
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


# ---------------------------------------------------------------------------------------------
# The parts


def bench_scoring(s: Settings, device, dtype_name: str, peak: float | None) -> dict:
    import numpy as np
    import torch

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer, batches_by_tokens

    _reset_memory(device)
    model = build_model(s.teacher, getattr(torch, dtype_name), device).eval()
    flops = flops_per_token(model, s.score_seq)
    rng = np.random.default_rng(0)
    per_batch = max(1, s.score_batch_tokens // s.score_seq)
    windows = [rng.integers(0, model.config.vocab_size, s.score_seq, dtype=np.int64)
               for _ in range(per_batch * s.score_batches)]
    scorer = TransformersScorer(ScorerConfig(dtype=dtype_name, device=str(device), window=s.score_seq,
                                             max_batch_tokens=s.score_batch_tokens), model=model)
    groups = batches_by_tokens([len(w) for w in windows], s.score_batch_tokens)
    batches = [torch.from_numpy(np.stack([windows[i] for i in g])).to(device) for g in groups]

    @torch.inference_mode()
    def bare():
        for ids in batches:
            model(input_ids=ids, use_cache=False).logits  # (B, T, V) bf16, every position

    times = interleaved({"scorer": lambda: scorer.score(windows), "bare_forward": bare}, device, s.repeats, s.warmup)
    tokens = len(windows) * s.score_seq
    out = {"shape": s.teacher, "architecture": SHAPES[s.teacher], "dtype": dtype_name, "flops_per_token": flops,
           "window": s.score_seq, "batch_tokens": s.score_batch_tokens, "tokens_per_repeat": tokens,
           "scorer": throughput(tokens, times["scorer"], flops["forward"], peak),
           "bare_forward": throughput(tokens, times["bare_forward"], flops["forward"], peak),
           "scorer_over_bare": paired(times["bare_forward"], times["scorer"]), "memory": _memory(device)}
    del model, scorer, batches
    return out


def bench_training(s: Settings, device, dtype_name: str, peak: float | None) -> dict:
    import torch

    from pipeline.guided_loss import SelectionConfig, guided_loss

    _reset_memory(device)
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
    from pipeline.student_side import AlignmentConfig, PackedDataset, PackingConfig, build_student_data, collate_packed
    from pipeline.tokenization import encode_batch, load_tokenizer
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
    """The vLLM backend in a child process (vLLM keeps GPU memory until its process ends)."""
    if find_spec("vllm") is None:
        return {"skipped": "vllm is not installed in this environment (it lives in its own; see README)"}
    if device.type != "cuda":
        return {"skipped": "vllm needs a CUDA device"}
    result, task = work / "vllm.json", work / "vllm-task.json"
    task.write_text(json.dumps({"settings": asdict(s), "dtype": dtype_name, "peak": peak, "out": str(result),
                                "work": str(work)}))
    cmd = [sys.executable, "-m", "benchmarks.gpu", f"vllm_child={task}", f"hydra.run.dir={work / 'vllm-child'}",
           "hydra.output_subdir=null"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return {"error": f"vLLM child exited {run.returncode}", "stderr_tail": run.stderr[-4000:]}
    return json.loads(result.read_text())


def _vllm_child(spec: dict) -> None:
    import numpy as np
    from transformers import Qwen2Config

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.vllm import VLLMScorer, engine_window

    s = Settings(**spec["settings"])
    shape = dict(SHAPES[s.teacher])
    if shape.pop("arch") != "qwen2":
        raise ValueError("the vLLM part builds Qwen2-architecture configs only")
    model_dir = Path(spec["work"]) / "vllm-model"
    Qwen2Config(**shape, tie_word_embeddings=False, dtype=spec["dtype"],
                architectures=["Qwen2ForCausalLM"]).save_pretrained(model_dir)
    window = engine_window(s.score_seq, shape["max_position_embeddings"])
    cfg = ScorerConfig(backend="vllm", model=str(model_dir), dtype=spec["dtype"], window=window,
                       gpu_memory_utilization=s.vllm_gpu_memory_utilization)
    scorer = VLLMScorer(cfg, load_format="dummy")  # random weights
    rng = np.random.default_rng(0)
    n_windows = max(1, s.score_batch_tokens // s.score_seq) * s.score_batches
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
    out = {"engine": _engine_settings(scorer.llm), "vllm": metadata.version("vllm"), "window": window, "max_model_len": window + 1,
           "gpu_memory_utilization": s.vllm_gpu_memory_utilization,
           "flops_per_token": {"linear_parameters": linear, "forward": forward, "seq_len": window},
           **throughput(window * n_windows, seconds, forward, spec["peak"])}
    Path(spec["out"]).write_text(json.dumps(strict_json(out), indent=1))


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
# Report


def _run_part(name: str, run, device, smoke: bool) -> dict:
    """A part's result, or the error that stopped it (out of memory included): the other parts
    still run. A smoke run (the test suite's) lets errors through."""
    import traceback

    print(f"gpu-bench: {name} ...", file=sys.stderr, flush=True)
    try:
        return run()
    except Exception as exc:
        if smoke:
            raise
        _reset_memory(device)
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback_tail": traceback.format_exc()[-4000:]}


def figures(report: dict) -> list[dict]:
    out = []
    sc, tr, da, vl = (report.get(k) or {} for k in ("scoring", "training", "data", "vllm"))
    for name, part in (("scoring", sc), ("training", tr), ("data", da)):
        if "error" in part:
            out.append({**figure(f"{name}_error", f"{name} part", None, note=part["error"]), "status": "error"})
    if "scorer" in sc:
        m, t, op = GOALS["scorer_over_bare"]
        out.append(figure("scorer_over_bare", m, sc["scorer_over_bare"]["median"], t, op,
                          note=f"paired over {len(sc['scorer']['seconds'])} repeats, spread "
                               f"{sc['scorer_over_bare']['min']:.3f}-{sc['scorer_over_bare']['max']:.3f}"))
        for key in ("bare_forward", "scorer"):
            label = {"bare_forward": "teacher scoring: bare forward", "scorer": "teacher scoring: scorer"}[key]
            out.append(figure(f"{key}_tokens_per_s", f"{label} tokens/s", sc[key]["tokens_per_s"], unit="tokens/s",
                              note=f"{sc['shape']}, {sc['dtype']}, windows of {sc['window']}, "
                                   f"{sc['batch_tokens']} tokens per forward"))
        m, t, op = GOALS["scorer_mfu"]
        out.append(figure("bare_forward_mfu", "teacher scoring: bare forward MFU", sc["bare_forward"]["mfu"]))
        out.append(figure("scorer_mfu", m, sc["scorer"]["mfu"], t, op))
        if sc.get("memory"):
            m, t, op = GOALS["scoring_memory"]
            out.append(figure("scoring_memory", m, sc["memory"]["peak_fraction"], t, op,
                              note=f"{sc['memory']['peak_allocated_gib']:.1f} of {sc['memory']['total_gib']:.1f} GiB"))
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
             f"Total time: {report['seconds']:.0f} s. Random weights; FLOPs: {report['flops_convention']}.", ""]
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
            **{name: version(name) for name in ("transformers", "accelerate", "pyarrow", "tokenizers", "vllm")}}


def write(report: dict, prefix: Path) -> tuple[Path, Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = (prefix.with_suffix(".json"), prefix.with_suffix(".md"))
    for path, text in zip(paths, (json.dumps(strict_json(report), indent=1, allow_nan=False), markdown(report))):
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths


# ---------------------------------------------------------------------------------------------
# Entry point


def run_gpu_bench(cfg: GpuBenchConfig) -> dict:
    """Every part not skipped, the figures, the two files; returns the report."""
    import torch

    settings = SMOKE if cfg.smoke else Settings()
    if cfg.repeats:
        settings = replace(settings, repeats=cfg.repeats)
    device = torch.device(cfg.device or ("cpu" if cfg.smoke else "cuda"))
    dtype = cfg.dtype or ("float32" if cfg.smoke and device.type == "cpu" else "bfloat16")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: python -m benchmarks.gpu smoke=true runs the code paths on CPU")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    info = machine(device, None)
    peak = cfg.peak_tflops or (peak_tflops(info["device"]) if device.type == "cuda" else None)
    info["peak_bf16_tflops"] = peak
    t0 = time.perf_counter()
    report = {"mode": "smoke" if cfg.smoke else "full", "machine": info, "settings": asdict(settings),
              "flops_convention": "forward 2N + 4 L d T per token (N: linear-layer weights incl. the output head; "
                                  "attention as if not causal); training step = 3 forwards"}
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as work:
        parts = {
            "vllm": lambda: bench_vllm(settings, device, dtype, peak, Path(work)),
            "scoring": lambda: bench_scoring(settings, device, dtype, peak),
            "training": lambda: bench_training(settings, device, dtype, peak),
            "data": lambda: bench_data(settings, Path(work), cfg.teacher_tokenizer, cfg.student_tokenizer),
        }
        for name in PARTS:
            if name not in cfg.skip:
                report[name] = _run_part(name, parts[name], device, cfg.smoke)
    report["seconds"] = time.perf_counter() - t0
    report["figures"] = figures(report)
    prefix = Path(cfg.out or ("bench-results/gpu-smoke" if cfg.smoke else "bench-results/gpu-latest"))
    json_path, md_path = write(report, prefix)
    print(markdown(report))
    print(f"written to {json_path} and {md_path}")
    return report


@entry_point("gpu_bench", asdict(GpuBenchConfig()), check=gpu_bench_config)
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    typed = gpu_bench_config(cfg)
    if typed.vllm_child:
        _vllm_child(json.loads(Path(typed.vllm_child).read_text()))
    else:
        run_gpu_bench(typed)


if __name__ == "__main__":
    sys.exit(main())
