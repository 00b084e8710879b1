"""What the guided selection keeps for a student, measured at its starting point (the base student).

For every token of the scored student corpus: the base student's loss ``l_s``, the teacher loss
``L_t`` aligned to it (token-level, max, as stage 2 does), and so the excess loss ``l_s - L_t``.
Tokens are grouped by the page kind of their document (clean math page or noise page, from the
corpus metadata). The top ``ratio`` of mapped tokens by excess loss is taken over the whole corpus
(stage 2 ranks within each batch of 2,048 tokens; over the corpus the shares are the same in
expectation, without the batch-to-batch spread). Unmapped tokens are always trained (``include``).

It answers: how much of what guided training keeps comes from noise pages, how the excess loss
is distributed by kind, and how well the student's tokens align with the teacher's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def page_kinds(files: list[Path]) -> dict[str, str]:
    """``<file>:<row>`` (stage 1's document id for a local Parquet corpus) -> the page's kind."""
    kinds = {}
    for f in files:
        for row, meta in enumerate(pq.read_table(f, columns=["metadata"]).column("metadata").to_pylist()):
            kinds[f"{Path(f).name}:{row}"] = json.loads(meta or "{}").get("kind", "?")
    return kinds


def token_losses(model, first: int, documents: list[np.ndarray], block: int, batch_size: int = 16) -> list[np.ndarray]:
    """Per document, (N,) next-token loss of each of its ids after ``first``, in windows of
    ``block`` inputs that each start with the previous window's last token (as the held-out bits
    per byte); windows of all documents are batched together."""
    import torch
    import torch.nn.functional as F

    windows = []  # (document, window ids)
    for d, ids in enumerate(documents):
        seq = [first, *ids.tolist()]
        windows += [(d, seq[start : start + block + 1]) for start in range(0, len(seq) - 1, block)]
    pieces: list[list[np.ndarray]] = [[] for _ in documents]
    with torch.inference_mode():
        for i in range(0, len(windows), batch_size):
            batch = windows[i : i + batch_size]
            width = max(len(w) for _, w in batch)
            x = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, (_, w) in enumerate(batch):
                x[r, : len(w)] = torch.tensor(w)
                mask[r, : len(w)] = 1
            logits = model(input_ids=x[:, :-1], attention_mask=mask[:, :-1]).logits.float()  # (B, T, V)
            loss = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # (B, T)
            for r, (d, w) in enumerate(batch):
                pieces[d].append(loss[r, : len(w) - 1].numpy())
    return [np.concatenate(p) if p else np.zeros(0, dtype=np.float32) for p in pieces]


def select_top(excess: np.ndarray, mapped: np.ndarray, ratio: float) -> np.ndarray:
    """Boolean mask of the ``ceil(ratio * n_mapped)`` mapped tokens with the largest excess loss
    (ties broken by position, as a stable sort does)."""
    chosen = np.zeros(excess.shape, dtype=bool)
    idx = np.flatnonzero(mapped)
    k = math.ceil(ratio * idx.size - 1e-6)
    if k > 0:
        order = np.argsort(-excess[idx], kind="stable")
        chosen[idx[order[:k]]] = True
    return chosen


def summarize_selection(kind: np.ndarray, l_s: np.ndarray, l_t: np.ndarray, mapped: np.ndarray,
                        ios: np.ndarray, ratio: float) -> dict:
    """Per page kind: shares of tokens, mapped tokens and kept tokens, and loss statistics."""
    excess = np.where(mapped, l_s - l_t, np.nan)
    kept = select_top(np.nan_to_num(excess, nan=-np.inf), mapped, ratio) | ~mapped
    out = {"ratio": ratio, "n_tokens": int(kind.size), "mapped_share": float(mapped.mean()) if kind.size else math.nan,
           "kept_share": float(kept.mean()) if kind.size else math.nan, "by_kind": {}}
    for k in sorted(set(kind.tolist())):
        m = kind == k
        mm = m & mapped
        ex = excess[mm]
        out["by_kind"][k] = {
            "tokens": int(m.sum()), "token_share": float(m.mean()),
            "kept_share_of_all_kept": float((kept & m).sum() / max(kept.sum(), 1)),
            "kept_rate": float(kept[m].mean()) if m.any() else math.nan,  # share of this kind's tokens kept
            "mapped_rate": float(mapped[m].mean()) if m.any() else math.nan,
            "ios_mean": float(np.nanmean(ios[mm])) if mm.any() else math.nan,
            "student_loss_mean": float(l_s[m].mean()) if m.any() else math.nan,
            "teacher_loss_mean": float(l_t[mm].mean()) if mm.any() else math.nan,
            "excess_mean": float(ex.mean()) if ex.size else math.nan,
            "excess_quantiles": {f"q{int(100 * q)}": float(np.quantile(ex, q)) for q in QUANTILES} if ex.size else {},
        }
    return out


def diagnose_selection(student_folder: str | Path, scored_folder: str | Path, corpus_files: list[Path],
                       ratio: float = 0.4, block: int = 256) -> dict:
    """:func:`summarize_selection` for a base student over a scored corpus, plus alignment quality
    (mean IoS over mapped tokens, mean document IoU) for the (teacher, student) pair."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.inspection.align_report import iter_aligned
    from storage_schemas.reader import ScoredDataset

    dataset = ScoredDataset.open(scored_folder)
    cache = Path(student_folder) / "repro_diagnosis.json"
    key = {"manifest": dataset.folders[0].manifest_sha256, "docs": dataset.n_documents, "ratio": ratio, "block": block,
           "corpus": sorted(Path(f).name for f in corpus_files), "version": 1}
    try:
        cached = json.loads(cache.read_text())
        if cached["key"] == json.loads(json.dumps(key, default=str)):
            return cached["result"]
    except (OSError, ValueError, KeyError):
        pass
    tokenizer = AutoTokenizer.from_pretrained(student_folder)
    model = AutoModelForCausalLM.from_pretrained(student_folder, use_safetensors=True)
    model.eval()
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    kinds = page_kinds(corpus_files)
    parts: dict[str, list[np.ndarray]] = {"kind": [], "l_s": [], "l_t": [], "mapped": [], "ios": []}
    doc_iou = []
    ids = []
    for record, aligned in iter_aligned(dataset, tokenizer, how="max", chunk_counts=()):
        n = len(aligned.student)
        if n == 0:
            continue
        ids.append(aligned.student.ids)
        parts["kind"].append(np.full(n, kinds.get(record.doc_id, "?"), dtype=object))
        parts["l_t"].append(aligned.teacher_loss.astype(np.float64))
        parts["mapped"].append(aligned.token.mapped)
        parts["ios"].append(aligned.token.ios)
        if not math.isnan(aligned.doc_iou):
            doc_iou.append(aligned.doc_iou)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small forwards: one thread is as fast, and spin-waiting threads starve on a busy machine
    try:
        parts["l_s"] = token_losses(model, first, ids, block)
    finally:
        torch.set_num_threads(threads)
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    out = summarize_selection(cat["kind"], cat["l_s"], cat["l_t"], cat["mapped"].astype(bool), cat["ios"], ratio)
    out["ios_mean"] = float(np.nanmean(cat["ios"][cat["mapped"].astype(bool)]))
    out["doc_iou_mean"] = float(np.mean(doc_iou)) if doc_iou else math.nan
    cache.write_text(json.dumps({"key": key, "result": out}, default=str))
    return out
