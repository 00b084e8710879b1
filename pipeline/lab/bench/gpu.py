"""GPU part of the bench: teacher-scoring throughput and MFU with the transformers backend, and the
guided-loss training step against plain cross-entropy, on a ~1B-parameter model built from a config.

Standalone: needs torch and transformers only (no Ray, no datasets), so it runs on a bare GPU box::

    python -m pipeline.lab.bench.gpu                          # TinyLlama-1.1B shape, bf16, CUDA
    python -m pipeline.lab.bench.gpu --preset tiny --device cpu --out /tmp/gpu.json   # smoke test

Random weights (speed does not depend on them). What is timed (CUDA-synchronised, after warm-up):

* scoring: :class:`pipeline.score_teacher.backends.hf.TransformersScorer` (the project's backend: backbone in
  bf16, float32 log-softmax over bounded chunks of the output head) over windows of ``seq_len``
  random tokens, ``score_batch_tokens`` padded tokens per forward; beside it the bare forward
  (backbone plus output head on every position, no loss) over the same batches;
* training: one optimizer step (forward under bf16 autocast with float32 master weights, as the
  Trainer's ``bf16=True``; loss; backward; fused AdamW) with
  :func:`pipeline.train_student.guided_loss.guided_loss` and with ``F.cross_entropy``, interleaved.

FLOPs per token follow the PaLM appendix convention: forward ``2 N + 4 L d T`` with ``N`` the
parameters that multiply (all but the input embedding; the output head counts), ``L`` layers,
``d`` hidden size, ``T`` the sequence length (attention counted as if not causal); a training step
is three forwards. MFU = achieved FLOP/s / the GPU's dense bf16 peak (a table by device name, or
``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

PRESETS = {
    # TinyLlama-1.1B (the paper's student; a ~1B teacher for scoring speed)
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128),
}

# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets; SXM parts where a name is ambiguous).
PEAK_BF16_TFLOPS = (
    ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("H800", 989.4), ("GH200", 989.4),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("RTX 4090", 165.2), ("RTX A6000", 154.8), ("B200", 2250.0),
)


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def build_model(preset: dict, dtype, device, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**preset, tie_word_embeddings=False, use_cache=False)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def flops_per_token(model, seq_len: int) -> dict:
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    matmul = total - model.get_input_embeddings().weight.numel()
    forward = 2 * matmul + 4 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
    return {"parameters": total, "matmul_parameters": matmul, "forward": forward, "train_step": 3 * forward}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def bench_scoring(args, device, peak: float | None) -> dict:
    import numpy as np
    import torch

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer, batches_by_tokens, head_chunk_positions

    dtype = getattr(torch, args.dtype)
    model = build_model(PRESETS[args.preset], dtype, device).eval()
    flops = flops_per_token(model, args.seq_len)
    rng = np.random.default_rng(0)
    per_batch = max(1, args.score_batch_tokens // args.seq_len)
    windows = [rng.integers(0, model.config.vocab_size, args.seq_len, dtype=np.int64)
               for _ in range(per_batch * args.score_batches)]
    scorer = TransformersScorer(ScorerConfig(dtype=args.dtype, device=str(device), window=args.seq_len,
                                             max_batch_tokens=args.score_batch_tokens), model=model)
    head, chunk = model.get_output_embeddings(), head_chunk_positions(model.config.vocab_size, scorer.cfg.max_logits_bytes)
    groups = batches_by_tokens([len(w) for w in windows], args.score_batch_tokens)
    batches = [torch.from_numpy(np.stack([windows[i] for i in g])).to(device) for g in groups]

    @torch.inference_mode()
    def bare():
        for ids in batches:
            hidden = model.base_model(input_ids=ids).last_hidden_state  # (B, T, H)
            h = hidden.reshape(-1, hidden.shape[-1])
            for lo in range(0, h.shape[0], chunk):
                head(h[lo : lo + chunk])

    tokens = len(windows) * args.seq_len
    score_s = _time(lambda: scorer.score(windows), device, args.repeats, args.warmup)
    bare_s = _time(bare, device, args.repeats, args.warmup)
    out = {"model": {**PRESETS[args.preset], **flops, "dtype": args.dtype}, "seq_len": args.seq_len,
           "batch_tokens": args.score_batch_tokens, "tokens_per_repeat": tokens,
           "scorer_s": score_s, "bare_forward_s": bare_s}
    for name, times in (("scorer", score_s), ("bare_forward", bare_s)):
        tps = tokens / statistics.median(times)
        out[f"{name}_tokens_per_s"] = tps
        out[f"{name}_tflops"] = tps * flops["forward"] / 1e12
        out[f"{name}_mfu"] = tps * flops["forward"] / (peak * 1e12) if peak else None
    out["scorer_over_bare"] = statistics.median(bare_s) / statistics.median(score_s)
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model, scorer, batches
    return out


def bench_training(args, device, peak: float | None) -> dict:
    import torch
    import torch.nn.functional as F

    from pipeline.train_student.guided_loss import SelectionConfig, guided_loss

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(PRESETS[args.preset], torch.float32, device).train()
    flops = flops_per_token(model, args.seq_len)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (args.train_micro_batch, args.seq_len)
    tokens = torch.randint(0, model.config.vocab_size, (shape[0], shape[1] + 1), generator=g)
    input_ids, labels = tokens[:, :-1].to(device), tokens[:, 1:].contiguous().to(device)
    teacher_loss = torch.empty(shape).exponential_(generator=g)
    mapped = torch.rand(shape, generator=g) >= 0.2
    teacher_loss[~mapped] = float("nan")
    teacher_loss, mapped = teacher_loss.to(device), mapped.to(device)
    selection = SelectionConfig()
    autocast_dtype = getattr(torch, args.dtype)
    use_autocast = args.dtype != "float32"

    def step(loss_fn):
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=use_autocast):
            logits = model(input_ids=input_ids).logits  # (B, T, V)
        loss = loss_fn(logits)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def ce(logits):
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    def guided(logits):
        return guided_loss(logits, labels, teacher_loss, mapped, selection)[0]

    for _ in range(args.warmup):
        step(ce)
        step(guided)
    _sync(device)
    times = {"cross_entropy": [], "guided": []}
    for r in range(args.repeats):
        order = ("cross_entropy", "guided") if r % 2 == 0 else ("guided", "cross_entropy")
        for name in order:
            fn = ce if name == "cross_entropy" else guided
            t0 = time.perf_counter()
            step(fn)
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    n_tokens = shape[0] * shape[1]
    out = {"model": {**PRESETS[args.preset], **flops, "master_weights": "float32",
                     "autocast": args.dtype if use_autocast else None},
           "micro_batch": list(shape), "step_s": times}
    for name, ts in times.items():
        tps = n_tokens / statistics.median(ts)
        out[f"{name}_tokens_per_s"] = tps
        out[f"{name}_tflops"] = tps * flops["train_step"] / 1e12
        out[f"{name}_mfu"] = tps * flops["train_step"] / (peak * 1e12) if peak else None
    paired = [g_ / c for g_, c in zip(times["guided"], times["cross_entropy"])]
    out["guided_over_cross_entropy"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired)}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--score-batch-tokens", type=int, default=32768, help="padded tokens per scoring forward")
    p.add_argument("--score-batches", type=int, default=4, help="forward batches per timed repeat")
    p.add_argument("--train-micro-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="override the device's dense bf16 peak")
    p.add_argument("--skip", choices=("scoring", "training"), action="append", default=[])
    p.add_argument("--out", default="bench-results/gpu.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    import torch
    import transformers

    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --preset tiny for a smoke test")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    report = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": name, "device_type": device.type, "peak_bf16_tflops": peak,
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "python": platform.python_version(), "args": vars(args),
        "flops_convention": "forward 2N + 4 L d T per token (N: parameters that multiply, incl. the output head; "
                            "attention as if not causal); training step = 3 forwards",
    }
    if "scoring" not in args.skip:
        report["scoring"] = bench_scoring(args, device, peak)
    if "training" not in args.skip:
        report["training"] = bench_training(args, device, peak)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_finite(report), indent=1, default=str))
    print(table(report))
    print(f"written to {out}")
    return report


def _finite(obj):
    """NaN and infinities as null: strict JSON."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def table(report: dict) -> str:
    def pct(x):
        return f"{100 * x:.1f}%" if x is not None else "—"

    rows = [f"GPU bench, {report['device']} ({report['date']}), torch {report['torch']}, "
            f"transformers {report['transformers']}",
            "", "| measure | tokens/s | TFLOP/s | MFU |", "|---|---|---|---|"]
    s = report.get("scoring")
    if s:
        for key, label in (("scorer", "scoring, TransformersScorer"), ("bare_forward", "scoring, bare forward")):
            rows.append(f"| {label} ({s['model']['parameters'] / 1e9:.2f}B, {s['model']['dtype']}, T={s['seq_len']}) | "
                        f"{s[f'{key}_tokens_per_s']:,.0f} | {s[f'{key}_tflops']:.1f} | {pct(s[f'{key}_mfu'])} |")
    t = report.get("training")
    if t:
        for key, label in (("cross_entropy", "train step, cross-entropy"), ("guided", "train step, guided loss")):
            rows.append(f"| {label} (B={t['micro_batch'][0]}, T={t['micro_batch'][1]}) | {t[f'{key}_tokens_per_s']:,.0f} | "
                        f"{t[f'{key}_tflops']:.1f} | {pct(t[f'{key}_mfu'])} |")
        rows.append(f"\nguided / cross-entropy step time: {t['guided_over_cross_entropy']['median']:.3f}")
    if s:
        rows.append(f"scorer tokens/s / bare forward tokens/s: {s['scorer_over_bare']:.3f}")
    return "\n".join(rows)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
