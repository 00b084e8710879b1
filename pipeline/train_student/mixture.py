"""Data mixtures: several corpora drawn into one training stream at set proportions
(``data.mixture``, each corpus a :class:`pipeline.train_student.config.MixtureCorpus`;
docs/configuration.md, "Data mixtures").

Each corpus is a stream of its own: its scored folders (one teacher or several) packed and aligned
as a single-corpus run would pack them (:func:`pipeline.student_data.build.build_student_data`, its own
shuffled order and passes), or an export's rows (:mod:`pipeline.train_student.from_export`). The
mixture only decides, for each of its samples ``k``, which corpus gives it and which of that
corpus's samples it is. The rule (:class:`MixtureOrder`) is a pure function of the weights, the
seed and ``k``; the corpus sizes only decide where the stream ends. So a resumed run, or a longer
run over the same corpora, sees the same samples in the same places: the position in the stream
is a plain number.

1. **Apportionment.** With shares ``p_c = weight_c / sum(weights)``, the ``i``-th sample of corpus
   ``c`` gets the key ``(i + 1/2) / p_c``; the stream takes samples by increasing key (ties: the
   corpus listed first). This is Sainte-Laguë's divisor method, applied sample by sample: after any
   ``K`` samples each corpus has given ``K p_c`` of them, to within about one sample.
2. **Blocks.** The stream is cut into blocks of :data:`BLOCK` samples. Each block keeps the counts
   step 1 gives it, and its samples are placed in the order of
   ``numpy.random.default_rng([seed, TAG, block]).permutation(BLOCK)`` over the block's labels sorted
   by corpus, so batches carry no fixed pattern (a fixed one would, say, give one rank of a
   two-GPU run only one corpus), while every block boundary holds the exact counts.
3. **Samples.** Sample ``k`` is sample ``j`` of its corpus's stream, ``j`` the number of samples that
   corpus gave before ``k``; so each corpus is read in its own order, from its start, without skips.

**When a corpus runs out.** A corpus is read at most ``epochs`` times (its own setting, by default
``data.epochs``); each pass is reshuffled as in a single-corpus run (docs/METHOD.md §2.4). The
mixture ends just before the first sample a corpus can no longer give: a run without a length
trains to there, and a longer run is refused before training, naming the corpus that runs out and
the passes it would need.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from pipeline.runtime.config import ConfigError

BLOCK = 64  # samples per block of the mixture's order (module docstring, step 2)
TAG = 0x6D6978  # "mix": keeps the block permutations apart from every other use of the seed
RULE = f"sainte-lague-blocks-{BLOCK}"  # the order's definition, recorded in the run's data identity


# --------------------------------------------------------------------------------------------
# The order


class MixtureOrder:
    """Which corpus gives each sample of the stream, and which of its samples (module docstring).

    ``bounds[b, c]`` is the number of samples corpus ``c`` gave before block ``b``; it grows, one
    block at a time, as far as a question needs. Pickled without its cache of permuted blocks."""

    def __init__(self, weights: Sequence[float], seed: int, block: int = BLOCK):
        w = np.asarray(weights, dtype=np.float64)
        self.shares = w / w.sum()  # (C,)
        self.seed = int(seed)
        self.block = int(block)
        self._bounds = np.zeros((1, w.size), dtype=np.int64)  # (blocks computed + 1, C)
        self._labels: OrderedDict[int, np.ndarray] = OrderedDict()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_labels": OrderedDict()}

    @property
    def n_corpora(self) -> int:
        return int(self.shares.size)

    def bounds(self, n_blocks: int) -> np.ndarray:
        """``(n_blocks + 1, C)``: samples of each corpus before each block boundary."""
        while self._bounds.shape[0] <= n_blocks:
            self._extend(max(64, self._bounds.shape[0]))
        return self._bounds[: n_blocks + 1]

    def _extend(self, blocks: int) -> None:
        """Step 1 for ``blocks`` more blocks: each takes the ``block`` smallest keys that follow."""
        counts, rows = self._bounds[-1].copy(), []
        corpus = np.repeat(np.arange(self.n_corpora), self.block)  # (C * block,)
        step = np.tile(np.arange(self.block), self.n_corpora)
        for _ in range(blocks):
            keys = (counts[corpus] + step + 0.5) / self.shares[corpus]  # each corpus's next candidates
            taken = np.lexsort((corpus, keys))[: self.block]  # by key, ties to the corpus listed first
            counts = counts + np.bincount(corpus[taken], minlength=self.n_corpora)
            rows.append(counts)
        self._bounds = np.vstack([self._bounds, np.asarray(rows)])

    def block_labels(self, b: int) -> np.ndarray:
        """``(block,)`` the corpus of each sample of block ``b``, in stream order (step 2)."""
        if b in self._labels:
            self._labels.move_to_end(b)
            return self._labels[b]
        bounds = self.bounds(b + 1)
        sorted_labels = np.repeat(np.arange(self.n_corpora), bounds[b + 1] - bounds[b])
        labels = sorted_labels[np.random.default_rng([self.seed, TAG, b]).permutation(self.block)]
        self._labels[b] = labels
        while len(self._labels) > 8:
            self._labels.popitem(last=False)
        return labels

    def locate(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(corpus, sample within the corpus)`` of each stream sample in ``indices`` (step 3)."""
        k = np.asarray(indices, dtype=np.int64).reshape(-1)
        corpus, within = np.empty(k.size, np.int64), np.empty(k.size, np.int64)
        blocks = k // self.block
        bounds = self.bounds(int(blocks.max()) + 1 if k.size else 0)
        for b in np.unique(blocks):
            labels = self.block_labels(int(b))
            at = np.nonzero(blocks == b)[0]
            p = k[at] - int(b) * self.block
            corpus[at] = labels[p]
            before = np.cumsum(labels[None, :] == np.arange(self.n_corpora)[:, None], axis=1)  # (C, block) inclusive
            within[at] = bounds[b, labels[p]] + before[labels[p], p] - 1
        return corpus, within

    def counts(self, n: int) -> np.ndarray:
        """``(C,)`` samples each corpus gives among the first ``n`` of the stream."""
        b, rest = divmod(int(n), self.block)
        counts = self.bounds(b)[b].copy()
        if rest:
            counts += np.bincount(self.block_labels(b)[:rest], minlength=self.n_corpora)
        return counts

    def length(self, available: Sequence[int]) -> int:
        """How many samples the stream holds before some corpus ``c`` would need its
        ``available[c]``-th sample (its first one past the end)."""
        available = np.asarray(available, dtype=np.int64)
        b = 0
        while True:
            bounds = self.bounds(b + 1)
            if (bounds[b + 1] > available).any():
                break
            b += 1
        labels = self.block_labels(b)
        taken = bounds[b][:, None] + np.cumsum(labels[None, :] == np.arange(self.n_corpora)[:, None], axis=1)  # (C, block)
        over = (taken > available[:, None]).any(axis=0)  # sample p of the block needs one too many
        return b * self.block + int(np.argmax(over))


