"""What a teacher, a student or a corpus *is*, independent of where it sits on disk.

A scored dataset and a training run record the identity of what produced them, and a rerun is
refused when it differs. The identity must hold content, not locations: a project folder that is
moved, copied to another machine or opened from another checkout holds the same data.

* A model in a local folder is identified by the sha256 of its ``config.json`` (and of any Python
  files, which ``trust_remote_code`` would run) and of its weight files; a hub model by its id and
  revision.
* A corpus file by its name (the document ids are ``<file name>:<row>``), row count, size and the
  sha256 of its bytes (:mod:`pipeline.score_teacher.shards`).

Digesting 7B weights (~15 GB) on every rerun would cost minutes, so :func:`file_sha256_cached`
hashes each file once and caches the digest under a key made of the file's real path, device,
inode, size, modification time and change time (all to the nanosecond). Any write through the
filesystem updates the change time, which user space cannot set back, so a file whose content
changed never matches its cached key; a moved or copied file gets a new key and is hashed again
once. A file changed within two seconds before it was hashed is not cached (its change time may not
move on a second write in the same clock tick), and neither is one that changed while it was read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from pipeline import __version__
from pipeline.runtime.config import MissingPathError
from storage_schemas import file_sha256, write_json_atomic

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin")
RACY_SECONDS = 2.0


def digest_cache_dir() -> Path:
    """Where file digests are cached: ``$VOCAGNO_CACHE/file-sha256`` (default ``~/.cache/vocagno``)."""
    return Path(os.environ.get("VOCAGNO_CACHE", Path.home() / ".cache" / "vocagno")) / "file-sha256"


def _stat_key(path: Path) -> str:
    st = os.stat(path)
    return json.dumps([os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])


def file_sha256_cached(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, hashed once per (path, inode, size, mtime, ctime) (module docstring)."""
    path = Path(path)
    key = _stat_key(path)
    entry = digest_cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.json"
    try:
        cached = json.loads(entry.read_text())
        if cached.get("key") == key:
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # not cached yet, or an unreadable entry: hash the file
    started = time.time_ns()
    digest = file_sha256(path)
    st = os.stat(path)
    settled = max(st.st_mtime_ns, st.st_ctime_ns) < started - int(RACY_SECONDS * 1e9)
    if settled and _stat_key(path) == key:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(entry, {"key": key, "sha256": digest})
        except OSError as exc:  # a read-only home: correct, only slower next time
            log.debug("cannot cache the digest of %s: %s", path, exc)
    return digest


def files_sha256(paths: Sequence[str | os.PathLike]) -> list[str]:
    """:func:`file_sha256_cached` of several files, a few at a time (hashing releases the GIL)."""
    if len(paths) <= 1:
        return [file_sha256_cached(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(4, len(paths))) as pool:
        return list(pool.map(file_sha256_cached, paths))


def digest_files(paths: Sequence[str | os.PathLike]) -> str:
    """One sha256 over the sorted names of ``paths`` and their content digests."""
    paths = sorted(Path(p) for p in paths)
    h = hashlib.sha256()
    for p, digest in zip(paths, files_sha256(paths)):
        h.update(f"{p.name}\0{digest}\n".encode())
    return h.hexdigest()


def is_local_model(model: str) -> bool:
    """True when ``model`` names an existing local folder or file (as ``from_pretrained`` decides)."""
    return os.path.exists(os.path.expanduser(model))


def model_identity(model: str, revision: str | None = None) -> dict:
    """What a model is: for a local folder, the digests of its config (and code) and of its
    weights; for a local file, its digest; otherwise the hub id and revision."""
    path = Path(os.path.expanduser(model))
    if path.is_file():
        return {"source": "local", "model": None, "revision": None, "files_sha256": digest_files([path])}
    if not path.is_dir():
        return {"source": "hub", "model": model, "revision": revision}
    config = path / "config.json"
    if not config.is_file():
        raise MissingPathError(f"{path}: no config.json; not a Hugging Face model folder")
    weights = [p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if not weights:
        raise MissingPathError(f"{path}: no weight files (*.safetensors, *.bin)")
    code = [p for p in path.iterdir() if p.suffix == ".py" and p.is_file()]
    identity = {"source": "local", "model": None, "revision": None,
                "config_sha256": digest_files([config, *code]), "weights_sha256": digest_files(weights)}
    converted = path / "converted_from.json"
    if converted.is_file():  # a folder written from a GGUF checkpoint (pipeline.folders.model_source.convert_gguf)
        facts = json.loads(converted.read_text())
        if "gguf_sha256" in facts:
            identity["converted_from"] = {k: facts.get(k) for k in ("gguf_file", "gguf_sha256", "tensor_types")}
    return identity

def code_version() -> str:
    """The package version, plus the git commit when running from a checkout."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{__version__}+g{commit}" if commit else __version__
