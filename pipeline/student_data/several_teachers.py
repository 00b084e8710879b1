"""Several teachers, one student (docs/METHOD.md §2.6): group scored folders by teacher, match the
teachers' documents by ``doc_id`` and text, and combine their aligned losses per student token.

* :func:`open_teachers` groups ``data.folders`` by teacher identity (the identity's ``teacher`` and
  ``windows``, what one :func:`storage_schemas.reader.open_scored_dataset` call requires to agree)
  in the order the folders are listed, and opens each group with its own call, so every
  per-teacher check still runs. One group is the single-teacher run, untouched.
* :func:`match_teachers` reads every teacher's ``doc_id`` and text (a 128-bit BLAKE2b digest of its
  UTF-8 bytes) and decides, once, where each document of the training stream is in every teacher's
  shards. The stream holds the first teacher's documents in its shard order, then the documents
  only later teachers hold. A document id listed twice by one teacher, a document whose text
  differs between teachers, and a teacher sharing no document with the first are refused, naming
  the documents. A document a teacher lacks is refused (``missing=refuse``, the default) or
  unmapped for that teacher (``missing=unmapped``).
* :func:`combine_losses` combines the per-teacher ``L_t`` of each student token: ``min``, ``max``,
  ``mean`` or ``weighted`` (a weighted mean). A token is unmapped only when no teacher maps it;
  the means run over the teachers that map it.

Shared by stage 2 and the export (:mod:`pipeline.student_data.dataset` aligns and combines with these);
what the trainer measures per teacher is in :mod:`pipeline.train_student.several_teachers`.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.runtime.config import ConfigError
from storage_schemas.reader import (
    BadShardError,
    ContractError,
    ScoredDataset,
    ShardInfo,
    open_scored_dataset,
    read_row_group,
)

log = logging.getLogger(__name__)

COMBINATIONS = ("min", "mean", "max", "weighted")
MISSING_RULES = ("refuse", "unmapped")
NAMED = 10  # documents named in a refusal (the count says how many more)


class TeacherMismatchError(ContractError):
    """The teachers' scored folders do not hold the same documents with the same text."""


# --------------------------------------------------------------------------------------------
# Grouping


def group_folders(folders: Sequence[str]) -> list[list[str]]:
    """``folders`` grouped by teacher identity, groups and folders in the order listed."""
    groups: list[tuple[dict, list[str]]] = []
    for folder in folders:
        teacher = ScoredDataset.open(folder).teacher
        for key, members in groups:
            if key == teacher:
                members.append(folder)
                break
        else:
            groups.append((teacher, [folder]))
    return [members for _, members in groups]


def open_teachers(folders: Sequence[str], *, on_bad_shard: str = "error", verify: str = "size",
                  allow_partial: bool = False) -> list[ScoredDataset]:
    """One opened and validated :class:`ScoredDataset` per teacher (module docstring)."""
    groups = group_folders(folders)
    return [open_scored_dataset(group, on_bad_shard=on_bad_shard, verify=verify, allow_partial=allow_partial)
            for group in groups]


def file_name(shard: ShardInfo) -> str:
    """A shard's file name, whether its path is a local ``Path`` or an object-store URI."""
    return str(shard.path).rstrip("/").rsplit("/", 1)[-1]


def teacher_names(datasets: Sequence[ScoredDataset]) -> list[str]:
    """Each teacher's name from its identity; a name used twice gets ``#<position>``."""
    return unique_names([str((d.teacher.get("teacher") or {}).get("name", "?")) for d in datasets])


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with ``#<position>`` added to a name used twice."""
    return [f"{n}#{i}" if list(names).count(n) > 1 else n for i, n in enumerate(names)]


# --------------------------------------------------------------------------------------------
# Matching documents


@dataclass
class _Keys:
    """One teacher's documents in shard order: ids, text digests and where each one is."""

    dataset: ScoredDataset  # without the shards that could not be read
    doc_ids: object  # pyarrow string array (D,)
    digests: np.ndarray  # (D, 2) uint64
    shard: np.ndarray  # (D,) int32 index into dataset.shards
    row: np.ndarray  # (D,) int32