# --------------------------------------------------------------------------------------------
# The dataset


@dataclass(frozen=True)
class MixturePlan:
    """What the trainer reads of a plan: the sequence length, the samples of the stream (up to the
    first corpus that runs out) and its passes (one: ``epoch`` in the logs is the share of them)."""

    seq_len: int
    n_samples: int
    epochs: int = 1


class MixtureDataset(torch.utils.data.Dataset):
    """The mixture's samples by stream position (module docstring): each corpus's own samples,
    fetched a batch at a time from its own dataset, with ``sample_index`` the stream position and
    ``corpus`` the corpus's place in ``data.mixture`` (the trainer logs the realised shares from it)."""

    def __init__(self, corpora: Sequence, names: Sequence[str], order: MixtureOrder, n_samples: int, seq_len: int):
        self.corpora = list(corpora)
        self.corpus_names = list(names)
        self.order = order
        self.plan = MixturePlan(seq_len=seq_len, n_samples=int(n_samples))
        self.teachers = getattr(self.corpora[0], "teachers", None)  # the same teachers in every corpus
        self._end = self.plan.n_samples

    def __len__(self) -> int:
        return self.plan.n_samples

    @property
    def end(self) -> int:
        return self._end

    @end.setter
    def end(self, n: int) -> None:
        """The run trains samples ``0..n-1``: no corpus reads ahead past what they need of it."""
        self._end = int(n)
        for dataset, count in zip(self.corpora, self.order.counts(min(self._end, len(self)))):
            dataset.end = int(count)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([k])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        corpus, within = self.order.locate(indices)
        out: list[dict | None] = [None] * len(corpus)
        for c in np.unique(corpus):
            at = np.nonzero(corpus == c)[0]
            for i, sample in zip(at, self.corpora[c].__getitems__(within[at].tolist())):
                out[i] = {**sample, "sample_index": torch.tensor(int(indices[i]), dtype=torch.int64),
                          "corpus": torch.tensor(int(c), dtype=torch.int64)}
        return out


# --------------------------------------------------------------------------------------------
# The mixture's data


@dataclass
class CorpusData:
    """One corpus of the mixture, its data built (:class:`pipeline.student_data.build.StudentData` or
    :class:`pipeline.train_student.from_export.ExportData`)."""

    name: str
    weight: float
    epochs: int  # passes its data holds
    data: object


def teachers_of(data) -> list:
    """The teachers (identity's ``teacher`` and ``windows``) a corpus's data was scored by, in order."""
    if hasattr(data, "teacher_keys"):
        return data.teacher_keys()
    return [d.teacher for d in data.teachers.datasets] if data.teachers is not None else [data.scored.teacher]


