"""The student data's settings and the checks made before any token is counted: how teacher
losses reach student tokens (:class:`AlignmentConfig`), how documents are packed
(:class:`PackingConfig`), the scored folders (:func:`scored_folder_problems`), the teacher weights
(:func:`check_teacher_weights`) and the alignment method the two tokenizers allow
(:func:`resolve_alignment`). It imports no torch: a stage's config module imports it, so that a
mistyped setting is refused before torch loads.

Alignment methods: ``token`` (METHOD 2.1 span overlap, aggregated with max/mean/min), ``chunk``
(the C-chunk ablation, a mean per chunk) and ``one_to_one`` (same-vocabulary Rho-1; needs identical
spans). :func:`resolve_alignment` turns ``token`` into ``one_to_one`` when the student's tokenizer
is the teacher's (same sha256 fingerprint), as METHOD asks for identical tokenizers, and refuses
``one_to_one`` asked for with another tokenizer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from pipeline.method.alignment import AGGREGATIONS
from pipeline.method.tokenization import fingerprint
from pipeline.runtime.config import ConfigError, UserError, check_at_least, check_choice, refuse
from pipeline.student_data.several_teachers import COMBINATIONS, teacher_names
from storage_schemas import MANIFEST_NAME
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ScoredDataset

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
