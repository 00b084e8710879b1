"""Alignment cost, and alignment against the peers' DTW, on >= 1 MiB of math text.

Sides, all single-threaded (``TOKENIZERS_PARALLELISM=false``), compared by process CPU time:

* ``tokenize``: :func:`pipeline.method.tokenization.encode_batch` of every document with the student
  tokenizer (one batch call, offsets included): the work alignment is measured against;
* ``align``: :func:`pipeline.method.alignment.align_document` for every document (max aggregation), given
  the student encodings and the teacher's spans and losses (teacher losses are random, NaN at the
  first token as for a teacher without BOS: alignment cost does not depend on the values);
* ``align_documents``: the pipeline's batch API :func:`pipeline.method.alignment.align_documents` (what
  stage 2 calls) over ``batch_docs`` documents per call, checked equal to ``align`` bit for bit.
  The figure is the faster of the pipeline's two ways.

The DTW baseline (:mod:`benchmarks.dtw`) is O(N M) per document, so it runs on a few documents
of typical length (closest to the median student length), timed against ``align_document`` on
the same documents; its cost per DP cell is then extrapolated to the whole text, both per
document and cut into 2048-token blocks as FuseLLM aligns (the smaller, conservative estimate is
the figure).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.inputs import REAL_TOKENIZERS
from benchmarks.measure import interleaved, ratio
from benchmarks.results import figure
from pipeline.method.alignment import AGGREGATIONS
from pipeline.runtime.config import check_at_least, check_choice


@dataclass(frozen=True)
class AlignmentBenchConfig:
    min_bytes: int = 2**20  # of clean math text
    seed: int = 0
    repeats: int = 7
    warmup: int = 1
    student: str = "llama-spm"  # TinyLlama / Llama-2
    teacher: str = "qwen2"  # Qwen2.5-Math
    aggregate: str = "max"
    batch_docs: int = 64  # documents per align_documents call
    profile: bool = True
    dtw_docs: int = 4  # documents through DTW (at most; the time budget may stop earlier)
    dtw_budget_s: float = 20.0
    dtw_chunk: int = 2048  # FuseLLM aligns blocks of this many tokens
    target_cost: float = 0.05
    target_dtw_speedup: float = 100.0

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("min_bytes", "repeats", "batch_docs", "dtw_chunk"):
            check_at_least(problems, name, getattr(self, name), 1)
        for name in ("warmup", "dtw_docs"):
            check_at_least(problems, name, getattr(self, name), 0)
        check_choice(problems, "student", self.student, REAL_TOKENIZERS)
        check_choice(problems, "teacher", self.teacher, REAL_TOKENIZERS)
        check_choice(problems, "aggregate", self.aggregate, AGGREGATIONS)
        return problems


def run(cfg: AlignmentBenchConfig, student_tokenizer, teacher_tokenizer) -> dict:
    from benchmarks.inputs import math_texts
    from pipeline.method.alignment import align_document, align_documents
    from pipeline.method.tokenization import encode_batch

    texts = math_texts(cfg.min_bytes, cfg.seed)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    teacher = encode_batch(teacher_tokenizer, texts)
    rng = np.random.default_rng(cfg.seed)
    losses = []
    for enc in teacher:
        values = rng.gamma(2.0, 1.0, len(enc)).astype(np.float32)
        values[:1] = np.nan
        losses.append(values)
    student = encode_batch(student_tokenizer, texts)
    n_student = [len(e) for e in student]
    n_teacher = [len(e) for e in teacher]

    def tokenize():
        return encode_batch(student_tokenizer, texts)

    def align():
        return [align_document(s, t.starts, t.ends, l, cfg.aggregate) for s, t, l in zip(student, teacher, losses)]

    groups = [(student[k : k + cfg.batch_docs], [(t.starts, t.ends, l) for t, l in
               zip(teacher[k : k + cfg.batch_docs], losses[k : k + cfg.batch_docs])])
              for k in range(0, len(student), cfg.batch_docs)]

    def align_batched():
        return [align_documents(s, t, cfg.aggregate) for s, t in groups]

    reference = [r.teacher_loss for r in align()]
    exact = _same(reference, [a.teacher_loss for out in align_batched() for a in out])
    sides = {"tokenize": tokenize, "align": align}
    if exact:
        sides["align_documents"] = align_batched
    samples = interleaved(sides, cfg.repeats, cfg.warmup)

    per_document = ratio(samples["align"].cpu, samples["tokenize"].cpu)
    cost, method = per_document, "align_document per document"
    if "align_documents" in samples:
        batched = ratio(samples["align_documents"].cpu, samples["tokenize"].cpu)
        if batched["median"] < per_document["median"]:
            cost, method = batched, f"align_documents, {cfg.batch_docs} documents per call"
    fastest = "align_documents" if method.startswith("align_documents") else "align"
    cost_wall = ratio(samples[fastest].wall, samples["tokenize"].wall)
    result = {
        "texts": {"documents": len(texts), "bytes": n_bytes, "student_tokens": sum(n_student),
                  "teacher_tokens": sum(n_teacher), "student": cfg.student, "teacher": cfg.teacher},
        "samples": {k: v.to_dict() for k, v in samples.items()},
        "cost_cpu": cost,
        "cost_method": method,
        "cost_per_document_cpu": per_document,
        "cost_wall": cost_wall,
        "align_ns_per_student_token": 1e9 * statistics.median(samples[fastest].cpu) / sum(n_student),
        "tokenize_ns_per_student_token": 1e9 * statistics.median(samples["tokenize"].cpu) / sum(n_student),
        "align_documents_exact": exact,
    }
    if cfg.profile:
        result["profile"] = _profile(align_batched)
        result["steps"] = _steps(groups, cfg.aggregate, statistics.median(samples["tokenize"].cpu))
    result["dtw"] = _dtw(cfg, student_tokenizer, teacher_tokenizer, student, teacher, losses,
                         statistics.median(samples["align"].cpu))

    figures = [
        figure("alignment_cost", "alignment cost (align / student tokenization)", cost["median"], cfg.target_cost, "<=",
               note=_cost_note(result, cfg), details={"wall": cost_wall["median"]}),
        figure("alignment_vs_dtw", "alignment vs peers' DTW (speed-up)", result["dtw"]["speedup"],
               cfg.target_dtw_speedup, ">=", unit="x", note=_dtw_note(result["dtw"])),
    ]
    result["figures"] = figures
    return result


def _cost_note(r: dict, cfg: AlignmentBenchConfig) -> str:
    t = r["texts"]
    note = (f"{r['cost_method']}; CPU time, {t['bytes'] / 2**20:.2f} MiB, {t['documents']} docs, "
            f"{t['student_tokens']:,} {cfg.student} "
            f"student / {t['teacher_tokens']:,} {cfg.teacher} teacher tokens; align "
            f"{r['align_ns_per_student_token']:.0f} ns/token vs tokenize {r['tokenize_ns_per_student_token']:.0f}; "
            f"spread {r['cost_cpu']['min']:.3f}-{r['cost_cpu']['max']:.3f} over {r['cost_cpu']['repeats']} reps; "
            f"wall-time ratio {r['cost_wall']['median']:.3f}")
    if r["cost_method"] != "align_document per document":
        note += f"; align_document per document: {r['cost_per_document_cpu']['median']:.3f}"
    if "steps" in r:
        note += "; align_documents, where it goes (CPU, as a share of tokenization): " + ", ".join(
            f"{name.split(' (')[0]} {v['of_tokenization']:.3f}" for name, v in r["steps"].items())
    return note


def _same(reference: list[np.ndarray], candidate: list) -> bool:
    return len(reference) == len(candidate) and all(
        c is not None and np.array_equal(r, c, equal_nan=True) for r, c in zip(reference, candidate))


def _dtw_note(d: dict) -> str:
    return (f"DTW on {d['documents']} docs of median length ({d['student_tokens']:,} x {d['teacher_tokens']:,} tokens): "
            f"{d['dtw_cpu_s']:.1f} s vs align {1e3 * d['align_cpu_s']:.2f} ms, "
            f"direct speed-up {d['direct_speedup']:,.0f}x; "
            f"{1e9 * d['s_per_cell']:.0f} ns per DP cell, extrapolated to the whole text: "
            f"{d['extrapolated_s_chunked']:,.0f} s in {d['chunk']}-token blocks "
            f"({d['extrapolated_s_per_document']:,.0f} s per whole document) vs align "
            f"{d['align_all_cpu_s']:.3f} s; figure = the smaller of the direct and block-wise speed-ups; "
            f"student tokens with the same L_t under both: {100 * d['agreement']:.1f}%")


def _profile(fn) -> dict:
    """Where ``align_documents``' time goes: top functions by own time, as shares of the total."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        where = f"{file.rsplit('/', 2)[-1]}:{line}({name})" if file != "~" else name
        rows.append({"function": where, "calls": nc, "own_s": tt, "cumulative_s": ct, "own_share": tt / total})
    rows.sort(key=lambda r: -r["own_s"])
    return {"total_s": total, "top": rows[:15],
            "note": "cProfile adds per-call overhead; shares of own time, not absolute costs"}


