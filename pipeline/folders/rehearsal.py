"""Rehearsal output: scores made by a stand-in teacher whose forward costs nothing
(``scorer.backend=rehearsal``, docs/sizing-a-run.md#rehearsing-at-scale).

Such a dataset says what it is in its identity (``teacher.backend``), its manifest (``rehearsal``)
and its card, and the consumers of scores refuse it unless told (:func:`refuse_rehearsal`): stage 2
(``data.allow_rehearsal``) and the export (``data.allow_rehearsal``), so rehearsal losses never
pass for a teacher's. Looking into one (``make inspect``, ``make validate``) is always allowed.
"""

from __future__ import annotations

import logging
from typing import Iterable

from pipeline.runtime.config import UserError

log = logging.getLogger(__name__)

REHEARSAL_BACKEND = "rehearsal"
NOTE = ("REHEARSAL: the losses come from a stand-in teacher (scorer.backend=rehearsal), a fixed hash of "
        "each token and the 8 before it, not from a model; use them to rehearse costs, never to train")


class RehearsalDataError(UserError, ValueError):
    """Rehearsal scores given to a consumer that was not told to accept them."""


def is_rehearsal(identity: dict | None) -> bool:
    """Whether a scored dataset's identity (or a manifest's ``identity``) is a rehearsal's."""
    teacher = (identity or {}).get("teacher") or {}
    return isinstance(teacher, dict) and teacher.get("backend") == REHEARSAL_BACKEND


def refuse_rehearsal(datasets: Iterable, allow: bool, setting: str = "data.allow_rehearsal") -> list[str]:
    """Raise :class:`RehearsalDataError` naming every rehearsal folder among ``datasets``
    (:class:`storage_schemas.reader.ScoredDataset`, one per teacher) unless ``allow``; returns
    those folders (for a warning when they are allowed)."""
    found = [str(folder.path) for dataset in datasets for folder in dataset.folders if is_rehearsal(folder.identity)]
    if found and not allow:
        raise RehearsalDataError(
            f"{', '.join(found)}: scored by the rehearsal teacher (scorer.backend=rehearsal), whose losses are a "
            f"hash, not a model's; score the corpus with a real teacher, or set {setting}=true to rehearse on it")
    return found


def warn_rehearsal(folders: list[str]) -> None:
    """Log, once per run, that the data accepted is a rehearsal's (:func:`refuse_rehearsal`'s list)."""
    if folders:
        log.warning("%s: %s", ", ".join(folders), NOTE)