def _read_keys(dataset: ScoredDataset, on_bad_shard: str) -> _Keys:
    """Every row group of every shard read whole (decoding every column validates the file, as the
    token count pass does), keeping ids and text digests."""

    ids, digests, shard_of, row_of, kept, bad = [], [], [], [], [], []
    for shard in dataset.shards:
        try:
            groups = [read_row_group(shard, g) for g in range(len(shard.row_group_rows))]
        except BadShardError as exc:
            bad.append({"folder": shard.folder, "file": file_name(shard), "reason": str(exc)})
            continue
        for table in groups:
            ids.append(table.column("doc_id"))
            texts = table.column("text").cast(pa.binary()).to_pylist()
            digests += [hashlib.blake2b(t or b"", digest_size=16).digest() for t in texts]
        shard_of.append(np.full(shard.rows, len(kept), np.int32))
        row_of.append(np.arange(shard.rows, dtype=np.int32))
        kept.append(shard)
    if bad and on_bad_shard == "error":
        raise BadShardError("\n".join(b["reason"] for b in bad))
    for b in bad:
        log.warning("skipping shard %s: %s", b["file"], b["reason"])
    dataset = ScoredDataset(folders=dataset.folders, shards=kept, skipped=[*dataset.skipped, *bad])
    doc_ids = pa.concat_arrays([c for chunked in ids for c in chunked.chunks]) if ids else pa.array([], pa.string())
    return _Keys(
        dataset=dataset, doc_ids=doc_ids,
        digests=np.frombuffer(b"".join(digests), dtype=np.uint64).reshape(-1, 2),
        shard=np.concatenate(shard_of) if shard_of else np.zeros(0, np.int32),
        row=np.concatenate(row_of) if row_of else np.zeros(0, np.int32),
    )


def _named(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:NAMED])
    return shown + (f" and {len(ids) - NAMED} more" if len(ids) > NAMED else "")


def _folders(dataset: ScoredDataset) -> str:
    return ", ".join(str(f.path) for f in dataset.folders)


@dataclass
class TeacherMatch:
    """Where each document of the training stream is in every teacher's shards.

    The stream's shards are the first teacher's, then the shards of later teachers that hold
    documents no earlier teacher has (only those rows are in the stream: ``include``). ``shards``
    lists the stream's shards first, then every other shard of every teacher, so one reader serves
    all; ``shard[t, k]``/``row[t, k]`` locate stream document ``k`` (numbered through the stream's
    shards, ``offsets`` per shard) in teacher ``t``, ``-1`` where the teacher lacks it.
    """

    datasets: list[ScoredDataset]  # per teacher, the shards read
    names: list[str]
    stream: ScoredDataset
    include: list[np.ndarray | None]  # per stream shard: rows in the stream (None: every row)
    shards: list[ShardInfo]
    shard: np.ndarray  # (T, D) int32 index into ``shards``; -1: missing
    row: np.ndarray  # (T, D) int32
    offsets: np.ndarray  # (S + 1,) int64 first stream document of each stream shard
    missing: list[int]  # per teacher: stream documents it lacks
    missing_rule: str

    def summary(self) -> dict:
        return {"teachers": self.names, "missing_documents": dict(zip(self.names, self.missing)),
                "missing_rule": self.missing_rule}


