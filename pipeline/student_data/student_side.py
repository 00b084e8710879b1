"""The student side of a scored dataset: student tokenization, alignment to the teacher's losses,
several teachers combined, packing (METHOD 2.1, 2.3, 2.4, 2.6).

One implementation for the two consumers: stage 2 trains on it (:mod:`pipeline.train_student`) and
``make export-student`` writes it out for other trainers (:mod:`pipeline.export_student`), so the
exported rows are the training samples, bit for bit.

The data is a *map-style* dataset of packed samples, so that its order and the position
in it are plain numbers: sample ``k`` is always the same tokens, and a resumed run that skips the
first ``n`` samples sees exactly the batches an uninterrupted run would have seen.

How it is built
---------------
1. **Lengths** (:func:`measure_documents`, once per student tokenizer and shard): every document
   of every shard is tokenized with the student tokenizer to count its tokens, reading only the
   ``text`` column. The counts are cached as ``<cache_dir>/<tokenizer sha256[:16]>/<shard
   sha256>.npy``, so later runs of one student reuse them. In a distributed run only the global
   rank 0 counts (and reads and writes the cache); the other ranks, on any node, receive its
   counts, so the pass is done once per run whether or not the nodes share the cache. A shard
   whose text cannot be decoded is found here (an error naming the file, or skipped); the other
   columns are decoded by the data-loader workers, which name the file and row group of a
   damaged one. With ``on_bad_shard="skip"`` this pass decodes every column instead, so that a
   damaged shard is left out before the packing plan is made.
2. **Order** (:func:`build_plan`): for each epoch ``e`` the shards are permuted with
   ``default_rng([seed, e])`` and the rows inside each shard with ``default_rng([seed, e, shard])``
   (``shuffle=false`` keeps file order). Shuffling stays within shards so that reading stays local
   (one decoded row group serves many samples); it is a pure function of ``(seed, epoch)``.
   The epochs are concatenated into one stream, so the trainer sees a single pass.
3. **Packing**: each document contributes ``[BOS] tokens [EOS]`` to the stream (BOS when the
   student's tokenizer adds one itself, as Llama's does; EOS between documents always). Documents
   with no student token (empty text) contribute nothing and are counted. Sample ``k`` is the
   window ``stream[k L : k L + L + 1]``: ``input_ids`` its first ``L`` tokens, ``labels`` its last
   ``L``, so consecutive samples overlap by one token and every token after the first is a
   target exactly once. The last partial window is dropped. Documents are not isolated by an
   attention mask (as in the paper's LitGPT pretraining); EOS marks the boundary.
4. **Alignment** (:class:`PackedDataset`, in data-loader workers): the documents of a batch of
   samples, and of the samples the worker will be asked for next, are tokenized with offsets in
   one call (:func:`pipeline.method.tokenization.encode_batch`, special-token strings stay text), aligned
   to the teacher's spans in one call (:func:`pipeline.method.alignment.align_documents`), cached and sliced. Each
   position carries its target id, ``teacher_loss`` (the aggregated ``L_t`` of the target, NaN
   where unmapped) and ``mapped``. BOS/EOS are unmapped; so is every token of a document the
   teacher stored with zero tokens (whitespace-only texts): such documents are trained as unmapped.

Several teachers (METHOD 2.6): :func:`build_student_data` takes one scored dataset per teacher,
matches their documents (:func:`pipeline.student_data.several_teachers.match_teachers`), plans the stream
of the matched documents, and each worker aligns every document to each teacher separately and
combines the losses per student token; each position then also carries every teacher's ``L_t``
(``teacher_losses``, (L, T)) for the per-teacher metrics. With one teacher nothing of this runs.

Alignment methods: ``token`` (METHOD 2.1 span overlap, aggregated with max/mean/min), ``chunk``
(the C-chunk ablation, a mean per chunk) and ``one_to_one`` (same-vocabulary Rho-1; needs identical
spans). :func:`resolve_alignment` turns ``token`` into ``one_to_one`` when the student's tokenizer
is the teacher's (same sha256 fingerprint), as METHOD asks for identical tokenizers, and refuses
``one_to_one`` asked for with another tokenizer.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import pickle
import uuid
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pyarrow.parquet as pq
import torch

from pipeline.method.alignment import (
    AGGREGATIONS,
    DocumentAlignment,
    align_document,
    align_documents,
)
from pipeline.runtime.config import ConfigError, UserError, check_at_least, check_choice, refuse
from pipeline.student_data.several_teachers import (
    COMBINATIONS,
    TeacherMatch,
    combine_losses,
    file_name,
    match_teachers,
    teacher_names,
)
from pipeline.method.tokenization import bos_token_id, encode_batch, fingerprint, require_fast
from storage_schemas import MANIFEST_NAME
from storage_schemas import filesystem as sfs
from storage_schemas.reader import (
    BadShardError,
    ScoredDataset,
    ShardInfo,
    ShardReader,
    read_row_group,
)

log = logging.getLogger(__name__)


def scored_folder_problems(folders, setting: str = "data.folders") -> list[str]:
    """Each of ``folders`` (as the config wrote them) that does not exist, or that is a local folder
    holding no scored dataset, with the fix: the datasets found inside it (a corpus or teacher
    folder given without its ``/v1``), or how to make one."""
    found = []
    for folder in folders if isinstance(folders, list) else []:
        if not isinstance(folder, str):
            continue
        if not sfs.is_dir(folder):
            found.append(f"{setting}: scored dataset folder not found: {folder} (score the corpus first: make "
                         f"score-teacher with the same teacher and data, or point {setting} at a scored dataset)")
        elif not sfs.is_remote(folder) and not (Path(folder) / MANIFEST_NAME).is_file():
            inside = sorted(str(m.parent) for pattern in ("*/" + MANIFEST_NAME, "*/*/" + MANIFEST_NAME)
                            for m in Path(folder).glob(pattern))
            fix = (f"the dataset(s) inside it: {', '.join(inside[:3])}{' ...' if len(inside) > 3 else ''}; "
                   f"e.g. {setting}=[{inside[0]}]" if inside else
                   "a scored dataset is the folder make score-teacher writes, <output_root>/<corpus>/<teacher>/v1")
            found.append(f"{setting}: {folder} holds no scored dataset (no {MANIFEST_NAME}); {fix}")
    return found


class StudentDataError(UserError, ValueError):
    """A scored row that does not fit the student data plan or the other teachers (names the file and row)."""


ALIGNMENTS = ("token", "chunk", "one_to_one")


@dataclass(frozen=True)
class AlignmentConfig:
    """How teacher losses reach student tokens (docs/METHOD.md §2.1; chunk and one_to_one: §2.3).
    The one place the aggregation choice is checked for a configuration."""

    method: str = "token"  # token | chunk | one_to_one (written loss.alignment in the stage config)
    aggregate: str = "max"  # max | mean | min (token-level only)
    n_chunks: int = 8  # chunk-level only: C
    # Several teachers (§2.6): how their L_t combine per student token; one teacher ignores both.
    combine: str = "min"  # min | mean | max | weighted (make repro measures the modes)
    teacher_weights: list[float] | None = None  # weighted only: one per teacher, in data.folders' teacher order

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "method", self.method, ALIGNMENTS)
        check_choice(found, "aggregate", self.aggregate, AGGREGATIONS)
        check_at_least(found, "n_chunks", self.n_chunks, 1)
        check_choice(found, "combine", self.combine, COMBINATIONS)
        weights = self.teacher_weights
        if self.combine == "weighted" and not weights:
            found.append("teacher_weights: combine=weighted needs one weight per teacher")
        if weights and self.combine != "weighted":
            found.append(f"teacher_weights: only read by combine=weighted (combine is {self.combine})")
        if weights and not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0 for w in weights):
            found.append(f"teacher_weights: {list(weights)} must all be finite and > 0")
        return found

    def __post_init__(self) -> None:
        refuse(self)


@dataclass(frozen=True)
class PackingConfig:
    """How documents become fixed-length samples (docs/METHOD.md §2.4)."""

    seq_len: int
    seed: int = 0
    shuffle: bool = True
    epochs: int = 1  # passes over the documents, concatenated into one stream
    add_bos: bool | None = None  # None: when the student's tokenizer adds one itself
    add_eos: bool = True

    def problems(self) -> list[str]:
        found: list[str] = []
        check_at_least(found, "seq_len", self.seq_len, 1)
        check_at_least(found, "epochs", self.epochs, 1)
        return found

    def __post_init__(self) -> None:
        refuse(self)


def resolve_alignment(config: AlignmentConfig, tokenizer, teacher_identity: dict) -> AlignmentConfig:
    """``token`` becomes ``one_to_one`` when the student tokenizer is the teacher's (same fingerprint);
    ``one_to_one`` asked for with another tokenizer is refused (:class:`ConfigError`), before any
    token is counted or aligned."""
    teacher = teacher_identity.get("teacher") or {}
    teacher_sha = teacher.get("tokenizer_sha256")
    student_sha = fingerprint(tokenizer) if teacher_sha else None
    if config.method == "token" and teacher_sha and teacher_sha == student_sha:
        log.info("student and teacher share the tokenizer: one-to-one alignment (same-vocabulary Rho-1)")
        return replace(config, method="one_to_one")
    if config.method == "one_to_one" and teacher_sha and teacher_sha != student_sha:
        raise ConfigError(
            f"loss.alignment: one_to_one needs the same tokenizer for student and teacher (it pairs student token i "
            f"with teacher token i), and these differ (the student's tokenizer sha256 {student_sha[:12]}, teacher "
            f"{teacher.get('name')}'s {teacher_sha[:12]}); use loss.alignment=token (the default: it aligns by "
            "character spans across tokenizers, and is one-to-one by itself where they are the same) or "
            "loss.alignment=chunk")
    return config


# --------------------------------------------------------------------------------------------
# 1. Lengths


def measure_documents(
    dataset: ScoredDataset,
    tokenizer,
    cache_dir: str | os.PathLike | None,
    *,
    num_proc: int = 1,
    on_bad_shard: str = "error",
) -> tuple[ScoredDataset, list[np.ndarray]]:
    """Student token counts per document, one int32 array per shard (module docstring, step 1).

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


