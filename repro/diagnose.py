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

import hashlib
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


# --------------------------------------------------------------------------------------------
# Claim 7: what the selection takes at each ratio, on the batches stage 2 forms


PAGE_KINDS = ("clean", "noise")  # math pages and noise pages of the student corpus (other kinds are counted in neither)
TOP_IDS = 10  # the concentration on token ids: the share of the selection taken by its most frequent ids


def selection_stats(batches: list[dict[str, np.ndarray]]) -> dict:
    """What one selection takes, over diagnosed micro-batches. Each batch holds (B, L) arrays:
    ``l_s`` (student loss), ``l_t`` (teacher loss, NaN where unmapped), ``mapped``, ``valid``,
    ``kind`` (page kind of the target's document), ``doc`` (its document), ``ids`` (the target
    token), ``trained`` and ``selected`` (the loss's masks, :func:`pipeline.method.guided_loss.select_tokens`).

    Returns: the share of the selected (mapped) tokens from each page kind and the rate at which
    each kind's candidates are selected; the mean teacher loss, excess loss ``l_s - l_t`` and
    student loss of the selected tokens; the share of the trained tokens that are unmapped (always
    trained under ``include``); and how concentrated the selection is: the effective number of
    documents per batch (``exp`` of the entropy of the selected tokens over documents), the largest
    share of a batch's selection in one sequence, and the share taken by the selection's
    ``TOP_IDS`` most frequent token ids."""
    cat = {k: np.concatenate([b[k].reshape(-1) for b in batches]) for k in ("l_s", "l_t", "mapped", "valid", "kind",
                                                                               "ids", "trained", "selected")}
    cand = cat["mapped"] & cat["valid"] & ~np.isnan(cat["l_t"])
    sel = cat["selected"] & cand
    n_sel = int(sel.sum())
    excess = cat["l_s"] - cat["l_t"]
    out: dict = {"batches": len(batches), "tokens": int(cat["valid"].sum()), "candidates": int(cand.sum()),
                 "selected": n_sel, "trained": int(cat["trained"].sum()),
                 "selected_share": {}, "selected_rate": {}, "teacher_loss_by_kind": {}, "excess_by_kind": {}}
    for k in PAGE_KINDS:
        of_kind = sel & (cat["kind"] == k)
        out["selected_share"][k] = float(of_kind.sum() / n_sel) if n_sel else math.nan
        c = cand & (cat["kind"] == k)
        out["selected_rate"][k] = float(of_kind.sum() / c.sum()) if c.any() else math.nan
        out["teacher_loss_by_kind"][k] = float(cat["l_t"][of_kind].mean()) if of_kind.any() else math.nan
        out["excess_by_kind"][k] = float(excess[of_kind].mean()) if of_kind.any() else math.nan
    out["teacher_loss"] = float(cat["l_t"][sel].mean()) if n_sel else math.nan
    out["excess"] = float(excess[sel].mean()) if n_sel else math.nan
    out["student_loss"] = float(cat["l_s"][sel].mean()) if n_sel else math.nan
    trained = cat["trained"] & cat["valid"]
    out["unmapped_share_of_trained"] = float((trained & ~sel).sum() / trained.sum()) if trained.any() else math.nan
    docs_eff, top_seq = [], []
    for b in batches:
        s = b["selected"] & b["mapped"] & b["valid"] & ~np.isnan(b["l_t"])  # (B, L)
        if not s.any():
            continue
        _, counts = np.unique(b["doc"][s], return_counts=True)
        p = counts / counts.sum()
        docs_eff.append(float(np.exp(-(p * np.log(p)).sum())))
        top_seq.append(float(s.sum(axis=1).max() / s.sum()))
    out["docs_effective"] = float(np.mean(docs_eff)) if docs_eff else math.nan
    out["top_sequence_share"] = float(np.mean(top_seq)) if top_seq else math.nan
    if n_sel:
        _, counts = np.unique(cat["ids"][sel], return_counts=True)
        out["top_ids_share"] = float(np.sort(counts)[::-1][:TOP_IDS].sum() / n_sel)
    else:
        out["top_ids_share"] = math.nan
    return out


def diagnosis_batches(job, corpus_files: list[Path], n_batches: int) -> tuple[list[dict[str, np.ndarray]], dict]:
    """The micro-batches stage 2 would form right after the run's last trained sample (the same
    data order for every arm of one seed, unseen by all of them): (B, L) ``input_ids``, ``ids``
    (targets), ``l_t``, ``mapped``, ``valid``, ``doc`` and ``kind`` per batch, and where they are."""
    from pipeline.method.tokenization import load_tokenizer

    tokenizer = load_tokenizer(job.student.tokenizer or job.student.model)
    batches, where, data, doc_ids = _batches(job, tokenizer, n_batches)
    kinds = page_kinds(corpus_files)
    for b in batches:
        b["kind"] = np.vectorize(lambda d: kinds.get(doc_ids(d), "?"), otypes=[object])(b["doc"])
    return batches, where


