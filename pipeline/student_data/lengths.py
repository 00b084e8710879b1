"""Student token counts of the documents (METHOD 2.4), and the student/teacher token ratio of a sample.

:func:`measure_documents` runs once per student tokenizer and shard: every document of every
shard is tokenized with the student tokenizer to count its tokens, reading only the ``text``
column. The counts are cached as ``<cache_dir>/<tokenizer sha256[:16]>/<shard sha256>.npy``, so
later runs of one student reuse them. In a distributed run only the global rank 0 counts (and
reads and writes the cache); the other ranks, on any node, receive its counts, so the pass is done
once per run whether or not the nodes share the cache. A shard whose text cannot be decoded is
found here (an error naming the file, or skipped); the other columns are decoded by the
data-loader workers, which name the file and row group of a damaged one. With
``on_bad_shard="skip"`` this pass decodes every column instead, so that a damaged shard is left
out before the packing plan (:mod:`pipeline.student_data.packing`) is made.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow.parquet as pq
import torch

from pipeline.method.tokenization import fingerprint, require_fast
from storage_schemas.reader import BadShardError, ScoredDataset, ShardInfo, read_row_group

log = logging.getLogger(__name__)


def measure_documents(
    dataset: ScoredDataset,
    tokenizer,
    cache_dir: str | os.PathLike | None,
    *,
    num_proc: int = 1,
    on_bad_shard: str = "error",
) -> tuple[ScoredDataset, list[np.ndarray]]:
    """Student token counts per document, one int32 array per shard (module docstring).

    Returns the dataset (without the shards that failed to read when ``on_bad_shard="skip"``,
    which are added to its ``skipped`` list) and the counts of its shards, in order. Every rank
    of a distributed run gets the same result from one count on the global rank 0.
    """
    require_fast(tokenizer, "student tokenizer")
    full = on_bad_shard == "skip"
    results = _on_rank_zero(lambda: _shard_lengths(dataset, tokenizer, cache_dir, num_proc, full))
    bad = [{"file": str(s.path), "reason": r} for s, r in zip(dataset.shards, results) if isinstance(r, str)]
    if bad and on_bad_shard == "error":
        raise BadShardError("\n".join(f"{b['file']}: {b['reason']}" for b in bad))
    for b in bad:
        log.warning("skipping shard %s: %s", b["file"], b["reason"])
    keep = [i for i, r in enumerate(results) if not isinstance(r, str)]
    if not keep:
        raise BadShardError("no readable shard left:\n" + "\n".join(f"{b['file']}: {b['reason']}" for b in bad))
    kept = ScoredDataset(folders=dataset.folders, shards=[dataset.shards[i] for i in keep],
                         skipped=[*dataset.skipped, *bad])
    return kept, [results[i] for i in keep]


def _shard_lengths(dataset: ScoredDataset, tokenizer, cache_dir, num_proc: int, full: bool) -> list[np.ndarray | str]:
    """Each shard's token counts (from the cache, else counted and stored), or why it cannot be read."""
    folder = Path(cache_dir) / fingerprint(tokenizer)[:16] if cache_dir else None
    results: list[np.ndarray | str | None] = [_cached_lengths(folder, s) for s in dataset.shards]
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        log.info("counting student tokens of %d shard(s) (cached for later runs)", len(todo))
        if num_proc > 1 and len(todo) > 1:  # the tokenizer goes to each worker once, not with every shard
            with ProcessPoolExecutor(min(num_proc, len(todo)), mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_keep_tokenizer, initargs=(tokenizer,)) as pool:
                computed = list(pool.map(_count_shard_here, [(dataset.shards[i], full) for i in todo]))
        else:
            computed = [_count_shard((dataset.shards[i], tokenizer, full)) for i in todo]
        for i, value in zip(todo, computed):
            results[i] = value
            if folder is not None and not isinstance(value, str):
                _store_lengths(folder, dataset.shards[i], value)
    return results


