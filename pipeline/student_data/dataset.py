"""The packed, aligned training samples (METHOD 2.1, 2.3, 2.6): :class:`PackedDataset`.

It is a *map-style* dataset of packed samples, so that its order and the position in it are plain
numbers: sample ``k`` is always the same tokens (:class:`pipeline.student_data.packing.PackPlan`),
and a resumed run that skips the first ``n`` samples sees exactly the batches an uninterrupted
run would have seen.

**Alignment** (in data-loader workers): the documents of a batch of samples, and of the samples
the worker will be asked for next, are tokenized with offsets in one call
(:func:`pipeline.method.tokenization.encode_batch`, special-token strings stay text), aligned to
the teacher's spans in one call (:func:`pipeline.method.alignment.align_documents`), cached and
sliced. Each position carries its target id, ``teacher_loss`` (the aggregated ``L_t`` of the
target, NaN where unmapped) and ``mapped``. BOS/EOS are unmapped; so is every token of a document
the teacher stored with zero tokens (whitespace-only texts): such documents are trained as
unmapped.

Several teachers (METHOD 2.6, :class:`TeacherSources`): each worker aligns every document to each
teacher separately and combines the losses per student token; each position then also carries
every teacher's ``L_t`` (``teacher_losses``, (L, T)) for the per-teacher metrics. With one teacher
nothing of this runs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pipeline.method.alignment import DocumentAlignment, align_document, align_documents
from pipeline.method.tokenization import encode_batch, require_fast
from pipeline.runtime.config import ConfigError
from pipeline.student_data.packing import PackPlan
from pipeline.student_data.settings import AlignmentConfig, StudentDataError
from pipeline.student_data.several_teachers import TeacherMatch, combine_losses
from storage_schemas.reader import BadShardError, ShardInfo, ShardReader


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
    worth) beyond the documents of the current request. A damaged shard met while reading ahead
    is left for the request whose samples need it, which raises its
    :class:`storage_schemas.reader.BadShardError`: the run trains every step before it.
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
            try:
                encoded = self._encode(missing)
            except BadShardError:  # a damaged shard: raised for the request that needs it, not for a read-ahead
                needed = sorted({d for d in positions if d not in self._docs})
                if needed == missing:
                    raise
                missing, encoded = needed, self._encode(needed)
            for d, doc in zip(missing, encoded):
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
            aligned, per_teacher = _align(encodings, rows, where, self.alignment, self.shards), [None] * len(rows)
        else:
            aligned, per_teacher = _align_teachers(encodings, rows, where, self.teachers, self._reader, self.shards)
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


def _align(encodings, rows, where, alignment: AlignmentConfig, shards: Sequence[ShardInfo]) -> list:
    """``align_documents`` for the batch; a document it refuses is named by file and row."""
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


def _align_teachers(encodings, rows, where, t: TeacherSources, reader: ShardReader,
                    shards: Sequence[ShardInfo]) -> tuple[list[DocumentAlignment], list[np.ndarray]]:
    """Each teacher's ``L_t`` (its own alignment, all NaN for a document it lacks), combined per
    student token (§2.6). Returns the combined alignments and each document's (n, T) losses;
    ``shards`` are the stream's, ``reader`` reads every teacher's."""
    located = [t.locate(shard, row) for shard, row in where]  # per document, per teacher
    columns = []
    for k, alignment in enumerate(t.alignments):
        have = [i for i, places in enumerate(located) if places[k][0] >= 0]
        mine = [where[i] if located[i][k] == where[i] else located[i][k] for i in have]
        own = [rows[i] if place == where[i] else reader.row(*place) for i, place in zip(have, mine)]
        for i, place, row in zip(have, mine, own):
            if row.text != rows[i].text:  # matched by digest when the data was opened: the files changed since
                raise StudentDataError(f"{t.shards[place[0]].path} row {place[1]}: teacher {t.names[k]} holds another "
                                       f"text than {shards[where[i][0]].path} row {where[i][1]}")
        done = dict(zip(have, _align([encodings[i] for i in have], own, mine, alignment, t.shards)))
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