def diagnosis_batches_of(job, tokenizer, n_batches: int) -> tuple[list[dict[str, np.ndarray]], dict]:
    """:func:`diagnosis_batches` without page kinds (a corpus without the sample corpus's metadata)."""
    batches, where, _, _ = _batches(job, tokenizer, n_batches)
    return batches, where


def _batches(job, tokenizer, n_batches: int):
    from pipeline.train_student.config import batch_geometry
    from pipeline.train_student.data import prepare_data

    data = prepare_data(job, tokenizer)
    accumulation, _ = batch_geometry(job, 1)
    size = job.train.micro_batch_size
    first = job.train.max_steps * size * accumulation  # the first sample no run of this seed trained on
    unseen = first + n_batches * size <= data.plan.n_samples
    if not unseen:
        first = max(0, data.plan.n_samples - n_batches * size)
    names: dict[int, str] = {}

    def doc_ids(d: int) -> str:
        """The stored doc_id of the plan's document ``d``."""
        if d not in names:
            shard = data.dataset.shards[int(data.plan.doc_shard[d])]
            column = pq.read_table(shard.path, columns=["doc_id"]).column("doc_id")
            names[d] = column[int(data.plan.doc_row[d])].as_py()
        return names[d]

    batches = []
    for start in range(first, min(first + n_batches * size, data.plan.n_samples) - size + 1, size):
        windows = data.dataset.windows(range(start, start + size))
        doc = np.stack([np.concatenate([np.full(b - a, d) for d, a, b in w.documents])[1:] for w in windows])  # (B, L)
        ids = np.stack([w.ids for w in windows])  # (B, L + 1)
        batches.append({"input_ids": ids[:, :-1], "ids": ids[:, 1:], "doc": doc,
                        "l_t": np.stack([w.teacher_loss[1:] for w in windows]).astype(np.float32),
                        "mapped": np.stack([w.mapped[1:] for w in windows]), "valid": np.ones(ids[:, 1:].shape, bool)})
    return batches, {"first_sample": first, "samples": len(batches) * size, "unseen": unseen,
                     "samples_in_the_stream": data.plan.n_samples, "sequences_per_batch": size}, data, doc_ids


