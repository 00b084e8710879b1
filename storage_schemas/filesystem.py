"""Local paths and object-store URIs behind one interface (pyarrow file systems).

A location is a local path (``data/x.parquet``, ``/abs/dir``, ``file:///abs/dir``) or a URI of an
object store: ``s3://bucket/key`` (credentials, region and ``AWS_ENDPOINT_URL`` from the standard AWS
environment variables and files), ``gs://bucket/key`` (Google's standard credentials). pyarrow
resolves the file system; nothing here keeps a connection open, so a location string can be sent to
a Ray actor on another node and opened there.

An S3 request that fails in a way worth another try (503 SlowDown, another 5xx, a dropped or
timed-out connection) is tried again by the AWS SDK inside pyarrow, with the standard retry mode's
backoff, up to ``AWS_MAX_ATTEMPTS`` attempts (the standard AWS variable; 10 here when unset;
``AWS_RETRY_MODE=legacy`` takes the SDK's older strategy). Those retries are counted
(:mod:`storage_schemas.store_calls`); a request still failing after them is
:func:`unavailable` (docs/object-storage.md, "When the store throttles or drops").
"""

from __future__ import annotations

import fnmatch
import glob as _glob
import hashlib
import os
import posixpath
import re
from functools import lru_cache
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage_schemas import store_calls

REMOTE_SCHEMES = ("s3", "gs", "gcs")
DEFAULT_MAX_ATTEMPTS = 10  # the AWS SDKs' standard mode has 3: too few for a store that throttles a long job
RETRY_MODES = ("standard", "legacy")
AWS_ERROR = re.compile(r"AWS Error (\w+)(?: \(HTTP status (\d+)\))? during (\w+) operation")
GONE = {"NETWORK_CONNECTION", "SLOW_DOWN", "THROTTLING", "SERVICE_UNAVAILABLE", "REQUEST_TIMEOUT", "INTERNAL_FAILURE"}


class StoreSettingError(ValueError):
    """``AWS_MAX_ATTEMPTS`` or ``AWS_RETRY_MODE`` holds a value the S3 client cannot use."""


class StoreUnavailableError(OSError):
    """The object store did not answer a request within the client's retries."""


def scheme(location: str | os.PathLike) -> str:
    """``"s3"``, ``"gs"`` ... for an object-store URI, ``""`` for a local path."""
    text = os.fspath(location)
    head, sep, _ = text.partition("://")
    return head.lower() if sep and head.lower() in REMOTE_SCHEMES else ""


def is_remote(location: str | os.PathLike) -> bool:
    return scheme(location) != ""


@lru_cache(maxsize=32)
def _remote_fs(bucket_uri: str, endpoint: str | None, retries: tuple[str, int]) -> pafs.FileSystem:
    store_calls.start()  # before the SDK starts in this process
    fs, _ = pafs.FileSystem.from_uri(bucket_uri)  # region and endpoint as pyarrow finds them
    if not isinstance(fs, pafs.S3FileSystem):
        return fs
    mode, attempts = retries
    if mode == "legacy":  # the SDK's older strategy counts the attempts after the first (measured)
        strategy = pafs.AwsDefaultS3RetryStrategy(max_attempts=attempts - 1)
    else:
        strategy = pafs.AwsStandardS3RetryStrategy(max_attempts=attempts)
    return pafs.S3FileSystem(region=fs.region or None, endpoint_override=endpoint or None, retry_strategy=strategy)


def retry_settings() -> tuple[str, int]:
    """The S3 client's retry mode and attempts per request, from ``AWS_RETRY_MODE`` and ``AWS_MAX_ATTEMPTS``."""
    mode = os.environ.get("AWS_RETRY_MODE", "").strip().lower() or "standard"
    text = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    problems = []
    if mode not in RETRY_MODES:
        problems.append(f"AWS_RETRY_MODE={mode!r}: use one of {', '.join(RETRY_MODES)} "
                        "(pyarrow's S3 client has no other)")
    if text and not (text.isdigit() and int(text) >= 1):
        problems.append(f"AWS_MAX_ATTEMPTS={text!r}: use a whole number of attempts per request, at least 1")
    if problems:
        raise StoreSettingError("; ".join(problems))
    return mode, int(text) if text else DEFAULT_MAX_ATTEMPTS


