"""``data.held_out_shards``: the last N planned shards of the first scored folder are never trained
on, so their documents are held-out text (evaluation while training, ``make eval-student``).
Shared by stage 2 and the export, which hold the same shards out, so that a run from an export and
a run from the scored folders evaluate on the same text.

With several teachers the same shards are held out of every teacher: each teacher's first folder
must then be the same corpus in the same shard plan (its identity's ``corpus``: files, rows per
shard, number of shards...), where shard ``i`` holds the same documents whoever scored it; other
first folders are refused, naming the differences.
"""

from __future__ import annotations

from dataclasses import replace

from pipeline.runtime.config import ConfigError
from storage_schemas import filesystem as sfs
from storage_schemas import iter_identity_differences
from storage_schemas.reader import ScoredDataset, ScoredFolder


def held_out_entries(folder: ScoredFolder, n: int) -> list[dict]:
    """The manifest entries of the shards ``data.held_out_shards=n`` holds out: those of ``folder``
    (the first of ``data.folders``) whose index is among its last ``n`` planned, so the choice does
    not move while a partial scoring finishes."""
    first = folder.n_shards_planned - n
    return [e for e in folder.manifest.get("shards", []) if int(e.get("index", -1)) >= first]


def held_out_record(folder: ScoredFolder, n: int) -> list[dict]:
    """The data identity's ``shards_held_out``, in the form of its ``shards_used``."""
    return [{"file": e["file"], "folder": 0, "sha256": e.get("sha256", ""), "rows": int(e.get("rows", 0))}
            for e in held_out_entries(folder, n)]


def hold_out(scored: list[ScoredDataset], n: int) -> list[ScoredDataset]:
    """The opened teachers (one :class:`ScoredDataset` each) without the shards
    ``data.held_out_shards=n`` holds out of each one's first folder (module docstring)."""
    if n == 0:
        return scored
    first = scored[0].folders[0]
    for other in scored[1:]:
        diffs = list(iter_identity_differences(first.identity.get("corpus") or {},
                                               other.folders[0].identity.get("corpus") or {}, "corpus."))
        if diffs:
            raise ConfigError(
                f"data.held_out_shards: {n} with several teachers holds the same shards out of each teacher's first "
                f"folder, so those must be one corpus in one shard plan; {other.folders[0].path} is not "
                f"{first.path}'s: {'; '.join(diffs)}. Score the corpus with the same data settings for every teacher, "
                "or set data.held_out_shards=0 and evaluate on text files (train.eval_texts=[...])")
    kept = []
    for teacher in scored:
        folder = teacher.folders[0]
        held = {e["file"] for e in held_out_entries(folder, n)}
        shards = [s for s in teacher.shards if not (s.folder == 0 and sfs.name(s.path) in held)]
        if not shards:
            raise ConfigError(f"data.held_out_shards: {n} of the {folder.n_shards_planned} planned shards of "
                              f"{folder.path} leaves none to train on; hold out fewer")
        kept.append(replace(teacher, shards=shards))
    return kept