def batch_losses(model_folder: str | Path, batches: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """The model's (B, L) per-token loss on each batch (float32, as the trainer computes it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.method.guided_loss import token_cross_entropy

    model = AutoModelForCausalLM.from_pretrained(str(model_folder), use_safetensors=True, torch_dtype=torch.float32)
    model.eval()
    out = []
    with torch.inference_mode():
        for b in batches:
            logits = model(input_ids=torch.from_numpy(b["input_ids"])).logits  # (B, L, V)
            out.append(token_cross_entropy(logits, torch.from_numpy(b["ids"])).numpy())
    return out


def select(batches: list[dict[str, np.ndarray]], losses: list[np.ndarray], config) -> list[dict[str, np.ndarray]]:
    """The batches with ``l_s`` and the ``trained``/``selected`` masks of ``config`` (a
    :class:`pipeline.method.guided_loss.SelectionConfig`; guided or cpt), as the trainer's loss selects."""
    import torch

    from pipeline.method.guided_loss import select_tokens

    out = []
    for b, l_s in zip(batches, losses):
        trained, selected = select_tokens(torch.from_numpy(l_s), torch.from_numpy(b["valid"]),
                                          torch.from_numpy(b["l_t"]), torch.from_numpy(b["mapped"]), config)
        out.append({**b, "l_s": l_s, "trained": trained.numpy(), "selected": selected.numpy()})
    return out


def loss_groups(batches: list[dict[str, np.ndarray]], base_losses: list[np.ndarray], ratios=(0.1, 0.4)) -> list[dict[str, np.ndarray]]:
    """Masks of the tokens by what the base student's guided selection (batch ranking) takes at
    ``ratios``: math-page tokens in its top ``ratios[0]``, between ``ratios[0]`` and ``ratios[1]``, the
    other math-page tokens; and noise-page tokens; (B, L) bool per batch and group."""
    from pipeline.method.guided_loss import SelectionConfig

    low = select(batches, base_losses, SelectionConfig(ratio=ratios[0]))
    high = select(batches, base_losses, SelectionConfig(ratio=ratios[1]))
    groups = []
    for b, lo, hi in zip(batches, low, high):
        clean, noise = b["kind"] == "clean", b["kind"] == "noise"
        groups.append({f"math, top {ratios[0]:.0%}": clean & lo["selected"],
                       f"math, top {ratios[0]:.0%}-{ratios[1]:.0%}": clean & hi["selected"] & ~lo["selected"],
                       "math, rest": clean & ~hi["selected"] & b["valid"], "noise": noise & b["valid"]})
    return groups


def mean_by_group(losses: list[np.ndarray], groups: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Mean loss over each group's tokens, pooled over batches."""
    names = list(groups[0]) if groups else []
    out = {}
    for g in names:
        total = sum(float(l_s[m].sum()) for l_s, grp in zip(losses, groups) for m in [grp[g]])
        count = sum(int(grp[g].sum()) for grp in groups)
        out[g] = total / count if count else math.nan
    return out


DIAGNOSIS_VERSION = 1  # names what a cached sweep diagnosis holds


def diagnose_sweep(tasks: list, base_folder: str | Path, corpus_files: list[Path], seeds: list[int], n_batches: int,
                   cache_dir: Path | None = None) -> dict:
    """Claim 7's diagnosis: for each seed, ``n_batches`` micro-batches of the run's data order that
    no run trained on (:func:`diagnosis_batches`); on them, what each guided arm's selection takes
    (:func:`selection_stats`) at the start (the base student ranks) and at the end (the arm's own
    final student ranks), next to all mapped tokens (what a random selection takes in
    expectation); and each final student's mean loss on token groups defined by the base
    student's selection (:func:`loss_groups`). ``tasks``: the runs (:class:`repro.runner.RunTask`)
    of one student, teacher and corpus, alignment as ``guided``'s, that differ only in
    ``loss.mode``/``ratio``/``rank_over``. Figures are means over ``seeds``; each seed's are kept."""
    from pipeline.method.guided_loss import SelectionConfig

    tasks = [t for t in tasks if t.seed in seeds and (Path(t.job.output_dir) / "final").is_dir()]
    key = {"runs": sorted(t.key() for t in tasks), "n_batches": n_batches, "base": str(base_folder),
           "version": DIAGNOSIS_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache = None if cache_dir is None else Path(cache_dir) / f"sweep-{digest}.json"
    if cache is not None and cache.is_file():
        return json.loads(cache.read_text())
    per_seed = {}
    for seed in sorted({t.seed for t in tasks}):
        mine = sorted((t for t in tasks if t.seed == seed), key=lambda t: t.arm)
        batches, where = diagnosis_batches(mine[0].job, corpus_files, n_batches)
        base = batch_losses(base_folder, batches)
        finals = {t.arm: batch_losses(Path(t.job.output_dir) / "final", batches) for t in mine}
        rows = [{"arm": "all mapped tokens", "mode": "random", "ratio": None, "rank_over": None, "when": "start",
                 "stats": selection_stats(select(batches, base, SelectionConfig(mode="cpt")))}]
        for t in mine:
            cfg = t.job.selection
            if cfg.mode != "guided":
                continue
            for when, losses in (("start", base), ("end", finals[t.arm])):
                rows.append({"arm": t.arm, "mode": cfg.mode, "ratio": cfg.ratio, "rank_over": cfg.rank_over, "when": when,
                             "stats": selection_stats(select(batches, losses, SelectionConfig(
                                 mode="guided", ratio=cfg.ratio, rank_over=cfg.rank_over, unmapped=cfg.unmapped)))})
        groups = loss_groups(batches, base)
        learned = {"base": mean_by_group(base, groups), **{arm: mean_by_group(x, groups) for arm, x in finals.items()}}
        sizes = {g: int(sum(grp[g].sum() for grp in groups)) for g in groups[0]} if groups else {}
        per_seed[seed] = {"where": where, "selection": rows, "learned": learned, "group_tokens": sizes}
    out = {"seeds": sorted(per_seed), "n_batches": n_batches, "per_seed": per_seed,
           "selection": _mean_rows([s["selection"] for s in per_seed.values()]),
           "learned": _mean_tree([s["learned"] for s in per_seed.values()]),
           "group_tokens": _mean_tree([s["group_tokens"] for s in per_seed.values()])}
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(out, default=str))
    return out


def _mean_tree(trees: list):
    """The element-wise mean of equally shaped nested dicts of numbers (NaN-ignoring; keys of the first)."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: _mean_tree([t[k] for t in trees if isinstance(t, dict) and k in t]) for k in first}
    values = [float(t) for t in trees if t is not None and not (isinstance(t, float) and math.isnan(t))]
    return float(np.mean(values)) if values else math.nan


def _mean_rows(per_seed: list[list[dict]]) -> list[dict]:
    """Selection rows averaged over seeds, matched by (arm, when)."""
    order = [(r["arm"], r["when"]) for r in per_seed[0]] if per_seed else []
    out = []
    for arm, when in order:
        rows = [r for rows in per_seed for r in rows if (r["arm"], r["when"]) == (arm, when)]
        out.append({**{k: v for k, v in rows[0].items() if k != "stats"}, "seeds": len(rows),
                    "stats": _mean_tree([r["stats"] for r in rows])})
    return out