def _steps(groups: list[tuple], how: str, tokenize_cpu: float) -> dict:
    """CPU seconds of each step of ``align_documents`` over all batches (min of 3 runs), and as a
    share of the student tokenization: exactly where the alignment time goes."""
    from pipeline.method.alignment import _align_monotone, _SharedLine, align_documents

    lines = [_SharedLine.of(s, t) for s, t in groups]
    steps = {
        "shared line (concatenate and shift the spans)": lambda: [_SharedLine.of(s, t) for s, t in groups],
        "fast-path check (teacher starts and ends non-decreasing)":
            lambda: [line.non_monotone_documents() for line in lines],
        "fast path (range counts, pair expansion, reduction)": lambda: [_align_monotone(line, how) for line in lines],
        "align_documents (all of it)": lambda: [align_documents(s, t, how) for s, t in groups],
    }
    out = {}
    for name, fn in steps.items():
        best = min(_cpu(fn) for _ in range(3))
        out[name] = {"cpu_s": best, "of_tokenization": best / tokenize_cpu}
    return out


def _cpu(fn) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _dtw(cfg, student_tok, teacher_tok, student, teacher, losses, align_all_cpu: float) -> dict:
    from benchmarks.dtw import dtw_align, dtw_cells
    from pipeline.method.alignment import align_document

    n_s = np.asarray([len(e) for e in student])
    median = float(np.median(n_s))
    order = np.argsort(np.abs(n_s - median), kind="stable")
    chosen, dtw_cpu, align_cpu, agree, agree_n = [], 0.0, 0.0, 0, 0
    for k in order[: cfg.dtw_docs]:
        if chosen and dtw_cpu > cfg.dtw_budget_s:
            break
        s, t, l = student[k], teacher[k], losses[k]
        c0 = time.process_time()
        peer = dtw_align(student_tok, s.ids, teacher_tok, t.ids, l)
        dtw_cpu += time.process_time() - c0
        reps = 50
        c0 = time.process_time()
        for _ in range(reps):
            ours = align_document(s, t.starts, t.ends, l, cfg.aggregate).teacher_loss
        align_cpu += (time.process_time() - c0) / reps
        agree += int(np.sum((peer == ours) | (np.isnan(peer) & np.isnan(ours))))
        agree_n += len(s)
        chosen.append(int(k))
    ns = [len(student[k]) for k in chosen]
    mt = [len(teacher[k]) for k in chosen]
    cells = dtw_cells(ns, mt)
    s_per_cell = dtw_cpu / cells
    all_s, all_t = [len(e) for e in student], [len(e) for e in teacher]
    per_doc = s_per_cell * dtw_cells(all_s, all_t)
    chunked = s_per_cell * dtw_cells(all_s, all_t, chunk=cfg.dtw_chunk)
    direct = dtw_cpu / align_cpu
    return {
        "documents": len(chosen), "doc_indices": chosen, "student_tokens": sum(ns), "teacher_tokens": sum(mt),
        "cells": cells, "dtw_cpu_s": dtw_cpu, "align_cpu_s": align_cpu, "direct_speedup": direct,
        "s_per_cell": s_per_cell, "chunk": cfg.dtw_chunk,
        "extrapolated_s_per_document": per_doc, "extrapolated_s_chunked": chunked,
        "align_all_cpu_s": align_all_cpu, "extrapolated_speedup_chunked": chunked / align_all_cpu,
        "extrapolated_speedup_per_document": per_doc / align_all_cpu,
        "speedup": min(direct, chunked / align_all_cpu),
        "agreement": agree / max(agree_n, 1),
        "method": "FuseLLM-style DTW over marker-stripped token strings, Levenshtein cost (memoised), "
                  "FuseLLM backtrack, max over paired teacher losses; CPU time",
    }