def unavailable(exc: BaseException) -> str | None:
    """The store's own words when ``exc`` (or what caused it, across a Ray task or a data-loader
    worker) is an S3 request that failed after the client's retries because the store throttled,
    failed or could not be reached; None for anything else (a missing object, a refused key)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for line in str(exc).splitlines():
            match = AWS_ERROR.search(line)
            if match and (match.group(1) in GONE or int(match.group(2) or 0) >= 500 or match.group(2) == "429"):
                return line.strip()
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return None


def resolve(location: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """The file system and the path inside it for a location (a local path is made absolute)."""
    text = os.fspath(location)
    kind = scheme(text)
    if not kind:
        if text.startswith("file://"):
            text = text[len("file://"):]
        return pafs.LocalFileSystem(), os.path.abspath(text)
    rest = text.split("://", 1)[1]
    bucket = rest.split("/", 1)[0]
    if not bucket:
        raise ValueError(f"{text}: no bucket in the URI")
    retries = retry_settings() if kind == "s3" else ("standard", 0)
    return _remote_fs(f"{kind}://{bucket}", os.environ.get("AWS_ENDPOINT_URL"), retries), rest.rstrip("/")


def location(value: str | os.PathLike) -> Path | str:
    """A location in the form the readers keep: a local path as an absolute ``Path``, an object-store
    URI as a string without a trailing slash (``Path`` would fold ``s3://`` into ``s3:/``)."""
    text = os.fspath(value)
    if is_remote(text):
        return text.rstrip("/")
    if text.startswith("file://"):
        text = text[len("file://"):]
    return Path(text).resolve()


def child(folder: Path | str, *names: str) -> Path | str:
    """``folder / name`` keeping the kind of :func:`location` (``Path`` or URI string)."""
    if isinstance(folder, str) and is_remote(folder):
        return posixpath.join(folder.rstrip("/"), *names)
    return Path(folder).joinpath(*names)


def name(location: str | os.PathLike) -> str:
    """The last part of a location (``s3://b/x/shard-000001.parquet`` -> ``shard-000001.parquet``)."""
    return posixpath.basename(os.fspath(location).rstrip("/"))


def parent(location: str | os.PathLike) -> Path | str:
    """The folder a location is in, of the same kind."""
    text = os.fspath(location)
    if is_remote(text):
        return posixpath.dirname(text.rstrip("/"))
    return Path(text).parent


def join(location: str | os.PathLike, *parts: str) -> str:
    """``location`` with ``parts`` appended, keeping its scheme (``s3://b/x`` + ``y`` -> ``s3://b/x/y``)."""
    text = os.fspath(location)
    if is_remote(text):
        return posixpath.join(text.rstrip("/"), *parts)
    return os.path.join(text, *parts)


def exists(location: str | os.PathLike) -> bool:
    fs, path = resolve(location)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_file(location: str | os.PathLike) -> bool:
    fs, path = resolve(location)
    return fs.get_file_info(path).type == pafs.FileType.File


def is_dir(location: str | os.PathLike) -> bool:
    """A local folder, or an object-store prefix that holds at least one object."""
    fs, path = resolve(location)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def size(location: str | os.PathLike) -> int | None:
    """The size in bytes of a file or object, ``None`` when there is none."""
    fs, path = resolve(location)
    info = fs.get_file_info(path)
    return info.size if info.type == pafs.FileType.File else None


def file_sizes(folder: str | os.PathLike) -> dict[str, int]:
    """``{name: bytes}`` of the files directly inside ``folder`` (one listing on an object store;
    empty when it does not exist)."""
    fs, path = resolve(folder)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return {posixpath.basename(i.path): i.size for i in infos if i.type == pafs.FileType.File}


def sha256(location: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The sha256 of a file or object, streamed."""
    h = hashlib.sha256()
    fs, path = resolve(location)
    with fs.open_input_stream(path) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def parquet_file(location: str | os.PathLike, **options) -> pq.ParquetFile:
    """A Parquet file opened through :func:`resolve`, so that an object store's retry settings and
    counts apply (a URI given to pyarrow as it is would get a client of pyarrow's own defaults)."""
    fs, path = resolve(location)
    return pq.ParquetFile(path, filesystem=fs, **options)


def parquet_schema(location: str | os.PathLike):
    """The schema (with its key-value metadata) in a Parquet file's footer, read as :func:`parquet_file`."""
    fs, path = resolve(location)
    return pq.read_schema(path, filesystem=fs)


def read_bytes(location: str | os.PathLike) -> bytes:
    fs, path = resolve(location)
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes(location: str | os.PathLike, data: bytes) -> None:
    """Write a whole object. On an object store the object appears whole or not at all (a single PUT
    or a completed multipart upload); locally the caller wants :func:`write_json_atomic`-style
    rename where readers may look at the file while it is written."""
    fs, path = resolve(location)
    with fs.open_output_stream(path) as f:
        f.write(data)


def delete(location: str | os.PathLike) -> None:
    fs, path = resolve(location)
    fs.delete_file(path)


def list_names(folder: str | os.PathLike) -> list[str]:
    """The names of the files directly inside ``folder`` (empty when it does not exist)."""
    fs, path = resolve(folder)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.File)


def glob(pattern: str) -> list[str]:
    """Locations matching a glob (``*``, ``?``, ``[...]`` in the last parts; ``**`` for any depth),
    sorted, with the pattern's scheme. A local pattern uses :mod:`glob`."""
    if not is_remote(pattern):
        return sorted(_glob.glob(pattern, recursive=True))
    kind = scheme(pattern)
    fs, path = resolve(pattern)
    parts = path.split("/")
    fixed = []
    for part in parts:
        if any(ch in part for ch in "*?["):
            break
        fixed.append(part)
    if len(fixed) == len(parts):
        return [pattern] if fs.get_file_info(path).type == pafs.FileType.File else []
    base = "/".join(fixed)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    found = [i.path for i in infos if i.type == pafs.FileType.File and _match(i.path, path)]
    return sorted(f"{kind}://{p}" for p in found)


def _match(path: str, pattern: str) -> bool:
    if "**" not in pattern:
        return path.count("/") == pattern.count("/") and fnmatch.fnmatchcase(path, pattern)
    return fnmatch.fnmatchcase(path, pattern.replace("**/", "*").replace("**", "*"))
