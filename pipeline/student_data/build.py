"""The student data built (METHOD 2.1, 2.3, 2.4, 2.6): :func:`build_student_data` measures,
plans and wraps one teacher's scored dataset, or several teachers', as packed samples for one
student tokenizer (:class:`StudentData`).

One implementation for the two consumers: stage 2 trains on it (:mod:`pipeline.train_student`) and
``make export-student`` writes it out for other trainers (:mod:`pipeline.export_student`), so the
exported rows are the training samples, bit for bit.

How it is built, each step in its module:

1. **Settings** (:mod:`pipeline.student_data.settings`): the alignment the tokenizers allow and
   the teacher weights, checked before any token is counted.
2. **Lengths** (:mod:`pipeline.student_data.lengths`, once per student tokenizer and shard): every
   document's student tokens counted, cached, counted once per distributed run.
3. **Order and packing** (:mod:`pipeline.student_data.packing`): the documents' order per epoch
   and the samples cut from the stream, a pure function of ``(seed, epoch)``.
4. **Alignment** (:mod:`pipeline.student_data.dataset`, in data-loader workers): the documents of
   the samples asked for tokenized with offsets, aligned to the teacher's spans, cached and sliced.

Several teachers (METHOD 2.6): :func:`build_student_data` takes one scored dataset per teacher,
matches their documents (:func:`pipeline.student_data.several_teachers.match_teachers`), plans the
stream of the matched documents, and each worker aligns every document to each teacher separately
and combines the losses per student token. With one teacher nothing of this runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from pipeline.method.tokenization import bos_token_id
from pipeline.student_data.dataset import PackedDataset, TeacherSources
from pipeline.student_data.lengths import measure_documents
from pipeline.student_data.packing import PackPlan, build_plan, document_tokens
from pipeline.student_data.settings import (
    AlignmentConfig,
    PackingConfig,
    check_teacher_weights,
    resolve_alignment,
)
from pipeline.student_data.several_teachers import TeacherMatch, file_name, match_teachers
from storage_schemas.reader import BadShardError, ScoredDataset

log = logging.getLogger(__name__)


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
