"""Resolving a corpus's sources: the ordered files it is read from, each described by its row
count, size and row groups, and the files with no usable text refused.

Two ways in, both ending in a list of files (:class:`pipeline.score_teacher.corpus.SourceFile`):

* ``source="files"``: Parquet or JSONL files by path, ``s3://`` / ``gs://`` URI or glob of either
  (sorted by location), e.g. a copy of OpenWebMath's ``data/train-000NN-of-000MM-*.parquet``.
* ``source="hub"``: the Parquet files of a hub dataset repository, read where they are. The
  revision is pinned to its commit, the split's files are chosen by name (``data.files`` patterns
  instead, if given), and only the file listing and the Parquet footers are read on the driver.
  Each actor range-reads its own row groups' text column over ``hf://datasets/<id>@<commit>/<path>``
  (``huggingface_hub.HfFileSystem``), so a node fetches only the bytes of the shards it scores.
  ``hub_root`` names a local or object-store copy of the repository to read instead of the hub.

Document id: ``<file name>:<row>`` for both, so the same file gives the same ids whatever its source.
Where two files of one corpus share a name (``a/train.jsonl``, ``b/train.jsonl``), each is named by
as many trailing parts of its path as tell them apart (``a/train.jsonl:0``): the same for a local
copy, a bucket and a hub repository of the same layout (:func:`file_labels`).

A file with no usable text at all is refused before any work, naming it, the fields it has and
``data.text_column``: a Parquet file without the text column, whose text column is not a string
column (int64, say), or whose text column is null in every row (its footer's statistics say so); a
JSONL file none of whose first :data:`TEXT_SAMPLE_LINES` lines holds a string in the text field. A
corpus of no row at all is refused too. A few null or missing texts are not: each is recorded with
its document when its shard is read (:mod:`pipeline.score_teacher.shards`, docs/RELIABILITY.md).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from dataclasses import dataclass
from typing import Iterable

import pyarrow.fs as pafs
import pyarrow.parquet as pq
from huggingface_hub import HfApi

from pipeline.score_teacher.corpus import (
    HF_SCHEME,
    KINDS,
    CorpusConfig,
    CorpusError,
    SourceFile,
    file_name,
    is_readable_text,
    is_remote,
    is_text_type,
    one_line,
    open_location,
)
from storage_schemas import filesystem

log = logging.getLogger(__name__)

TEXT_SAMPLE_LINES = 64  # a JSONL file's first lines that must hold some text
TEXT_SAMPLE_BYTES = 64 << 20  # read at most this much for them (a longer first line: not judged)


def resolve_sources(cfg: CorpusConfig, hub_api=None) -> list[SourceFile]:
    """The ordered input files with their row counts (from Parquet footers), as far as
    ``limit_docs`` needs them; raises :class:`CorpusError` naming the file. ``hub_api`` stands in
    for ``huggingface_hub.HfApi()`` (source=hub without hub_root)."""
    if cfg.rows_per_shard < 1:
        raise CorpusError(f"rows_per_shard must be >= 1, got {cfg.rows_per_shard}")
    if cfg.source == "files":
        sources = _describe_all(_file_locations(cfg), cfg)
    elif cfg.source == "hub":
        sources = _describe_all(_hub_locations(cfg, hub_api), cfg)
    else:
        raise CorpusError(f"unknown corpus source {cfg.source!r}; choose 'files' or 'hub'")
    if not any(s.rows for s in sources):
        raise CorpusError(f"corpus {cfg.name!r}: no document to score: {_sample([s.path for s in sources])} "
                          f"{'is' if len(sources) == 1 else 'are'} empty")
    return sources


def _file_locations(cfg: CorpusConfig) -> list[tuple[str, str | None]]:
    if not cfg.files:
        raise CorpusError(f"corpus {cfg.name!r}: source=files needs data.files (a path, URI or glob)")
    found: dict[str, str] = {}  # the file itself (a local one's real path) -> the name it was first listed by
    listed: dict[str, int] = {}
    for pattern in cfg.files:
        for match in _expand(str(pattern), cfg.name):
            key = match if filesystem.is_remote(match) else os.path.realpath(match)
            found.setdefault(key, match)
            listed[key] = listed.get(key, 0) + 1
    _note_listed_twice({found[k]: n for k, n in listed.items() if n > 1})
    return [(m, None) for m in found.values()]


_NOTED: set[tuple] = set()  # what this process has said already (the sources are resolved more than once)


def _note_listed_twice(times: dict[str, int]) -> None:
    """One warning line for the files ``data.files`` lists more than once (by two patterns, twice by
    name, or by another name through a link): each is scored once, under the name it was first listed by."""
    key = tuple(sorted(times.items()))
    if not times or key in _NOTED:
        return
    _NOTED.add(key)
    shown = ", ".join(f"{path} ({n} times)" for path, n in list(times.items())[:5])
    more = f" and {len(times) - 5} more" if len(times) > 5 else ""
    log.warning("data.files lists %s more than once: %s%s; each is scored once",
                "a file" if len(times) == 1 else f"{len(times)} files", shown, more)


def _expand(pattern: str, corpus: str) -> list[str]:
    text = pattern if filesystem.is_remote(pattern) else os.path.expanduser(pattern)
    magic = any(ch in text for ch in "*?[")
    try:
        if magic:
            matches = filesystem.glob(text)
        else:
            matches = [text] if filesystem.is_file(text) else []
    except (OSError, ValueError) as exc:
        raise CorpusError(f"corpus {corpus!r}: cannot list {pattern!r} ({one_line(exc)})") from exc
    if not matches and not magic and filesystem.is_dir(text):
        kinds = sorted({k for name in _names_in(text) for suffix, k in KINDS.items() if name.endswith(suffix)})
        raise CorpusError(f"corpus {corpus!r}: {pattern!r} is a folder; give its files: "
                          + (" or ".join(repr(f"{text.rstrip('/')}/*{suffix}") for suffix, k in KINDS.items() if k in kinds)
                             or f"'{text.rstrip('/')}/*.parquet' (it holds no .parquet or .jsonl file)"))
    if not matches:
        raise CorpusError(f"corpus {corpus!r}: no file matches {pattern!r}")
    return [m if filesystem.is_remote(m) else os.path.abspath(m) for m in matches]


def _describe_all(locations: list[tuple[str, str | None]], cfg: CorpusConfig) -> list[SourceFile]:
    """Describe files in order until ``limit_docs`` rows are covered (footers only, for Parquet),
    each named as the whole corpus's listing tells it apart (so ``limit_docs`` changes no id)."""
    sources: list[SourceFile] = []
    rows = 0
    labels = file_labels([location for location, _ in locations])
    for (location, sha256), label in zip(locations, labels):
        if cfg.limit_docs is not None and rows >= cfg.limit_docs:
            break
        sources.append(describe_file(location, cfg.text_column, sha256, label))
        rows += sources[-1].rows
    _warn_large_row_groups(sources, cfg.rows_per_shard)
    return sources


