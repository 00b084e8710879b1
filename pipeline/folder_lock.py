"""One writer per output folder: the lock a scoring job holds on its dataset folder and a training
run on its run folder, so that two launches never interleave their files (docs/METHOD.md §1.5, §2.5)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from pipeline.config import UserError

LOCK_NAME = ".lock"


class DatasetBusyError(UserError, RuntimeError):
    """Another job is writing the same folder (a scored dataset or a training run)."""


@contextlib.contextmanager
def exclusive_writer(folder: str | os.PathLike, what: str = "scoring job"):
    """Hold an exclusive lock on ``folder`` (created if missing) for one job's lifetime; ``what``
    names the kind of job in the refusal (``another scoring job is writing ...``).

    ``flock`` is released by the kernel when the holder dies, even on SIGKILL, so a crashed job
    never blocks the rerun. (On network filesystems without ``flock`` support the lock may be
    advisory only: do not point two jobs at one folder there.)
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            raise DatasetBusyError(f"{folder}: another {what} is writing this folder ({holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
