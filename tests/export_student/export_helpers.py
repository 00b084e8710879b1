"""Helpers of the export tests: a job builder, and an independent reference of what the export must
hold, computed by brute force from the scored Parquet files and the student tokenizer alone (no code
of the pipeline's student side)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.export_student.config import DataConfig, ExportConfig, ExportJobConfig, StudentConfig
from pipeline.student_data.settings import AlignmentConfig

NAN = float("nan")


def make_export(student: Path, folders, out: Path, seq_len: int = 32, **changes) -> ExportJobConfig:
    """An export job as the config would build it; ``changes`` go to the export group (``layout``,
    ``formats``, ``rows_per_shard``...), ``data`` and ``loss`` mappings to those groups."""
    data = {"folders": [str(f) for f in (folders if isinstance(folders, (list, tuple)) else [folders])],
            "cache_dir": str(out.parent / "lengths"), **changes.pop("data", {})}
    loss = {("method" if k == "alignment" else k): v for k, v in changes.pop("loss", {}).items()}
    overwrite = changes.pop("overwrite", False)
    export = {"rows_per_shard": 16, "progress": False, **changes}
    return ExportJobConfig(student=StudentConfig(name="t", model=str(student), seq_len=seq_len), data=DataConfig(**data),
                           export=ExportConfig(**export), alignment=AlignmentConfig(**loss), output_dir=str(out),
                           overwrite=overwrite)


def manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / "manifest.json").read_text())


def exported_rows(folder: Path) -> list[dict]:
    """Every row of an export's Parquet shards, in the manifest's order."""
    return [r for e in manifest(folder)["shards"] for r in pq.read_table(Path(folder) / e["file"]).to_pylist()]


# --------------------------------------------------------------------------------------------
# The reference (docs/METHOD.md §2.1, §2.4, §2.6 by hand)


def documented_order(rows_per_shard: list[int], seed: int, epochs: int, shuffle: bool) -> list[tuple[int, int]]:
    """(shard, row) in stream order: shards permuted by default_rng([seed, e]), rows inside shard s
    by default_rng([seed, e, s]) (METHOD §2.4)."""
    order = []
    for e in range(epochs):
        shards = np.random.default_rng([seed, e]).permutation(len(rows_per_shard)) if shuffle else range(len(rows_per_shard))
        for s in shards:
            n = rows_per_shard[int(s)]
            rows = np.random.default_rng([seed, e, int(s)]).permutation(n) if shuffle else range(n)
            order += [(int(s), int(r)) for r in rows]
    return order


def scored_documents(folder: Path) -> list[list[dict]]:
    """Each shard's rows (the manifest's shards, in order), read with pyarrow."""
    return [pq.read_table(Path(folder) / e["file"]).to_pylist() for e in manifest(folder)["shards"]]


def student_tokens(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    out = tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]


def brute_force_losses(spans, starts, ends, losses, how: str = "max") -> np.ndarray:
    """Per student span, ``how`` over the non-NaN losses of every teacher token overlapping it (NaN if none)."""
    out = np.full(len(spans), np.nan, np.float32)
    if not len(starts):
        return out
    a, b, t = np.asarray(starts), np.asarray(ends), np.asarray(losses, dtype=np.float32)
    for i, (c, d) in enumerate(spans):
        if d <= c:
            continue
        hit = t[(a < d) & (b > c) & ~np.isnan(t)]
        if hit.size:
            out[i] = {"max": hit.max, "min": hit.min}[how]()
    return out


def brute_force_chunks(spans, starts, ends, losses, n_chunks: int, text_len: int) -> np.ndarray:
    """METHOD §2.3: C equal character ranges, a token in the chunk of its start, each student token the
    mean of the finite teacher losses (non-empty spans) of its chunk."""
    def chunk(p):
        return min(max(p * n_chunks // text_len, 0), n_chunks - 1) if text_len > 0 else 0

    sums, counts = [0.0] * n_chunks, [0] * n_chunks
    for a, b, t in zip(starts, ends, losses):
        if b > a and not math.isnan(t):
            sums[chunk(a)] += float(t)
            counts[chunk(a)] += 1
    return np.asarray([np.float32(sums[chunk(c)] / counts[chunk(c)]) if d > c and counts[chunk(c)] else NAN
                       for c, d in spans], dtype=np.float32)


def reference_documents(folders, tokenizer, *, seed=0, shuffle=True, epochs=1, add_bos=None, add_eos=True,
                        how="max", combine="min", n_chunks=None) -> list[dict]:
    """The stream's documents as the export must hold them: doc_id, ids with BOS/EOS, the teacher
    loss of each token (several folders: one teacher each, combined by ``combine``). The stream
    follows the first folder's order; documents without a student token are left out."""
    teachers = [scored_documents(f) for f in (folders if isinstance(folders, (list, tuple)) else [folders])]
    by_id = [{r["doc_id"]: r for shard in t for r in shard} for t in teachers]
    if add_bos is None:  # as the tokenizer does itself
        add_bos = tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]
    docs = []
    for s, r in documented_order([len(x) for x in teachers[0]], seed, epochs, shuffle):
        row = teachers[0][s][r]
        ids, spans = student_tokens(tokenizer, row["text"])
        if not ids:
            continue
        per_teacher = []
        for t in by_id:
            tr = t[row["doc_id"]]
            if n_chunks:
                per_teacher.append(brute_force_chunks(spans, tr["starts"], tr["ends"], tr["losses"], n_chunks, len(row["text"])))
            else:
                per_teacher.append(brute_force_losses(spans, tr["starts"], tr["ends"], tr["losses"], how))
        stacked = np.stack(per_teacher, axis=1)  # (n, T)
        with np.errstate(all="ignore"):
            combined = {"min": np.nanmin, "max": np.nanmax}[combine](np.where(np.isnan(stacked), np.nan, stacked), axis=1) \
                if stacked.shape[1] > 1 else stacked[:, 0]
        head, tail = [tokenizer.bos_token_id] * add_bos, [tokenizer.eos_token_id] * add_eos
        pad = lambda x: np.concatenate([np.full(len(head), NAN, np.float32), x, np.full(len(tail), NAN, np.float32)])  # noqa: E731
        docs.append({"doc_id": row["doc_id"], "ids": np.asarray(head + ids + tail, np.int32),
                     "teacher_loss": pad(np.asarray(combined, np.float32)),
                     "per_teacher": [pad(p) for p in per_teacher]})
    return docs