def _names_in(folder: str) -> list[str]:
    try:
        return filesystem.list_names(folder)
    except OSError:
        return []


def file_labels(locations: list[str]) -> list[str]:
    """What the document ids name each file by: its file name, unless another file of the corpus
    has that name too; then each of those by its last path parts, as few as tell them all apart
    (``a/train.jsonl``, ``b/train.jsonl``), whatever comes before (a local folder, a bucket, the
    hub's ``datasets/<id>@<commit>``). Files whose paths differ only there keep their locations."""
    parts = [location.split("://", 1)[-1].replace(os.sep, "/").strip("/").split("/") for location in locations]
    labels = [p[-1] for p in parts]
    by_name: dict[str, list[int]] = {}
    for i, name in enumerate(labels):
        by_name.setdefault(name, []).append(i)
    for same in (s for s in by_name.values() if len(s) > 1):
        tails = [locations[i] for i in same]
        for k in range(2, max(len(parts[i]) for i in same) + 1):
            if len({"/".join(parts[i][-k:]) for i in same}) == len(same):
                tails = ["/".join(parts[i][-k:]) for i in same]
                break
        for i, tail in zip(same, tails):
            labels[i] = tail
    return labels


def describe_file(location: str, text_column: str, sha256: str | None = None, label: str | None = None) -> SourceFile:
    """Row count, size and row groups of one file: a Parquet footer, or a JSONL file's lines.
    ``label`` names it in the document ids (default: its file name; :func:`file_labels`)."""
    name = file_name(location)
    label = label or name
    kind = next((k for suffix, k in KINDS.items() if name.endswith(suffix)), None)
    if kind is None:
        raise CorpusError(f"{location}: unsupported corpus file type; expected .parquet or .jsonl")
    fs, path = open_location(location)
    try:
        if kind == "parquet":
            with fs.open_input_file(path) as f:
                size = f.size()
                meta = pq.ParquetFile(f).metadata
        else:
            size, rows, head = _scan_lines(fs, path)
    except Exception as exc:
        what = "not a readable Parquet file" if kind == "parquet" else "not readable"
        raise CorpusError(f"{location}: {what} ({one_line(exc)})") from exc
    if kind == "jsonl":
        _refuse_jsonl_without_text(location, head, text_column)
        return SourceFile(location, "jsonl", rows, label, bytes=size, sha256=sha256)
    _refuse_parquet_without_text(location, meta, text_column)
    groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
    return SourceFile(location, "parquet", meta.num_rows, label, bytes=size, sha256=sha256, row_groups=groups)