def check_same_teachers(corpora: Sequence[CorpusData]) -> None:
    """Every corpus must be scored by the same teacher or teachers, in the same order: the guided
    selection compares their losses across a batch."""
    first = teachers_of(corpora[0].data)
    other = [c for c in corpora[1:] if teachers_of(c.data) != first]
    if other:
        def names(c):
            return ", ".join(str((t.get("teacher") or {}).get("name", "?")) for t in teachers_of(c.data))
        raise ConfigError(
            "data.mixture: every corpus must be scored by the same teacher(s) with the same settings; "
            + "; ".join(f"corpus {c.name}: {names(c)}" for c in [corpora[0], *other])
            + " (score each corpus with the same teacher, or train one run per teacher)")


@dataclass
class MixtureData:
    """The mixture as the run uses it: what :class:`pipeline.student_data.build.StudentData` gives a
    single-corpus run (dataset, plan, identity, summary), for the whole mixture."""

    dataset: MixtureDataset
    corpora: list[CorpusData]
    seed: int

    @property
    def plan(self) -> MixturePlan:
        return self.dataset.plan

    @property
    def scored(self):
        """The first corpus's scored data (``data.held_out_shards`` holds shards of it out)."""
        return self.corpora[0].data.scored

    @property
    def alignment(self):
        return self.corpora[0].data.alignment

    def identity(self, tokenizer_sha256: str, packing) -> dict:
        """The order's rule and seed, and each corpus's weight, passes and data identity (its own
        scored data or export, packing and alignment)."""
        return {"mixture": {
            "rule": RULE, "seed": self.seed,
            "corpora": [{"name": c.name, "weight": float(c.weight), "epochs": c.epochs,
                         "data": c.data.identity(tokenizer_sha256, replace(packing, epochs=c.epochs))}
                        for c in self.corpora],
        }}

    def check_length(self, samples: int, samples_per_step: int) -> None:
        """Refuse a run of ``samples`` samples when a corpus runs out before, naming it and the
        passes it would need (module docstring, "When a corpus runs out")."""
        if samples <= len(self.dataset):
            return
        needed = self.dataset.order.counts(samples)
        lines = []
        for i, (c, n) in enumerate(zip(self.corpora, needed)):
            plan = c.data.plan
            if n <= plan.n_samples:
                continue
            per_pass = plan.n_tokens / plan.epochs  # stream tokens of one pass
            passes = math.ceil((int(n) * plan.seq_len + 1) / per_pass)
            lines.append(f"corpus {c.name} (weight {c.weight:g}) would give {int(n):,} samples, it holds "
                         f"{plan.n_samples:,} in {c.epochs} pass(es): set data.mixture[{i}].epochs={passes} or more, "
                         "or lower its weight")
        steps = len(self.dataset) // samples_per_step
        raise ConfigError(
            f"the run asks for {samples:,} samples of the mixture ({samples // samples_per_step:,} optimizer steps); "
            + "; ".join(lines) + f"; or train at most {steps:,} steps (train.max_steps={steps}).")

    def shares(self, samples: int) -> list[float]:
        """The share of each corpus among the first ``samples`` samples of the stream."""
        counts = self.dataset.order.counts(samples)
        return (counts / max(1, int(counts.sum()))).tolist()

    def summary(self) -> dict:
        """The single-corpus summary's figures, summed over the corpora, and per corpus its weight,
        the share it had of the samples trained, the samples it gave and its passes over them."""
        parts = [c.data.summary() for c in self.corpora]
        trained = self.dataset.order.counts(min(self.dataset.end, len(self.dataset)))
        total = max(1, int(trained.sum()))
        weights = sum(c.weight for c in self.corpora)
        return {
            **parts[0],
            **{k: sum(p[k] for p in parts) for k in ("n_documents", "n_empty", "n_tokens", "student_tokens", "shards_used")},
            "n_samples": len(self.dataset),
            "shards_skipped": [s for p in parts for s in p["shards_skipped"]],
            "mixture": [{"name": c.name, "weight": c.weight / weights, "share": int(n) / total, "samples": int(n),
                         "samples_available": c.data.plan.n_samples, "epochs": c.epochs,
                         "passes": int(n) / c.data.plan.n_samples * c.epochs if c.data.plan.n_samples else 0.0}
                        for c, n in zip(self.corpora, trained)],
        }


def build_mixture(corpora: Sequence[CorpusData], seed: int, seq_len: int) -> MixtureData:
    """The mixture of ``corpora`` (their data already built), after checking they share their teachers."""
    check_same_teachers(corpora)
    order = MixtureOrder([c.weight for c in corpora], seed)
    n_samples = order.length([c.data.plan.n_samples for c in corpora])
    if n_samples == 0:
        empty = [c.name for c in corpora if c.data.plan.n_samples == 0]
        raise ConfigError(f"data.mixture: corpus {', '.join(empty)} gives no sample of {seq_len} tokens")
    dataset = MixtureDataset([c.data.dataset for c in corpora], [c.name for c in corpora], order, n_samples, seq_len)
    return MixtureData(dataset=dataset, corpora=list(corpora), seed=seed)