def reference_packed(docs: list[dict], seq_len: int) -> list[dict]:
    """Rows ``stream[kL : kL + L + 1]`` with the documents each takes a part of."""
    ids = np.concatenate([d["ids"] for d in docs])
    loss = np.concatenate([d["teacher_loss"] for d in docs])
    ends = np.cumsum([len(d["ids"]) for d in docs])
    rows = []
    for k in range((len(ids) - 1) // seq_len):
        a, b = k * seq_len, k * seq_len + seq_len + 1
        parts = [(i, max(a, int(ends[i] - len(d["ids"]))), min(b, int(ends[i]))) for i, d in enumerate(docs)
                 if ends[i] - len(d["ids"]) < b and ends[i] > a]
        rows.append({"sample_index": k, "input_ids": ids[a:b], "teacher_loss": loss[a:b],
                     "doc_ids": [docs[i]["doc_id"] for i, _, _ in parts],
                     "doc_starts": [s - a for _, s, _ in parts],
                     "doc_offsets": [s - int(ends[i] - len(docs[i]["ids"])) for i, s, _ in parts]})
    return rows


def same_floats(a, b) -> bool:
    """Bit for bit (NaN at the same places, every other value identical)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(np.isnan(a), np.isnan(b))) and \
        bool(np.array_equal(a[~np.isnan(a)].view(np.uint32), b[~np.isnan(b)].view(np.uint32)))
