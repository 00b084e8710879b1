"""Alignment cost, and alignment against the peers' DTW, on >= 1 MiB of math text.

Sides, all single-threaded (``TOKENIZERS_PARALLELISM=false``), compared by process CPU time:

* ``tokenize``: :func:`pipeline.tokenization.encode_batch` of every document with the student
  tokenizer (one batch call, offsets included): the work alignment is measured against;
* ``align``: :func:`pipeline.align.align_document` for every document (max aggregation), given
  the student encodings and the teacher's spans and losses (teacher losses are random, NaN at the
  first token as for a teacher without BOS: alignment cost does not depend on the values);
* ``align_documents``: where the pipeline has it, its batch API
  :func:`pipeline.align.align_documents` over ``batch_docs`` documents per call (checked equal to
  ``align``). The figure is the faster of the pipeline's two ways;
* ``align_fast_doc`` and ``align_batched`` (proposals, :mod:`pipeline.bench.proposals`, checked
  equal to ``align`` first): the per-document fast path, and the batched alignment over
  ``batch_docs`` documents at a time, given the teacher's spans and losses flat per batch as a
  Parquet row group holds them.

The DTW baseline (:mod:`pipeline.bench.dtw`) is O(N M) per document, so it runs on a few documents
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

from pipeline.bench.measure import interleaved, ratio
from pipeline.bench.report import figure


@dataclass(frozen=True)
class AlignmentBenchConfig:
    min_bytes: int = 2**20
    seed: int = 0
    repeats: int = 5
    warmup: int = 1
    student: str = "llama-spm"
    teacher: str = "qwen2"
    aggregate: str = "max"
    batch_docs: int = 64  # documents per call of the batched proposal
    profile: bool = True
    dtw_docs: int = 4  # documents through DTW (at most; the time budget may stop earlier)
    dtw_budget_s: float = 20.0
    dtw_chunk: int = 2048  # FuseLLM aligns blocks of this many tokens
    target_cost: float = 0.05
    target_dtw_speedup: float = 100.0


def run(cfg: AlignmentBenchConfig, student_tokenizer, teacher_tokenizer) -> dict:
    from pipeline.align import align_document
    from pipeline.bench.inputs import math_texts
    from pipeline.bench.proposals import align_batch_max, fast_align_max
    from pipeline.tokenization import encode_batch

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

    def align_fast_doc():
        return [fast_align_max(s.starts, s.ends, t.starts, t.ends, l) for s, t, l in zip(student, teacher, losses)]

    batches = _batches(student, teacher, losses, [len(t) for t in texts], cfg.batch_docs)

    def align_batched():
        return [align_batch_max(*b) for b in batches]

    reference = [r.teacher_loss for r in align()]
    fast_doc = align_fast_doc()
    batched = [x for out in align_batched() for x in (out if out is not None else [None] * cfg.batch_docs)]
    exact = {
        "align_fast_doc": cfg.aggregate == "max" and _same(reference, fast_doc),
        "align_batched": cfg.aggregate == "max" and _same(reference, batched),
    }
    sides = {"tokenize": tokenize, "align": align}
    batch_api = getattr(__import__("pipeline.align", fromlist=["align"]), "align_documents", None)
    if batch_api is not None:
        groups = [(student[k : k + cfg.batch_docs], [(t.starts, t.ends, l) for t, l in
                   zip(teacher[k : k + cfg.batch_docs], losses[k : k + cfg.batch_docs])])
                  for k in range(0, len(student), cfg.batch_docs)]

        def align_documents():
            return [batch_api(s, t, cfg.aggregate) for s, t in groups]

        exact["align_documents"] = _same(reference, [a.teacher_loss for out in align_documents() for a in out])
        if exact["align_documents"]:
            sides["align_documents"] = align_documents
    sides.update({name: fn for name, fn in (("align_fast_doc", align_fast_doc), ("align_batched", align_batched))
                  if exact[name]})
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
        "proposals_exact": exact,
    }
    for name in ("align_fast_doc", "align_batched"):
        if name in samples:
            result[f"cost_{name}_cpu"] = ratio(samples[name].cpu, samples["tokenize"].cpu)
    if cfg.profile:
        result["profile"] = _profile(align)
        result["steps"] = _steps(student, teacher, losses, statistics.median(samples["tokenize"].cpu))
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
        note += "; align_document, where it goes (CPU, as a share of tokenization): " + ", ".join(
            f"{name.split(' (')[0]} {v['of_tokenization']:.3f}" for name, v in r["steps"].items())
    for name, label in (("align_fast_doc", "per-document fast path"), ("align_batched", "batched alignment")):
        if f"cost_{name}_cpu" in r:
            note += f"; proposal, {label} (identical output): {r[f'cost_{name}_cpu']['median']:.3f}"
    return note


def _same(reference: list[np.ndarray], candidate: list) -> bool:
    return len(reference) == len(candidate) and all(
        c is not None and np.array_equal(r, c, equal_nan=True) for r, c in zip(reference, candidate))


def _batches(student, teacher, losses, text_lengths, size: int) -> list[tuple]:
    """Arguments of :func:`align_batch_max` per batch of ``size`` documents; the teacher side flat,
    as the values and offsets of a Parquet row group's list columns are."""
    out = []
    for k in range(0, len(student), size):
        t = teacher[k : k + size]
        offsets = np.zeros(len(t) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in t], out=offsets[1:])
        out.append((
            [e.starts for e in student[k : k + size]], [e.ends for e in student[k : k + size]],
            np.concatenate([e.starts for e in t]), np.concatenate([e.ends for e in t]),
            np.concatenate(losses[k : k + size]), offsets, text_lengths[k : k + size],
        ))
    return out


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
    """Where ``align_document``'s time goes: top functions by own time, as shares of the total."""
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


def _steps(student, teacher, losses, tokenize_cpu: float) -> dict:
    """CPU seconds of each step of ``align_document`` over all documents (min of 3 runs), and as a
    share of the student tokenization: exactly where the alignment time goes."""
    from pipeline.align import _grouped_reduce, align_document, align_spans, overlap_pairs

    pairs = [overlap_pairs(s.starts, s.ends, t.starts, t.ends) for s, t in zip(student, teacher)]
    steps = {
        "int64 copies of the four offset arrays (align_spans converts them again inside overlap_pairs)":
            lambda: [[np.asarray(x, dtype=np.int64) for x in (s.starts, s.ends, t.starts, t.ends)]
                     for s, t in zip(student, teacher)],
        "align_spans (range search)": lambda: [align_spans(s.starts, s.ends, t.starts, t.ends)
                                               for s, t in zip(student, teacher)],
        "overlap_pairs (align_spans + pair expansion + exact-overlap filter)":
            lambda: [overlap_pairs(s.starts, s.ends, t.starts, t.ends) for s, t in zip(student, teacher)],
        "_grouped_reduce (float64 max over the pairs)":
            lambda: [_grouped_reduce(o, np.asarray(l, np.float64)[j], len(s), "max")
                     for (o, j), s, l in zip(pairs, student, losses)],
        "align_document (all of it)": lambda: [align_document(s, t.starts, t.ends, l)
                                               for s, t, l in zip(student, teacher, losses)],
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
    from pipeline.align import align_document
    from pipeline.bench.dtw import dtw_align, dtw_cells

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