def _on_rank_zero(compute):
    """``compute()`` on the global rank 0 only, its result (or its exception) handed to every rank
    of the process group; just ``compute()`` outside a distributed run. The other ranks wait in
    the broadcast, as long as the process group's timeout (``train.ddp_timeout``)."""

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return compute()
    message: list = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = ("ok", compute())
        except Exception as exc:  # the other ranks raise it too instead of waiting for ever
            try:
                pickle.dumps(exc)
                message[0] = ("error", exc)
            except Exception:
                message[0] = ("error", RuntimeError(f"{type(exc).__name__}: {exc}"))
    dist.broadcast_object_list(message, src=0)
    status, value = message[0]
    if status == "error":
        raise value
    return value


_WORKER_TOKENIZER = None  # a count worker's tokenizer (_keep_tokenizer)


def _keep_tokenizer(tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _count_shard_here(job: tuple[ShardInfo, bool]) -> np.ndarray | str:
    """:func:`_count_shard` in a count worker, with the tokenizer it was started with."""
    return _count_shard((job[0], _WORKER_TOKENIZER, job[1]))


def _count_shard(job: tuple[ShardInfo, object, bool]) -> np.ndarray | str:
    """Token counts of one shard's documents, or the reason it cannot be read. Reads the ``text``
    column only, or every column with ``full`` (decoding them all validates the file)."""
    shard, tokenizer, full = job
    counts = []
    try:
        for group in range(len(shard.row_group_rows)):
            table = read_row_group(shard, group, None if full else ["text"])
            counts += count_tokens(tokenizer, table.column("text").to_pylist())
    except BadShardError as exc:
        return str(exc)
    return np.asarray(counts, dtype=np.int32)


def count_tokens(tokenizer, texts: Sequence[str]) -> list[int]:
    """``len(encode_batch(tokenizer, texts)[i])`` without the offsets (4x faster): the same call of
    the same tokenizer, special-token strings kept as text. The data-loader workers check every
    document's length against these counts."""
    if not texts:
        return []
    out = tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True,
                    return_attention_mask=False, return_token_type_ids=False)
    return [len(ids) for ids in out["input_ids"]]


def sample_documents_of(shards: list, budget: int) -> tuple[list[str], np.ndarray]:
    """About ``budget`` documents from shards spread evenly (the first rows of their first row
    group): their texts and teacher token counts."""
    picks = np.unique(np.round(np.linspace(0, len(shards) - 1, min(len(shards), max(1, budget // 250)))).astype(int))
    per_shard = max(1, budget // len(picks))
    texts: list[str] = []
    teacher: list[int] = []
    for i in picks.tolist():
        shard = shards[i]
        meta = pq.ParquetFile(str(shard.path)).metadata  # manifest-opened shards lack their row groups
        shard = replace(shard, row_group_rows=tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
        table = read_row_group(shard, 0, ["text", "token_ids"])
        rows = min(per_shard, table.num_rows)
        texts += table.column("text").slice(0, rows).to_pylist()
        teacher += [len(x) for x in table.column("token_ids").slice(0, rows).to_pylist()]
    return texts, np.asarray(teacher, dtype=np.float64)


def student_per_teacher_token(shards: list, tokenizer, budget: int = 250) -> float | None:
    """Student tokens per teacher token over a sample of documents (:func:`sample_documents_of`);
    None without a teacher token in the sample."""
    texts, teacher = sample_documents_of(shards, budget) if shards else ([], np.zeros(0))
    total = float(teacher.sum())
    if not texts or total <= 0:
        return None
    ids = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # as count_tokens
    return sum(len(x) for x in ids) / total


def _cache_file(folder: Path, shard: ShardInfo) -> Path | None:
    return folder / f"{shard.sha256}.npy" if shard.sha256 else None


def _cached_lengths(folder: Path | None, shard: ShardInfo) -> np.ndarray | None:
    path = _cache_file(folder, shard) if folder else None
    if path is None or not path.is_file():
        return None
    try:
        lengths = np.load(path)
    except (OSError, ValueError):
        return None
    return lengths if lengths.shape == (shard.rows,) else None


def _store_lengths(folder: Path, shard: ShardInfo, lengths: np.ndarray) -> None:
    path = _cache_file(folder, shard)
    if path is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{path.stem}.tmp-{uuid.uuid4().hex[:8]}.npy"
    np.save(tmp, lengths)
    os.replace(tmp, path)  # concurrent runs of one student write identical files
