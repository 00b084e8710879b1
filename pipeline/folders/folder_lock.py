"""One writer per output folder: the lock a scoring job holds on its dataset folder and a training
run on its run folder, so that two launches never interleave their files (docs/METHOD.md §1.5, §2.5).

A local folder is locked with ``flock``. An object store has no lock primitive that pyarrow
exposes, so there the lock is a documented best effort (:func:`_object_store_lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import psutil

from pipeline.runtime.config import UserError
from storage_schemas import filesystem as sfs

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
HEARTBEAT_S = 10.0  # how often the holder of an object-store lock rewrites it
STALE_AFTER_S = 60.0  # a lock object whose heartbeat is older than this is taken over
SETTLE_S = 1.0  # wait before reading a freshly written lock object back


class DatasetBusyError(UserError, RuntimeError):
    """Another job is writing the same folder (a scored dataset or a training run)."""


@contextlib.contextmanager
def exclusive_writer(folder: str | os.PathLike, what: str = "scoring job", *, heartbeat_s: float = HEARTBEAT_S,
                     stale_after_s: float = STALE_AFTER_S, settle_s: float = SETTLE_S):
    """Hold an exclusive lock on ``folder`` (created if missing) for one job's lifetime; ``what``
    names the kind of job in the refusal (``another scoring job is writing ...``).

    ``flock`` is released by the kernel when the holder dies, even on SIGKILL, so a crashed job
    never blocks the rerun. (On network filesystems without ``flock`` support the lock may be
    advisory only: do not point two jobs at one folder there.) On an object store the timing
    arguments tune :func:`_object_store_lock`.
    """
    if sfs.is_remote(folder):
        with _object_store_lock(os.fspath(folder), what, heartbeat_s, stale_after_s, settle_s):
            yield
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = _locked_fd(path, folder, what)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # removed while still held: the folder is left as the job found it
        os.close(fd)


def _locked_fd(path: Path, folder: Path, what: str) -> int:
    """A descriptor of ``path`` holding its ``flock``. The holder removes the file when it is done,
    so a lock won on a file that was removed meanwhile is not the folder's lock: try again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DatasetBusyError(f"{folder}: another {what} is writing this folder ({holder})") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Object stores: a lock object with a heartbeat (best effort, not atomic)


@contextlib.contextmanager
def _object_store_lock(folder: str, what: str, heartbeat_s: float, stale_after_s: float, settle_s: float):
    """A lock object ``<folder>/.lock`` naming its holder (host, pid, a random token) and the time
    of its last heartbeat, rewritten every ``heartbeat_s`` while the job runs and deleted at the end.

    A fresh lock refuses the job. A lock is stale, and taken over, when its heartbeat is older than
    ``stale_after_s``, or at once when its holder ran on this machine and that process is gone (a
    killed driver rerun on the same machine). Taking the lock is *not atomic*: the job writes its
    lock object, waits ``settle_s`` and reads it back, and gives way if another job's lock replaced
    it; two jobs that start within one request's time of each other can still both go on. The
    commit protocol keeps the dataset readable even then (two attempts at a shard hold the same
    rows), but do not launch two jobs on one dataset on purpose.
    """
    where = sfs.child(folder, LOCK_NAME)
    holder = _read_lock(where)
    if holder is not None and not _is_stale(holder, stale_after_s):
        raise DatasetBusyError(f"{folder}: another {what} is writing this folder ({_describe(holder)})")
    me = _holder()
    _write_lock(where, me)
    time.sleep(settle_s)
    now = _read_lock(where)
    if now is None or now.get("token") != me["token"]:
        raise DatasetBusyError(f"{folder}: another {what} took this folder at the same moment "
                               f"({_describe(now) if now else 'lock object gone'})")
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(where, me, heartbeat_s, stop), daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        now = _read_lock(where)
        if now is not None and now.get("token") == me["token"]:
            sfs.delete(where)


def _holder() -> dict:
    return {"token": uuid.uuid4().hex, "host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
            "started": _process_start(os.getpid()), "heartbeat": time.time()}


def _heartbeat(where: str, me: dict, every_s: float, stop: threading.Event) -> None:
    while not stop.wait(every_s):
        try:
            now = _read_lock(where)
            if now is not None and now.get("token") != me["token"]:
                log.warning("%s: the lock was taken over by %s while this job runs", where, _describe(now))
                return
            _write_lock(where, {**me, "heartbeat": time.time()})
        except OSError as exc:  # a transient store error: the next beat tries again
            log.warning("%s: heartbeat failed: %s", where, exc)


def _read_lock(where: str) -> dict | None:
    try:
        holder = json.loads(sfs.read_bytes(where))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: stale unless its heartbeat says otherwise, which it cannot
    return holder if isinstance(holder, dict) else {}


def _write_lock(where: str, holder: dict) -> None:
    sfs.write_bytes(where, json.dumps(holder, sort_keys=True).encode())


def _is_stale(holder: dict, stale_after_s: float) -> bool:
    beat = holder.get("heartbeat")
    if not isinstance(beat, (int, float)) or time.time() - beat > stale_after_s:
        return True
    if holder.get("host") == socket.gethostname() and holder.get("boot_id") == _boot_id():
        pid = holder.get("pid")
        return not isinstance(pid, int) or _process_start(pid) != holder.get("started")
    return False


def _describe(holder: dict) -> str:
    beat = holder.get("heartbeat")
    age = f", heartbeat {time.time() - beat:.0f} s ago" if isinstance(beat, (int, float)) else ""
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}{age}"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (``None``: no such process); a reused pid starts later."""

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None