def _scan_lines(fs: pafs.FileSystem, path: str) -> tuple[int, int, list[bytes]]:
    """Size and line count (a last line without a newline counts) of a file, streamed, and its
    first :data:`TEXT_SAMPLE_LINES` lines (those within its first :data:`TEXT_SAMPLE_BYTES`)."""
    size, lines, last, head = 0, 0, b"\n", bytearray()
    with fs.open_input_stream(path) as f:
        while block := f.read(1 << 22):
            size += len(block)
            if lines < TEXT_SAMPLE_LINES and len(head) < TEXT_SAMPLE_BYTES:
                head += block
            lines += block.count(b"\n")
            last = block[-1:]
    first = bytes(head).split(b"\n")
    complete = first[:-1] if len(head) < size or last == b"\n" else first  # the last part may be cut
    return size, lines + (last != b"\n"), complete[:TEXT_SAMPLE_LINES]


def _refuse_jsonl_without_text(location: str, lines: list[bytes], text_column: str) -> None:
    """Refuse a JSONL file none of whose first lines holds a string in ``text_column`` (an empty
    file is left to the corpus-wide check; some lines without text are recorded per document)."""
    objects = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            objects.append(record)
    if not lines or any(isinstance(o.get(text_column), str) for o in objects):
        return
    if not objects:
        raise CorpusError(f"{location}: none of its first {len(lines)} lines is a JSON object; a JSONL corpus "
                          f"holds one object per line with its text in a field (data.text_column={text_column})")
    lengths: dict[str, int] = {}
    for o in objects:
        for key, value in o.items():
            lengths[key] = lengths.get(key, 0) + (len(value) if isinstance(value, str) else 0)
    found = f"fields found: {', '.join(lengths)}"
    what = (f"no field {text_column!r} in its first {len(lines)} lines ({found})"
            if not any(text_column in o for o in objects) else
            f"field {text_column!r} holds no text in its first {len(lines)} lines "
            f"(null or not a string in each; {found})")
    raise CorpusError(f"{location}: {what}; {_text_column_fix(lengths, text_column)}")


def _refuse_parquet_without_text(location: str, meta: pq.FileMetaData, text_column: str) -> None:
    """Refuse a Parquet file without ``text_column``, or whose footer says it is null in every row."""
    schema = meta.schema.to_arrow_schema()
    sizes: dict[str, int] = {}  # the string columns' bytes, from the footer
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            name = column.path_in_schema
            if name in schema.names and is_text_type(schema.field(name).type):
                sizes[name] = sizes.get(name, 0) + column.total_uncompressed_size
    if text_column not in schema.names:
        raise CorpusError(f"{location}: no column {text_column!r} (columns found: {', '.join(schema.names)}); "
                          f"{_text_column_fix(sizes, text_column)}")
    kind = schema.field(text_column).type
    if not is_readable_text(kind):
        raise CorpusError(f"{location}: column {text_column!r} has type {kind}; the text must be a string column "
                          f"(columns found: {', '.join(schema.names)}); {_text_column_fix(sizes, text_column)}")
    if meta.num_rows and _all_null(meta, schema.get_field_index(text_column)):
        others = {k: v for k, v in sizes.items() if k != text_column}
        raise CorpusError(f"{location}: column {text_column!r} holds no text (null in all {meta.num_rows} rows; "
                          f"columns found: {', '.join(schema.names)}); {_text_column_fix(others, text_column)}")


def _all_null(meta: pq.FileMetaData, index: int) -> bool:
    """Whether the footer's statistics say column ``index`` is null in every row (False where a
    row group has no null count)."""
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(index).statistics
        if stats is None or not stats.has_null_count or stats.null_count != meta.row_group(g).num_rows:
            return False
    return True


def _text_column_fix(text_sizes: dict[str, int], text_column: str) -> str:
    """How to name the text field: the one holding the most text among those found, if any."""
    candidates = {k: v for k, v in text_sizes.items() if k != text_column and v > 0}
    if not candidates:
        return "set data.text_column=<the field that holds the text>"
    return f"set data.text_column={max(candidates, key=candidates.get)} if that field holds the text"