def match_teachers(datasets: Sequence[ScoredDataset], missing: str = "refuse",
                   on_bad_shard: str = "error") -> TeacherMatch:
    """Match the teachers' documents by ``doc_id`` and text (module docstring); raises
    :class:`TeacherMismatchError` naming the documents, or :class:`BadShardError`."""

    if missing not in MISSING_RULES:
        raise ConfigError(f"missing must be one of {MISSING_RULES}, got {missing!r}")
    keys = [_read_keys(d, on_bad_shard) for d in datasets]
    names = teacher_names(datasets)
    for name, k in zip(names, keys):
        counts = pc.value_counts(k.doc_ids)
        twice = counts.filter(pc.greater(counts.field("counts"), 1)).field("values").to_pylist()
        if twice:
            raise TeacherMismatchError(
                f"teacher {name} ({_folders(k.dataset)}) lists these documents more than once: {_named(twice)}; "
                "with several teachers each teacher's folders must hold a document once")
    first = keys[0]
    for name, k in zip(names[1:], keys[1:]):
        if len(k.doc_ids) and not pc.any(pc.is_in(k.doc_ids, value_set=first.doc_ids)).as_py():
            raise TeacherMismatchError(
                f"teacher {name} ({_folders(k.dataset)}) shares no document with teacher {names[0]} "
                f"({_folders(first.dataset)}): different corpora (first documents: "
                f"{_named(k.doc_ids.to_pylist()[:NAMED])} against {_named(first.doc_ids.to_pylist()[:NAMED])})")

    # The stream: the first teacher's shards, then later shards holding documents seen nowhere before.
    stream_shards = list(first.dataset.shards)
    stream_folders = list(first.dataset.folders)
    include: list[np.ndarray | None] = [None] * len(stream_shards)
    stream_ids, stream_digests = [first.doc_ids], [first.digests]
    read_index = [{i: i for i in range(len(first.dataset.shards))}]  # per teacher: its shard -> index in shards
    for k in keys[1:]:
        new = ~pc.fill_null(pc.is_in(k.doc_ids, value_set=pa.concat_arrays(stream_ids)), False).to_numpy(zero_copy_only=False)
        index = {}
        for s in np.unique(k.shard[new]).tolist():
            shard = k.dataset.shards[s]
            folder = k.dataset.folders[shard.folder]
            if folder not in stream_folders:
                stream_folders.append(folder)
            index[s] = len(stream_shards)
            stream_shards.append(replace(shard, folder=stream_folders.index(folder)))
            rows = k.shard == s
            include.append(new[rows])
            stream_ids.append(k.doc_ids.filter(pa.array(rows)))
            stream_digests.append(k.digests[rows])
        read_index.append(index)
    shards = list(stream_shards)
    for t, k in enumerate(keys[1:], start=1):
        for s, shard in enumerate(k.dataset.shards):
            if s not in read_index[t]:
                read_index[t][s] = len(shards)
                shards.append(shard)

    all_ids, all_digests = pa.concat_arrays(stream_ids), np.concatenate(stream_digests)
    in_stream = np.concatenate([np.ones(len(first.doc_ids), bool), *[m for m in include[len(first.dataset.shards):]]])
    n = len(all_ids)
    loc_shard = np.full((len(keys), n), -1, np.int32)
    loc_row = np.full((len(keys), n), -1, np.int32)
    lacking: list[int] = []
    for t, k in enumerate(keys):
        where = pc.index_in(all_ids, value_set=k.doc_ids).to_numpy(zero_copy_only=False)  # float with NaN for null
        found = ~np.isnan(where)
        g = where[found].astype(np.int64)
        differ = np.flatnonzero(found)[(k.digests[g] != all_digests[found]).any(axis=1)]
        if differ.size:
            raise TeacherMismatchError(
                f"teacher {names[t]} ({_folders(k.dataset)}) holds these documents with another text than "
                f"teacher {names[0]} ({_folders(first.dataset)}): {_named(all_ids.take(pa.array(differ)).to_pylist())}; "
                "the teachers must score the same corpus (rescore the changed documents)")
        mapping = np.vectorize(read_index[t].__getitem__, otypes=[np.int32])(k.shard[g]) if g.size else g
        loc_shard[t, found], loc_row[t, found] = mapping, k.row[g]
        absent = np.flatnonzero(~found & in_stream)
        lacking.append(int(absent.size))
        if absent.size and missing == "refuse":
            raise TeacherMismatchError(
                f"teacher {names[t]} ({_folders(k.dataset)}) lacks {absent.size} document(s) the other "
                f"teachers hold: {_named(all_ids.take(pa.array(absent)).to_pylist())}. Score them with this teacher, "
                "or set data.missing_documents=unmapped to train them unmapped for this teacher")
    for name, count in zip(names, lacking):
        if count:
            log.warning("teacher %s lacks %d document(s): unmapped for it (data.missing_documents=unmapped)", name, count)
    stream = ScoredDataset(folders=stream_folders, shards=stream_shards,
                           skipped=[s for k in keys for s in k.dataset.skipped])
    return TeacherMatch(
        datasets=[k.dataset for k in keys], names=names, stream=stream, include=include, shards=shards,
        shard=loc_shard, row=loc_row, offsets=np.cumsum([0, *[s.rows for s in stream_shards]]),
        missing=lacking, missing_rule=missing,
    )


# --------------------------------------------------------------------------------------------
# Combining losses


def combine_losses(losses: np.ndarray, how: str, weights: Sequence[float] | None = None) -> np.ndarray:
    """Combined ``L_t`` per student token from (N, T) per-teacher losses (NaN where a teacher does
    not map the token): NaN only where no teacher maps it; ``mean``/``weighted`` over the teachers
    that map it. Returns (N,) float32."""
    if how not in COMBINATIONS:
        raise ConfigError(f"combine must be one of {COMBINATIONS}, got {how!r}")
    losses = np.asarray(losses, dtype=np.float32)
    if how == "min":
        return np.fmin.reduce(losses, axis=1) if losses.shape[1] else np.full(len(losses), np.nan, np.float32)
    if how == "max":
        return np.fmax.reduce(losses, axis=1) if losses.shape[1] else np.full(len(losses), np.nan, np.float32)
    w = np.ones(losses.shape[1]) if how == "mean" else np.asarray(weights, dtype=np.float64)
    if w.shape != (losses.shape[1],):
        raise ConfigError(f"{losses.shape[1]} teachers but {w.size} teacher weights")
    mapped = ~np.isnan(losses)  # (N, T)
    total = np.where(mapped, losses.astype(np.float64) * w, 0.0).sum(axis=1)
    weight = (mapped * w).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mapped.any(axis=1), total / weight, np.nan).astype(np.float32)
