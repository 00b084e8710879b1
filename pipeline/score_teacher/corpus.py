"""What a corpus is to stage 1: its configuration, the files it is read from, the shards it is cut
into, one document, and where a file lives (a local path, ``s3://`` / ``gs://`` or ``hf://``).

The work on a corpus is in three modules, in the order a job runs them:
:mod:`pipeline.score_teacher.corpus_sources` finds and describes the files (``source=files`` or
``source=hub``) and refuses a file with no usable text; :mod:`pipeline.score_teacher.shards` cuts
them into shards, proves the corpus's identity and reads one shard's documents.

Document id: ``<file name>:<row>`` whatever the source, so the same file gives the same ids from a
local copy, a bucket or a hub repository (:func:`pipeline.score_teacher.corpus_sources.file_labels`).
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

import pyarrow as pa
import pyarrow.fs as pafs
from huggingface_hub import HfFileSystem

from pipeline.runtime.config import UserError, check_at_least, check_choice
from storage_schemas import filesystem

SOURCES = ("files", "hub")
HF_SCHEME = "hf://"
KINDS = {".parquet": "parquet", ".jsonl": "jsonl"}


class CorpusError(UserError, ValueError):
    """A corpus that cannot be read; the message names the file and the problem."""


@dataclass(frozen=True)
class CorpusConfig:
    """Which corpus stage 1 scores and how it is cut into shards (docs/METHOD.md §1.5)."""

    name: str = "corpus"
    source: str = "files"  # files | hub
    # source=files: paths, s3:// or gs:// URIs, or globs of them. source=hub: patterns over the
    # paths inside the repository (e.g. data/train-0000[0-4]-*.parquet), replacing the split's files.
    files: list[str] = field(default_factory=list)
    hub_id: str | None = None  # source=hub
    hub_config: str | None = None  # source=hub: only files under this folder of the repository
    hub_root: str | None = None  # source=hub: a local or s3:// / gs:// copy of the repository, read instead
    split: str = "train"
    revision: str | None = None
    text_column: str = "text"
    rows_per_shard: int = 2000
    limit_docs: int | None = None  # take only the first N documents of the plan
    license: str | None = None  # the corpus's license (a hub id such as cc-by-4.0), for the dataset card

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "source", self.source, SOURCES)
        check_at_least(found, "rows_per_shard", self.rows_per_shard, 1)
        check_at_least(found, "limit_docs", self.limit_docs, 1)
        if self.license is not None and (not self.license.strip() or any(c.isspace() for c in self.license)):
            found.append(f"license: {self.license!r} is not a license id; use the hub's id (cc-by-4.0, odc-by, "
                         "apache-2.0, other ...)")
        if self.source == "hub" and not self.hub_id:
            found.append("hub_id: source=hub needs the dataset's hub id (also with hub_root, which only says where a copy is)")
        if self.source == "hub" and any(filesystem.is_remote(f) or os.path.isabs(f) for f in self.files):
            found.append("files: with source=hub these are patterns inside the repository (data/train-*.parquet), "
                         "not paths or URIs; use source=files for files elsewhere")
        if self.source != "hub" and self.hub_root:
            found.append("hub_root: only used with source=hub")
        return found


@dataclass(frozen=True)
class SourceFile:
    path: str  # a local path, an s3:// / gs:// URI or an hf:// location
    kind: str  # parquet | jsonl
    rows: int
    label: str  # document ids are f"{label}:{row_offset + row}"
    row_offset: int = 0
    bytes: int = 0
    sha256: str | None = None  # the content digest where the source records it (the hub's LFS oid)
    row_groups: tuple[int, ...] = ()  # rows per Parquet row group, from the footer


@dataclass(frozen=True)
class ShardSpec:
    index: int
    path: str
    kind: str
    label: str
    start: int  # first row in the file
    stop: int  # one past the last row in the file
    row_offset: int  # added to the row for the document id

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"shard {self.index} ({self.path} rows {self.start}-{self.stop})"


@dataclass
class Document:
    doc_id: str
    text: str | None
    problem: str | None = None  # why the text could not be decoded, if it could not


# ---------------------------------------------------------------------------------------------
# Locations


def is_remote(location: str) -> bool:
    return location.startswith(HF_SCHEME) or filesystem.is_remote(location)


def file_name(location: str) -> str:
    """The last part of a path or URI: what document ids and the identity name a file by."""
    return posixpath.basename(location.rstrip("/")) if "://" in location else os.path.basename(location)


def open_location(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system and path of a local path, an ``s3://`` / ``gs://`` URI or an
    ``hf://`` location (huggingface_hub's ``HfFileSystem``: HTTP range reads, ``HF_TOKEN`` honoured)."""
    if location.startswith(HF_SCHEME):
        return _hf_filesystem(), location[len(HF_SCHEME):]
    return filesystem.resolve(location)


@lru_cache(maxsize=1)
def _hf_filesystem() -> pafs.FileSystem:
    return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem()))


def absolute_files(cfg: CorpusConfig) -> CorpusConfig:
    """Local ``files`` made absolute (actors may start elsewhere); URIs and hub patterns as written."""
    if cfg.source != "files":
        return cfg
    return replace(cfg, files=[f if filesystem.is_remote(f) else os.path.abspath(os.path.expanduser(f)) for f in cfg.files])


def one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Text columns


def is_text_type(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def is_readable_text(kind: pa.DataType) -> bool:
    """What a shard reads as text: strings, or bytes decoded per row
    (:func:`pipeline.score_teacher.shards.read_shard`)."""
    return is_text_type(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