def _warn_large_row_groups(sources: list[SourceFile], rows_per_shard: int) -> None:
    """A shard reads whole row groups: where they are much larger than a shard, each remote row
    group is fetched several times (by different shards, maybe on different nodes)."""
    largest = max((g for s in sources if is_remote(s.path) for g in s.row_groups), default=0)
    if largest > 2 * rows_per_shard:
        log.warning("Parquet row groups of up to %d rows and shards of %d rows: a row group is read by up to %d "
                    "shards; a rows_per_shard near the row group size reads each byte once",
                    largest, rows_per_shard, -(-largest // rows_per_shard) + 1)


# The hub


@dataclass(frozen=True)
class RepoFile:
    """A file of a dataset repository: its path inside it, size and (where known) content sha256."""

    path: str
    size: int
    sha256: str | None = None


def _hub_locations(cfg: CorpusConfig, hub_api) -> list[tuple[str, str | None]]:
    if not cfg.hub_id:
        raise CorpusError(f"corpus {cfg.name!r}: source=hub needs data.hub_id")
    if cfg.hub_root:
        root = cfg.hub_root if filesystem.is_remote(cfg.hub_root) else os.path.abspath(os.path.expanduser(cfg.hub_root))
        files = folder_listing(root)
        where, locate = root, (lambda p: filesystem.join(root, *p.split("/")))
    else:
        commit, files = hub_listing(cfg.hub_id, cfg.revision, hub_api)
        where, locate = f"{cfg.hub_id}@{cfg.revision or 'main'}", (lambda p: hub_location(cfg.hub_id, commit, p))
    chosen = select_repo_files(files, cfg.split, cfg.hub_config, cfg.files)
    if not chosen:
        raise CorpusError(f"corpus {cfg.name!r}: no Parquet file in {where} for {_selection(cfg)} "
                          f"(the repository holds: {_sample([f.path for f in files])})")
    return [(locate(f.path), f.sha256) for f in chosen]


def hub_location(hub_id: str, commit: str, path: str) -> str:
    """Where ``HfFileSystem`` reads ``path`` of dataset ``hub_id`` at ``commit``."""
    return f"{HF_SCHEME}datasets/{hub_id}@{commit}/{path}"


def hub_listing(hub_id: str, revision: str | None, api=None) -> tuple[str, list[RepoFile]]:
    """The commit ``revision`` (default: main) points at, and the repository's files there, each
    with the sha256 the hub records for its content (LFS/Xet files; None for small git files)."""
    if api is None:
        api = HfApi()
    try:
        commit = api.dataset_info(hub_id, revision=revision).sha
        tree = api.list_repo_tree(hub_id, repo_type="dataset", revision=commit, recursive=True)
        files = [RepoFile(e.path, e.size, e.lfs.sha256 if getattr(e, "lfs", None) else None)
                 for e in tree if hasattr(e, "blob_id")]
    except Exception as exc:
        raise CorpusError(f"cannot list the hub dataset {hub_id}@{revision or 'main'} ({one_line(exc)}); "
                          "without the hub, set data.hub_root to a local or s3:// copy of the repository") from exc
    return commit, files


def folder_listing(root: str) -> list[RepoFile]:
    """The files under a local or object-store folder, as paths relative to it (hidden ones left out)."""
    fs, base = filesystem.resolve(root)
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except (OSError, ValueError) as exc:
        raise CorpusError(f"hub_root {root}: cannot list it ({one_line(exc)})") from exc
    files = []
    for info in infos:
        rel = info.path[len(base):].lstrip("/")
        if info.type == pafs.FileType.File and not any(part.startswith(".") for part in rel.split("/")):
            files.append(RepoFile(rel, info.size))
    return sorted(files, key=lambda f: f.path)


def select_repo_files(files: Iterable[RepoFile], split: str, config: str | None,
                      patterns: Iterable[str] = ()) -> list[RepoFile]:
    """The Parquet files of a repository that make up the corpus, sorted by path: those matching
    ``patterns`` (shell-style over the path in the repository) if any, else the split's files by
    the hub's naming convention: a file name starting with ``<split>-`` or ``<split>.``, or a
    folder named ``<split>`` (``data/train-00000-of-00114-*.parquet``, ``<config>/train/0000.parquet``).
    ``config`` keeps only the files under that top folder."""
    patterns = list(patterns)

    def wanted(path: str) -> bool:
        if not path.endswith(".parquet"):
            return False
        if config and not path.startswith(config.rstrip("/") + "/"):
            return False
        if patterns:
            return any(fnmatch.fnmatchcase(path, p) for p in patterns)
        *folders, name = path.split("/")
        return name.startswith((f"{split}-", f"{split}.")) or split in folders

    return sorted((f for f in files if wanted(f.path)), key=lambda f: f.path)


def _selection(cfg: CorpusConfig) -> str:
    what = f"patterns {list(cfg.files)}" if cfg.files else f"split {cfg.split!r}"
    return what + (f" under {cfg.hub_config}/" if cfg.hub_config else "")


def _sample(paths: list[str], n: int = 8) -> str:
    return ", ".join(paths[:n]) + (f" and {len(paths) - n} more" if len(paths) > n else "") if paths else "nothing"