# --------------------------------------------------------------------------------------------
# 2-3. Order and packing plan


@dataclass(frozen=True)
class PackPlan:
    """The packed stream: which document comes where, and the samples cut from it."""

    doc_shard: np.ndarray  # (D,) int32 shard index of each document in stream order
    doc_row: np.ndarray  # (D,) int32 row within its shard
    doc_end: np.ndarray  # (D,) int64 stream position where each document (with BOS/EOS) ends
    seq_len: int
    add_bos: bool
    add_eos: bool
    n_empty: int  # documents left out for having no student token (all epochs)
    epochs: int = 1  # passes over the documents the stream holds (concatenated)

    @property
    def n_tokens(self) -> int:
        return int(self.doc_end[-1]) if self.doc_end.size else 0

    @property
    def n_samples(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def documents_of(self, k: int) -> list[tuple[int, int, int]]:
        """``(doc position, start, stop)`` of sample ``k``: stream slices inside each document."""
        if not 0 <= k < self.n_samples:
            raise IndexError(f"sample {k} outside 0..{self.n_samples - 1}")
        start, stop = k * self.seq_len, k * self.seq_len + self.seq_len + 1
        out = []
        d = int(np.searchsorted(self.doc_end, start, side="right"))
        while start < stop:
            doc_start = int(self.doc_end[d - 1]) if d else 0
            end = min(stop, int(self.doc_end[d]))
            out.append((d, start - doc_start, end - doc_start))
            start, d = end, d + 1
        return out

    def document_span(self, first: int, last: int) -> range:
        """Positions of the documents samples ``first..last`` (inclusive) take tokens from."""
        start, stop = first * self.seq_len, last * self.seq_len + self.seq_len + 1
        return range(int(np.searchsorted(self.doc_end, start, side="right")),
                     int(np.searchsorted(self.doc_end, stop - 1, side="right")) + 1)

    def document_length(self, d: int) -> int:
        """Stream tokens of the document at position ``d`` (BOS and EOS included)."""
        return int(self.doc_end[d] - (self.doc_end[d - 1] if d else 0))

    def summary(self) -> dict:
        return {"seq_len": self.seq_len, "n_documents": int(self.doc_row.size), "n_empty": self.n_empty,
                "n_tokens": self.n_tokens, "n_samples": self.n_samples, "add_bos": self.add_bos,
                "add_eos": self.add_eos}


def document_tokens(packing: Mapping, epochs: int) -> int:
    """The documents' own student tokens in one pass: what every command calls "student tokens"
    (``plan=true``, train-student's and export-student's summaries). A packing summary
    (:meth:`PackPlan.summary`, an export's packing record) counts the stream, ``n_tokens``: each
    document with its BOS/EOS, in each of the ``epochs`` passes."""
    per_document = int(bool(packing["add_bos"])) + int(bool(packing["add_eos"]))
    return (int(packing["n_tokens"]) - int(packing["n_documents"]) * per_document) // max(1, epochs)


def document_order(rows_per_shard: Sequence[int], seed: int, epoch: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(shard, row)`` arrays of one epoch's document order (module docstring, step 2)."""
    n_shards = len(rows_per_shard)
    shard_order = np.random.default_rng([seed, epoch]).permutation(n_shards) if shuffle else np.arange(n_shards)
    shards, rows = [], []
    for s in shard_order:
        n = int(rows_per_shard[s])
        rows.append(np.random.default_rng([seed, epoch, int(s)]).permutation(n) if shuffle else np.arange(n))
        shards.append(np.full(n, s, dtype=np.int32))
    if not shards:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    return np.concatenate(shards), np.concatenate(rows).astype(np.int32)


def build_plan(lengths: Sequence[np.ndarray], config: PackingConfig, add_bos: bool) -> PackPlan:
    """The packing plan for ``config.epochs`` concatenated epochs (module docstring, steps 2-3)."""
    shards, rows = zip(*(document_order([len(x) for x in lengths], config.seed, e, config.shuffle)
                         for e in range(config.epochs)))
    doc_shard, doc_row = np.concatenate(shards), np.concatenate(rows)
    offsets = np.cumsum([0, *[len(x) for x in lengths]])
    flat = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
    n_student = flat[offsets[doc_shard] + doc_row]  # (D,)
    keep = n_student > 0
    stream_len = n_student[keep] + int(add_bos) + int(config.add_eos)
    return PackPlan(
        doc_shard=doc_shard[keep], doc_row=doc_row[keep], doc_end=np.cumsum(stream_len),
        seq_len=config.seq_len, add_bos=add_bos, add_eos=config.add_eos, n_empty=int((~keep).sum()),
        epochs=config.epochs,
    )


# --------------------------------------------------------------------------------------------
# 4. The dataset


@dataclass(frozen=True)
class StudentDocument:
    """One document as it enters the stream: ids with BOS/EOS, ``L_t`` and mapped per token."""

    ids: np.ndarray  # (n,) int64
    teacher_loss: np.ndarray  # (n,) float32, NaN where unmapped
    mapped: np.ndarray  # (n,) bool
    teacher_losses: np.ndarray | None = None  # (n, T) float32 per teacher, several teachers only


@dataclass(frozen=True)
class Window:
    """Sample ``k`` as a slice of the stream, ``stream[kL : kL + L + 1]``, before it is split into
    inputs (its first ``L`` tokens) and targets (its last ``L``): each token with its own ``L_t``."""

    index: int  # k
    ids: np.ndarray  # (L+1,) int64
    teacher_loss: np.ndarray  # (L+1,) float32, NaN where unmapped
    mapped: np.ndarray  # (L+1,) bool
    teacher_losses: np.ndarray | None  # (L+1, T) several teachers only
    documents: list[tuple[int, int, int]]  # (stream position, start, stop) of each document's part

    @classmethod
    def of(cls, k: int, parts: list[tuple[StudentDocument, int, int]], documents: list[tuple[int, int, int]]) -> "Window":
        several = parts[0][0].teacher_losses is not None
        return cls(index=k, ids=np.concatenate([doc.ids[a:b] for doc, a, b in parts]),
                   teacher_loss=np.concatenate([doc.teacher_loss[a:b] for doc, a, b in parts]),
                   mapped=np.concatenate([doc.mapped[a:b] for doc, a, b in parts]),
                   teacher_losses=np.concatenate([doc.teacher_losses[a:b] for doc, a, b in parts]) if several else None,
                   documents=documents)


@dataclass(frozen=True)
class TeacherSources:
    """What a worker needs to align each document to several teachers and combine (§2.6): where
    each stream document is in every teacher's shards (:class:`pipeline.student_data.several_teachers.TeacherMatch`),
    each teacher's resolved alignment and the combination."""

    shards: list[ShardInfo]  # the stream's shards first, then every other teacher shard
    shard: np.ndarray  # (T, D) int32 index into shards, -1 where the teacher lacks the document
    row: np.ndarray  # (T, D) int32
    offsets: np.ndarray  # (S + 1,) first stream document of each stream shard
    alignments: tuple[AlignmentConfig, ...]  # per teacher
    names: tuple[str, ...]
    combine: str
    weights: tuple[float, ...] | None

    @classmethod
    def of(cls, match: TeacherMatch, alignments: Sequence[AlignmentConfig], config: AlignmentConfig) -> "TeacherSources":
        weights = tuple(config.teacher_weights) if config.combine == "weighted" else None
        if weights is not None and len(weights) != len(match.names):
            raise ConfigError(f"loss.teacher_weights has {len(weights)} weight(s) for {len(match.names)} teachers "
                             f"({', '.join(match.names)}, in data.folders' order)")
        return cls(shards=match.shards, shard=match.shard, row=match.row, offsets=match.offsets,
                   alignments=tuple(alignments), names=tuple(match.names), combine=config.combine, weights=weights)

    def locate(self, stream_shard: int, row: int) -> list[tuple[int, int]]:
        """``(shard, row)`` in :attr:`shards` of a stream document for every teacher; ``(-1, -1)`` if missing."""
        k = int(self.offsets[stream_shard]) + row
        return list(zip(self.shard[:, k].tolist(), self.row[:, k].tolist()))


class PackedDataset(torch.utils.data.Dataset):
    """Packed, aligned training samples (module docstring). Picklable; each data-loader worker
    opens its own :class:`ShardReader` and keeps its own cache of aligned documents.

    Documents are tokenized and aligned many at a time: one ``encode_batch`` call and one
    :func:`pipeline.method.alignment.align_documents` call for every document a request needs that is not
    cached, where a request is a whole batch of samples (a data loader hands a worker its batch
    at once, :meth:`__getitems__`) or one sample. On a cache miss a request also reads ahead, up to
    ``readahead_tokens`` stream tokens, the documents of the samples this worker is expected to
    be asked for next. A sequential sampler gives each worker batches at a fixed stride (batch
    size x workers x processes): the first request reads ahead at that stride, and later ones
    when they came at the same stride as the request before them. A wrong guess costs time,
    never a different sample: each document is a pure function of its row, so a sample is
    the same alone, in any batch, in any worker, in any order and after a resume. Read-ahead
    stops before sample ``end`` (the run sets it to the number of samples it trains), so with
    the stride guessed right a process decodes only row groups that hold documents of its own
    samples. The cache holds at most ``2 * readahead_tokens`` tokens (at least four samples'
    worth) beyond the documents of the current request.
    """

    def __init__(
        self,
        shards: Sequence[ShardInfo],
        plan: PackPlan,
        tokenizer,
        alignment: AlignmentConfig,
        *,
        readahead_tokens: int = 2**18,
        teachers: TeacherSources | None = None,
    ):
        require_fast(tokenizer, "student tokenizer")
        self.shards = list(shards)
        self.teachers = teachers  # several teachers (§2.6); None: one, whose shards are ``shards``
        self.plan = plan
        self.tokenizer = tokenizer
        self.alignment = alignment
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        if plan.add_bos and self.bos_id is None:
            raise ConfigError("add_bos is set but the student tokenizer has no BOS token")
        if plan.add_eos and self.eos_id is None:
            raise ConfigError("the student tokenizer has no EOS token to put between documents")
        self.readahead_tokens = max(0, readahead_tokens)
        self.end = plan.n_samples  # read ahead no further than this sample (the run sets its last trained one + 1)
        self.cache_tokens = max(2 * self.readahead_tokens, 4 * plan.seq_len)
        self._reader: ShardReader | None = None
        self._docs: OrderedDict[int, StudentDocument] = OrderedDict()
        self._cached_tokens = 0
        self._last_first: int | None = None  # first sample of the previous request
        self._stride: int | None = None  # samples between the first samples of the last two requests

    def __len__(self) -> int:
        return self.plan.n_samples

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None, "_docs": OrderedDict(), "_cached_tokens": 0,
                "_last_first": None, "_stride": None}

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([k])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Samples ``indices`` (what ``torch.utils.data.DataLoader`` asks a worker for at once)."""
        return [self._sample(window) for window in self.windows(indices)]

    def windows(self, indices: Sequence[int]) -> list[Window]:
        """Samples ``indices`` before they are split into inputs and targets (:class:`Window`)."""
        layouts = [(int(k), self.plan.documents_of(int(k))) for k in indices]
        needed = sorted({d for _, parts in layouts for d, _, _ in parts})
        ahead = self._readahead([k for k, _ in layouts]) if any(d not in self._docs for d in needed) else []
        self._observe([k for k, _ in layouts])
        docs = self.documents(needed, ahead)
        return [Window.of(k, [(docs[d], a, b) for d, a, b in parts], parts) for k, parts in layouts]

    @staticmethod
    def _sample(window: Window) -> dict[str, torch.Tensor]:
        k, ids, teacher_loss, mapped = window.index, window.ids, window.teacher_loss, window.mapped
        sample = {
            "input_ids": torch.from_numpy(ids[:-1].copy()),  # (L,)
            "labels": torch.from_numpy(ids[1:].copy()),  # (L,) target of each position
            "teacher_loss": torch.from_numpy(teacher_loss[1:].copy()),  # (L,) L_t of the target
            "mapped": torch.from_numpy(mapped[1:].copy()),  # (L,)
            "sample_index": torch.tensor(k, dtype=torch.int64),
        }
        if window.teacher_losses is not None:  # several teachers: each one's L_t, (L, T)
            sample["teacher_losses"] = torch.from_numpy(window.teacher_losses[1:])
        return sample

    def _observe(self, indices: list[int]) -> None:
        """Remember the stride between this request and the previous one; after the first request,
        the stride a sequential sampler would give: its size times the readers (workers x processes)."""
        if indices:
            first = min(indices)
            self._stride = first - self._last_first if self._last_first is not None else len(indices) * _readers()
            self._last_first = first

    def _readahead(self, indices: list[int]) -> list[int]:
        """Document positions of the samples expected next (class docstring), up to the token
        budget: at the stride of the last two requests if this one came at it too (or, for the
        first request, at the stride a sequential sampler would give)."""
        first, last = min(indices), max(indices)
        if self._last_first is None:
            stride = len(indices) * _readers()
        else:
            stride = first - self._last_first if first - self._last_first == self._stride else 0
        if not self.readahead_tokens or stride <= 0:
            return []
        ahead, tokens = [], 0
        first, last = first + stride, last + stride
        end = min(self.end, self.plan.n_samples)
        while first < end and tokens < self.readahead_tokens:
            for d in self.plan.document_span(first, min(last, end - 1)):
                if not ahead or d > ahead[-1]:  # a long document spans many samples: count it once
                    ahead.append(d)
                    tokens += self.plan.document_length(d)
            first, last = first + stride, last + stride
        return ahead

    def document(self, d: int) -> StudentDocument:
        """The aligned document at stream position ``d`` (cached)."""
        return self.documents([d])[d]

    def documents(self, positions: Sequence[int], ahead: Sequence[int] = ()) -> dict[int, StudentDocument]:
        """The aligned documents at ``positions``: cached ones from the cache, the others (and
        those of ``ahead`` not cached, which go to the cache only) tokenized and aligned together
        (:meth:`_encode`)."""
        found = {}
        for d in positions:
            if d in self._docs:
                self._docs.move_to_end(d)
                found[d] = self._docs[d]
        missing = sorted({d for d in (*positions, *ahead) if d not in self._docs})
        if missing:
            for d, doc in zip(missing, self._encode(missing)):
                self._docs[d] = doc
                self._cached_tokens += doc.ids.size
            found.update((d, self._docs[d]) for d in positions if d not in found)
        self._trim_cache(keep=set(positions))
        return found

    def _trim_cache(self, keep: set[int]) -> None:
        """Drop the least recently used documents, but not those of the current request, until the
        cache holds at most ``cache_tokens`` tokens."""
        for d in list(self._docs):
            if self._cached_tokens <= self.cache_tokens:
                break
            if d not in keep:
                self._cached_tokens -= self._docs.pop(d).ids.size

    def _encode(self, positions: list[int]) -> list[StudentDocument]:
        """Read, tokenize (one ``encode_batch`` call) and align (one ``align_documents`` call) the
        documents at these stream positions, checking each length against the plan."""
        if self._reader is None:
            self._reader = ShardReader(self.shards) if self.teachers is None else \
                ShardReader(self.teachers.shards, cache_row_groups=4 * len(self.teachers.names))
        where = [(int(self.plan.doc_shard[d]), int(self.plan.doc_row[d])) for d in positions]
        rows = [self._reader.row(shard, row) for shard, row in where]
        encodings = encode_batch(self.tokenizer, [r.text for r in rows])
        for d, (shard, row), encoding in zip(positions, where, encodings):
            expected = int(self.plan.doc_end[d] - (self.plan.doc_end[d - 1] if d else 0))
            n = len(encoding) + int(self.plan.add_bos) + int(self.plan.add_eos)
            if n != expected:
                raise StudentDataError(
                    f"{self.shards[shard].path} row {row}: {n} student tokens, the length plan says {expected}; "
                    "the length cache does not match this tokenizer (delete it)"
                )
        if self.teachers is None:
            aligned, per_teacher = self._align(encodings, rows, where), [None] * len(rows)
        else:
            aligned, per_teacher = self._align_teachers(encodings, rows, where)
        head = np.asarray([self.bos_id] if self.plan.add_bos else [], dtype=np.int64)
        tail = np.asarray([self.eos_id] if self.plan.add_eos else [], dtype=np.int64)
        nan_head, nan_tail = np.full(head.size, np.nan, np.float32), np.full(tail.size, np.nan, np.float32)
        off_head, off_tail = np.zeros(head.size, bool), np.zeros(tail.size, bool)
        return [StudentDocument(ids=np.concatenate([head, encoding.ids, tail]).astype(np.int64, copy=False),
                                teacher_loss=np.concatenate([nan_head, doc.teacher_loss, nan_tail]),
                                mapped=np.concatenate([off_head, doc.mapped, off_tail]),
                                teacher_losses=None if each is None else np.pad(
                                    each, ((head.size, tail.size), (0, 0)), constant_values=np.nan))
                for encoding, doc, each in zip(encodings, aligned, per_teacher)]

    def _align(self, encodings, rows, where, alignment: AlignmentConfig | None = None, shards=None) -> list:
        """``align_documents`` for the batch; a document it refuses is named by file and row."""
        alignment, shards = alignment or self.alignment, shards or self.shards
        method = alignment.method
        options = dict(one_to_one=method == "one_to_one", n_chunks=alignment.n_chunks if method == "chunk" else None)
        try:
            return align_documents(encodings, [(r.starts, r.ends, r.losses) for r in rows], alignment.aggregate,
                                   text_lens=[len(r.text) for r in rows], **options)
        except ValueError:
            for encoding, row, (shard, index) in zip(encodings, rows, where):  # find the document
                try:
                    align_document(encoding, row.starts, row.ends, row.losses, alignment.aggregate,
                                   text_len=len(row.text), **options)
                except ValueError as exc:
                    raise StudentDataError(f"{shards[shard].path} row {index}: {exc}") from exc
            raise

    def _align_teachers(self, encodings, rows, where) -> tuple[list[DocumentAlignment], list[np.ndarray]]:
        """Each teacher's ``L_t`` (its own alignment, all NaN for a document it lacks), combined per
        student token (§2.6). Returns the combined alignments and each document's (n, T) losses."""
        t = self.teachers
        located = [t.locate(shard, row) for shard, row in where]  # per document, per teacher
        columns = []
        for k, alignment in enumerate(t.alignments):
            have = [i for i, places in enumerate(located) if places[k][0] >= 0]
            mine = [where[i] if located[i][k] == where[i] else located[i][k] for i in have]
            own = [rows[i] if place == where[i] else self._reader.row(*place) for i, place in zip(have, mine)]
            for i, place, row in zip(have, mine, own):
                if row.text != rows[i].text:  # matched by digest when the data was opened: the files changed since
                    raise StudentDataError(f"{t.shards[place[0]].path} row {place[1]}: teacher {t.names[k]} holds another "
                                     f"text than {self.shards[where[i][0]].path} row {where[i][1]}")
            done = dict(zip(have, self._align([encodings[i] for i in have], own, mine, alignment, t.shards)))
            columns.append([done[i].teacher_loss if i in done else np.full(len(encodings[i]), np.nan, np.float32)
                            for i in range(len(rows))])
        per_teacher = [np.stack([column[i] for column in columns], axis=1) for i in range(len(rows))]  # (n, T) each
        combined = [combine_losses(losses, t.combine, t.weights) for losses in per_teacher]
        return [DocumentAlignment(teacher_loss=c, mapped=~np.isnan(c)) for c in combined], per_teacher


def _readers() -> int:
    """Data-loader workers of this process times processes of the run: how many readers share a
    sequential sampler's batches in turn."""
    info = torch.utils.data.get_worker_info()
    workers = info.num_workers if info is not None else 1
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return workers * (torch.distributed.get_world_size() if distributed else 1)


def collate_packed(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into a batch: (B, L) tensors and a (B,) ``sample_index``."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


# --------------------------------------------------------------------------------------------
# Everything together


@dataclass
class StudentData:
    dataset: PackedDataset
    scored: ScoredDataset  # the shards actually used (several teachers: the stream's, §2.6)
    plan: PackPlan
    alignment: AlignmentConfig  # as resolved (several teachers: the first teacher's)
    teachers: TeacherMatch | None = None  # several teachers only

    def identity(self, tokenizer_sha256: str, packing: PackingConfig) -> dict:
        """The scored dataset's identity plus everything that fixes the sample order; with several
        teachers also every teacher's data, alignment and the combination."""
        identity = {
            **self.scored.identity(),
            "student_tokenizer_sha256": tokenizer_sha256,
            "alignment": {"method": self.alignment.method, "aggregate": self.alignment.aggregate,
                          "n_chunks": self.alignment.n_chunks},
            "packing": {"seed": packing.seed, "shuffle": packing.shuffle, "epochs": packing.epochs,
                        **self.plan.summary()},
        }
        if self.teachers is not None:
            identity["teachers"] = [teacher_identity(d, a) for d, a in
                                    zip(self.teachers.datasets, self.dataset.teachers.alignments)]
            identity["combine"] = {"how": self.dataset.teachers.combine, "weights": self.dataset.teachers.weights,
                                   "missing_documents": self.teachers.missing_rule}
        return identity

    def summary(self) -> dict:
        """What the run summary reports about the data."""
        out = {**self.plan.summary(), "student_tokens": document_tokens(self.plan.summary(), self.plan.epochs),
               "alignment": self.alignment.method, "aggregate": self.alignment.aggregate, "shards_used": len(self.scored.shards), "shards_skipped": self.scored.skipped,
               "teacher": self.scored.teacher.get("teacher", {}).get("name")}
        if self.teachers is not None:
            out.update(self.teachers.summary(), combine=self.dataset.teachers.combine,
                       teacher_weights=self.dataset.teachers.weights,
                       teacher_alignments=[a.method for a in self.dataset.teachers.alignments])
        return out


def teacher_identity(dataset: ScoredDataset, alignment: AlignmentConfig) -> dict:
    """One teacher's part of a several-teacher data identity, without where its folders are."""
    return {
        "teacher": dataset.teacher,
        "folders": [{"complete": f.complete, "identity": f.identity} for f in dataset.folders],
        "shards_used": [{"file": file_name(s), "folder": s.folder, "sha256": s.sha256, "rows": s.rows}
                        for s in dataset.shards],
        "alignment": {"method": alignment.method, "aggregate": alignment.aggregate, "n_chunks": alignment.n_chunks},
    }


def build_student_data(
    scored: ScoredDataset | Sequence[ScoredDataset],
    tokenizer,
    packing: PackingConfig,
    alignment: AlignmentConfig,
    *,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int = 1,
    on_bad_shard: str = "error",
    missing_documents: str = "refuse",
) -> StudentData:
    """Measure, plan and wrap a scored dataset as packed samples for one student tokenizer.

    ``scored`` is one teacher's dataset, or one per teacher (:func:`pipeline.student_data.several_teachers.open_teachers`):
    several are matched document by document and combined per ``alignment.combine`` (§2.6)."""
    check_teacher_weights(alignment, [scored] if isinstance(scored, ScoredDataset) else list(scored))
    if not isinstance(scored, ScoredDataset):
        if len(scored) > 1:
            return _build_several(list(scored), tokenizer, packing, alignment, cache_dir=cache_dir,
                                  num_proc=num_proc, on_bad_shard=on_bad_shard, missing_documents=missing_documents)
        scored = scored[0]
    alignment = resolve_alignment(alignment, tokenizer, scored.folders[0].identity)
    scored, lengths = measure_documents(scored, tokenizer, cache_dir, num_proc=num_proc, on_bad_shard=on_bad_shard)
    add_bos = packing.add_bos if packing.add_bos is not None else bos_token_id(tokenizer) is not None
    plan = build_plan(lengths, packing, add_bos)
    return StudentData(PackedDataset(scored.shards, plan, tokenizer, alignment), scored, plan, alignment)


def check_teacher_weights(alignment: AlignmentConfig, datasets: Sequence[ScoredDataset]) -> None:
    """One ``loss.teacher_weights`` entry per teacher (the folders of one teacher are one teacher),
    before the data is counted; one teacher with several weights is refused, not ignored."""
    if alignment.combine != "weighted" or len(alignment.teacher_weights) == len(datasets):
        return
    n, names = len(alignment.teacher_weights), ", ".join(teacher_names(datasets))
    if len(datasets) == 1:
        raise ConfigError(f"loss.teacher_weights has {n} weights for one teacher ({names}; data.folders of one teacher "
                          "are one teacher): weights combine several teachers, so with one leave out loss.combine "
                          "and loss.teacher_weights, or add the other teachers' folders to data.folders")
    raise ConfigError(f"loss.teacher_weights has {n} weight(s) for {len(datasets)} teachers ({names}, in "
                      "data.folders' order)")


def _build_several(datasets: list[ScoredDataset], tokenizer, packing: PackingConfig, alignment: AlignmentConfig, *,
                   cache_dir, num_proc: int, on_bad_shard: str, missing_documents: str) -> StudentData:
    """:func:`build_student_data` for several teachers: match, then measure and plan the stream
    (rows of a later teacher's shard that an earlier teacher holds are left out)."""

    check_teacher_weights(alignment, datasets)
    alignments = [resolve_alignment(alignment, tokenizer, d.folders[0].identity) for d in datasets]
    match = match_teachers(datasets, missing=missing_documents, on_bad_shard=on_bad_shard)
    stream, lengths = measure_documents(match.stream, tokenizer, cache_dir, num_proc=num_proc,
                                        on_bad_shard=on_bad_shard)
    if len(stream.shards) != len(match.stream.shards):
        raise BadShardError("a shard became unreadable between matching the teachers and counting tokens: "
                            + ", ".join(str(s["file"]) for s in stream.skipped[len(match.stream.skipped):]))
    lengths = [n if keep is None else np.where(keep, n, 0) for n, keep in zip(lengths, match.include)]
    add_bos = packing.add_bos if packing.add_bos is not None else bos_token_id(tokenizer) is not None
    plan = build_plan(lengths, packing, add_bos)
    left_out = sum(int((~keep).sum()) for keep in match.include if keep is not None) * packing.epochs
    plan = replace(plan, n_empty=plan.n_empty - left_out)
    sources = TeacherSources.of(match, alignments, alignment)
    dataset = PackedDataset(stream.shards, plan, tokenizer, alignments[0], teachers=sources)
    log.info("%d teachers (%s), combined by %s", len(match.names), ", ".join(match.names), alignment.combine)
    return StudentData(dataset, stream, plan, alignments[0], teachers=match)
