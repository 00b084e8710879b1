"""Which held-out text ``make eval-student`` measures bits per byte on, and reading it.

Two sources, alone or together (``bits_per_byte.texts``, ``bits_per_byte.scored``):

* text files: ``.txt`` is one document per file (its whole UTF-8 text); ``.jsonl`` is one document
  per line, its ``"text"`` field;
* a slice of a scored folder (stage-1 output), whose documents a student may or may not have
  trained on. For a train-student checkpoint (``final/`` or ``checkpoint-N/``, each holding the
  run's ``data_identity.json``) the slice is the shards the run held out
  (``data.held_out_shards``, recorded as ``shards_held_out``), and shards the run trained on
  (``shards_used``) are refused. For any other checkpoint (a hub id, a folder without that record)
  the shards must be named (``bits_per_byte.shards``) and the result says that whether they were
  trained on is not known.

Shards are matched to the run's record by the scored folder's corpus identity and the shard's file
name (one corpus and shard plan give one file name to one row range, whichever teacher scored it).
Documents are read in order (text files as listed, then shards as the manifest lists them), empty
texts left out, and cut at ``max_documents``; their digest (:func:`text_digest`) is what two
results must share to be compared.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.method.bits_per_byte import (  # noqa: F401  (HeldOutTextError: what reading a text file raises)
    TEXT_SUFFIXES,
    HeldOutTextError,
    shard_documents,
    text_file_documents,
)
from pipeline.runtime.config import check_at_least
from storage_schemas import ContractError
from storage_schemas.reader import ScoredDataset

# The run's data identity in each of its checkpoints and in final/ (written by stage 2:
# pipeline/train_student/checkpoints.py DATA_IDENTITY_NAME; a test keeps the two equal).
RUN_DATA_IDENTITY = "data_identity.json"
UNKNOWN = "unknown: the checkpoint is not a train-student run (no data_identity.json), so which documents it trained on is not known"


@dataclass(frozen=True)
class BitsPerByteSettings:
    """The ``bits_per_byte`` group of ``make eval-student``: held-out text and how it is measured."""

    texts: tuple[str, ...] = ()  # text files: .txt (one document per file) or .jsonl (one per line, its "text")
    scored: str | None = None  # a scored folder to take a held-out slice from
    shards: tuple[str, ...] | None = None  # shard files of `scored` (None: the shards the run held out)
    max_documents: int | None = None  # the first N documents (None: all)
    window: int | None = None  # tokens of context per block (None: the model's context minus one)
    batch_size: int = 8  # blocks per forward pass

    @property
    def asked(self) -> bool:
        return bool(self.texts) or self.scored is not None

    def problems(self) -> list[str]:
        found: list[str] = []
        for key in ("max_documents", "window", "batch_size"):
            check_at_least(found, key, getattr(self, key), 1)
        if self.shards is not None and self.scored is None:
            found.append("shards: name the scored folder they belong to (bits_per_byte.scored=<folder>)")
        return found


@dataclass(frozen=True)
class HeldOutText:
    """The held-out text as resolved before any model loads: files, shards and what is known."""

    text_files: tuple[str, ...] = ()
    scored: str | None = None
    shards: tuple[str, ...] = ()
    trained_on: str | None = None  # what the checkpoint's record says about the shards
    max_documents: int | None = None
    window: int | None = None
    batch_size: int = 8


def resolve(settings: BitsPerByteSettings, checkpoint: str, problems: list[str]) -> HeldOutText | None:
    """The held-out text of ``settings`` for ``checkpoint``; every problem is appended to
    ``problems`` as one line (``bits_per_byte.<key>: ...``). None when nothing is asked or wrong."""
    before = len(problems)
    for path in settings.texts:
        if Path(path).suffix not in TEXT_SUFFIXES:
            problems.append(f"bits_per_byte.texts: {path}: not a .txt or .jsonl file")
        elif not Path(path).is_file():
            problems.append(f"bits_per_byte.texts: text file not found: {path}")
    shards, trained_on = (), None
    if settings.scored is not None:
        shards, trained_on = _slice(settings.scored, settings.shards, checkpoint, problems)
    if len(problems) > before or not settings.asked:
        return None
    return HeldOutText(text_files=tuple(settings.texts), scored=settings.scored, shards=shards, trained_on=trained_on,
                       max_documents=settings.max_documents, window=settings.window, batch_size=settings.batch_size)


def _slice(folder: str, named: tuple[str, ...] | None, checkpoint: str,
           problems: list[str]) -> tuple[tuple[str, ...], str | None]:
    """The shards of ``folder`` to measure on and what is known about them (module docstring)."""
    try:
        dataset = ScoredDataset.open(folder)
    except (ContractError, OSError, ValueError) as exc:
        problems.append(f"bits_per_byte.scored: {folder} is not a scored dataset ({str(exc).splitlines()[0]})")
        return (), None
    files = [e["file"] for e in dataset.entries]
    unknown = [s for s in named or () if s not in files]
    if unknown:
        problems.append(f"bits_per_byte.shards: {', '.join(unknown)} not in {folder} (it lists "
                        f"{', '.join(files[:3])}{' ...' if len(files) > 3 else ''})")
    record = run_data_identity(checkpoint)
    if record is None:
        if named is None:
            problems.append(f"bits_per_byte.shards: name the shards of {folder} to measure on: {checkpoint} is not "
                            "a train-student checkpoint (no data_identity.json), so which shards it trained on is not known")
        return tuple(named or ()), UNKNOWN
    corpus = corpus_key(dataset.folders[0].identity)
    trained, held = run_shards(record, "shards_used"), run_shards(record, "shards_held_out")
    if corpus not in {c for c, _ in trained | held}:
        if named is None:
            problems.append(f"bits_per_byte.shards: name the shards of {folder} to measure on: the run trained on "
                            "another corpus (by its data identity), so no shard of this one was held out by it")
        return tuple(named or ()), "unknown: the run trained on another corpus; whether its documents overlap this one is not known"
    if named is None:
        chosen = tuple(f for f in files if (corpus, f) in held)
        if not chosen:
            problems.append(f"bits_per_byte.scored: the run trained on every shard of {folder} it used and held out "
                            "none (data.held_out_shards=0); train with data.held_out_shards=N, measure on text files "
                            "(bits_per_byte.texts=[...]), or on another corpus")
        return chosen, "no: the shards the run held out (data.held_out_shards)"
    seen = [s for s in named if (corpus, s) in trained]
    if seen:
        held_files = sorted(f for c, f in held if c == corpus)
        problems.append(f"bits_per_byte.shards: the run trained on {', '.join(seen)} of {folder} (its data identity "
                        f"lists them in shards_used); it held out {', '.join(held_files) or 'none'}")
    return tuple(named), "no: not among the shards the run trained on (its data identity)"


def run_data_identity(checkpoint: str) -> dict | None:
    """The data identity a train-student checkpoint records (None: not such a checkpoint)."""
    path = Path(checkpoint) / RUN_DATA_IDENTITY
    if not checkpoint:
        return None
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def corpus_key(identity: dict) -> str:
    return json.dumps(identity.get("corpus"), sort_keys=True)


def run_shards(record: dict, key: str) -> set[tuple[str, str]]:
    """``(corpus, file)`` of every shard a run's data identity lists under ``key`` (every teacher's)."""
    found = set()
    for part in [record, *record.get("teachers", [])]:
        folders = part.get("folders") or record.get("folders") or []
        for shard in part.get(key, []):
            folder = folders[shard.get("folder", 0)] if shard.get("folder", 0) < len(folders) else {}
            found.add((corpus_key(folder.get("identity") or {}), shard["file"]))
    return found


# ---- reading ----------------------------------------------------------------------------------


def read_documents(held: HeldOutText) -> tuple[list[str], list[dict]]:
    """The documents (non-empty texts, in order, at most ``max_documents``) and where they came
    from: one entry per source with its document count."""
    texts: list[str] = []
    sources: list[dict] = []
    limit = held.max_documents
    for path in held.text_files:
        found = [t for t in text_file_documents(path) if t]
        taken = found[: None if limit is None else max(0, limit - len(texts))]
        texts += taken
        sources.append({"kind": "text_file", "path": str(path), "documents": len(taken)})
    if held.scored is not None:
        taken = shard_documents(ScoredDataset.open(held.scored), held.shards,
                                None if limit is None else max(0, limit - len(texts)))
        texts += taken
        sources.append({"kind": "scored", "folder": str(held.scored), "shards": list(held.shards),
                        "documents": len(taken), "trained_on": held.trained_on})
    return texts, sources


def text_digest(texts: list[str]) -> str:
    """sha256 over the documents in order, each as its UTF-8 length (8 bytes) and bytes."""
    h = hashlib.sha256()
    for t in texts:
        data = t.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
