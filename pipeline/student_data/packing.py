"""The packing plan (METHOD 2.4): the order of the documents and the fixed-length samples cut
from the stream they make. A pure function of the document lengths
(:mod:`pipeline.student_data.lengths`) and the packing settings.

* **Order** (:func:`document_order`): for each epoch ``e`` the shards are permuted with
  ``default_rng([seed, e])`` and the rows inside each shard with ``default_rng([seed, e, shard])``
  (``shuffle=false`` keeps file order). Shuffling stays within shards so that reading stays local
  (one decoded row group serves many samples); it is a pure function of ``(seed, epoch)``.
  The epochs are concatenated into one stream, so the trainer sees a single pass.
* **Packing** (:func:`build_plan`): each document contributes ``[BOS] tokens [EOS]`` to the stream
  (BOS when the student's tokenizer adds one itself, as Llama's does; EOS between documents
  always). Documents with no student token (empty text) contribute nothing and are counted.
  Sample ``k`` is the window ``stream[k L : k L + L + 1]``: ``input_ids`` its first ``L`` tokens,
  ``labels`` its last ``L``, so consecutive samples overlap by one token and every token after the
  first is a target exactly once. The last partial window is dropped. Documents are not isolated
  by an attention mask (as in the paper's LitGPT pretraining); EOS marks the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from pipeline.student_data.settings import PackingConfig


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
    """``(shard, row)`` arrays of one epoch's document order (module docstring, order)."""
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
    """The packing plan for ``config.epochs`` concatenated epochs (module docstring)."""
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
