"""Two rules for every folder a command writes, so that no mistake loses a user's work.

* **Apart from the inputs.** An output folder that is, holds, or lies inside one of the run's
  inputs (a model, a scored folder, an export, a checkpoint) is refused, whatever ``overwrite``
  says (:func:`overlap_problem`): replacing the folder would delete what the run reads.
* **Replaced only once the new run has started.** ``overwrite=true`` deletes nothing up front. The
  old contents are moved aside into a hidden folder inside the output folder (a rename: instant,
  on the same file system) and deleted only when the new run has something of its own: stage 1's
  or the export's first finished shard, stage 2's first complete checkpoint or its final model
  (:meth:`SetAside.commit`). A failure before that puts them back (:meth:`SetAside.restore`). A
  process killed before that leaves them aside; the next command in the folder puts them back
  before it looks at the folder (:func:`recover`).

The aside folder's name says how far a step got, so that a kill at any moment loses nothing:
``.replacing-<id>`` while entries are being moved in (nothing new written yet), ``.replaced-<id>``
once all are in, ``.restoring-<id>`` once the new entries are deleted and the old ones are being
moved back, ``.deleting-<id>`` once committed. Object stores have no rename; there the old shards
are deleted when every check has passed and every input is read (docs/RELIABILITY.md).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from pipeline.runtime.config import UserError, raise_if
from pipeline.folders.folder_lock import LOCK_NAME
from storage_schemas import filesystem as sfs

log = logging.getLogger(__name__)

REPLACING, REPLACED, RESTORING, DELETING = ".replacing-", ".replaced-", ".restoring-", ".deleting-"
ASIDE_PREFIXES = (REPLACING, REPLACED, RESTORING, DELETING)
Owned = Callable[[Path], bool]  # which entries of the folder belong to the output being replaced


def is_aside(name: str) -> bool:
    return name.startswith(ASIDE_PREFIXES)


# ---------------------------------------------------------------------------------------------
# Apart from the inputs


def _location(path: str | os.PathLike) -> str:
    """A comparable form: local paths resolved (``~``, links, ``..``), URIs without a trailing ``/``."""
    text = os.fspath(path)
    if sfs.is_remote(text):
        return text.rstrip("/")
    return os.path.realpath(os.path.expanduser(text))


def _inside(child: str, parent: str) -> bool:
    sep = "/" if sfs.is_remote(parent) else os.sep
    return child.startswith(parent.rstrip(sep) + sep)


Inputs = Mapping[str, "str | os.PathLike | None"] | Iterable[tuple[str, "str | os.PathLike | None"]]


def overlap_problem(output: str | os.PathLike, inputs: Inputs, *, setting: str = "output_dir",
                    inside_ok: bool = False) -> str | None:
    """Why ``output`` may not be written: it is one of ``inputs`` (setting name -> path, a mapping
    or pairs; None and hub ids that are not local paths are passed over), holds one, or lies inside
    one (unless ``inside_ok``). None: it is apart from them."""
    out = _location(output)
    for name, value in (inputs.items() if isinstance(inputs, Mapping) else inputs):
        if not value:
            continue
        text = os.fspath(value)
        if not sfs.is_remote(text) and not os.path.exists(os.path.expanduser(text)):
            continue  # a hub id, or a path another check reports
        where = _location(text)
        if where == out:
            how = "is"
        elif _inside(where, out):
            how = "holds"
        elif _inside(out, where) and not inside_ok:
            how = "lies inside"
        else:
            continue
        return f"{setting} {output} {how} {name} ({text}), an input of this run"
    return None


# ---------------------------------------------------------------------------------------------
# Replaced only once the new run has started


@dataclass
class SetAside:
    """The old contents of ``folder``, moved into ``aside`` (None: there were none)."""

    folder: Path
    owned: Owned
    aside: Path | None = None
    names: list[str] = field(default_factory=list)

    def commit(self) -> None:
        """The new run has started well: delete the old contents."""
        if self.aside is None:
            return
        doomed = self.aside.with_name(DELETING + self.aside.name[len(REPLACED):])
        os.replace(self.aside, doomed)
        self.aside = None
        shutil.rmtree(doomed)
        log.info("deleted the previous contents of %s (%s)", self.folder, describe(self.names))

    def restore(self) -> None:
        """The new run failed before it started well: delete what it wrote, put the old back."""
        if self.aside is None:
            return
        _put_back(self.folder, self.aside, self.owned)
        self.aside = None
        log.warning("put back the previous contents of %s (%s)", self.folder, describe(self.names))


def describe(names: Iterable[str], most: int = 6) -> str:
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def owned_entries(folder: Path, owned: Owned) -> list[Path]:
    """The entries of ``folder`` that belong to the output (never the lock or an aside folder)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name != LOCK_NAME and not is_aside(p.name) and owned(p))


def has_aside(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds contents set aside by an overwrite (stopped, or still running): it
    is judged only after :func:`recover`, under its lock."""
    folder = Path(folder) if not sfs.is_remote(folder) else None
    return folder is not None and folder.is_dir() and any(is_aside(p.name) for p in folder.iterdir())


def set_aside(folder: str | os.PathLike, owned: Owned) -> SetAside:
    """Move the entries of ``folder`` that ``owned`` names into a hidden folder inside it."""
    folder = Path(folder)
    entries = owned_entries(folder, owned)
    if not entries:
        return SetAside(folder, owned)
    tag = uuid.uuid4().hex[:12]
    moving = folder / f"{REPLACING}{tag}"
    moving.mkdir()
    for path in entries:
        os.replace(path, moving / path.name)
    aside = folder / f"{REPLACED}{tag}"
    os.replace(moving, aside)
    return SetAside(folder, owned, aside, [p.name for p in entries])


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _put_back(folder: Path, aside: Path, owned: Owned) -> None:
    """Delete the new run's entries, then move the old ones back (a kill in between is finished
    by :func:`recover`: the folder's name says which step it reached)."""
    if aside.name.startswith(REPLACED):
        for path in owned_entries(folder, owned):
            _remove(path)
        restoring = aside.with_name(RESTORING + aside.name[len(REPLACED):])
        os.replace(aside, restoring)
        aside = restoring
    for path in sorted(aside.iterdir()):
        os.replace(path, folder / path.name)
    aside.rmdir()


def recover(folder: str | os.PathLike, owned: Owned) -> list[str]:
    """Finish what a killed process left: put back contents an ``overwrite`` set aside before its
    run started well, and finish deleting those it had begun to delete. Call it holding the
    folder's lock, before looking at the folder. Returns the names put back."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    restored: list[str] = []
    for aside in sorted(p for p in folder.iterdir() if p.is_dir() and is_aside(p.name)):
        if aside.name.startswith(DELETING):
            shutil.rmtree(aside)
            continue
        names = [p.name for p in aside.iterdir()]
        _put_back(folder, aside, owned)
        restored += names
    if restored:
        log.warning("%s: put back its previous contents (%s), set aside by an overwrite that was stopped before "
                    "its run started", folder, describe(restored))
    return restored


# ---------------------------------------------------------------------------------------------
# A folder that cannot be made or written


def unwritable_problem(path: str | os.PathLike | None, setting: str = "output_dir") -> str | None:
    """Why no folder can be made, or written in, at ``path`` (``setting`` names it in the line),
    found before any work: a file is there or on its way (``/x/notes.txt/out``), or the file system
    refuses (``/proc/out``, a read-only or forbidden folder). None: it can, or ``path`` is empty or
    on an object store. Nothing is left behind: the folder that would be made first is made and
    removed again, or, where the folder exists, a hidden file is made in it and removed."""
    if not path or sfs.is_remote(os.fspath(path)):
        return None
    target = Path(os.path.expanduser(os.fspath(path))).absolute()
    where = f"{setting} {os.fspath(path)}"
    try:
        present = target
        while not present.exists() and not present.is_symlink() and present != present.parent:
            present = present.parent
        if not present.is_dir():
            what = "is a file, not a folder" if present.is_file() else "is not a folder"
            if present == target:
                return f"{where}: {what}; choose another {setting}"
            return f"{where}: cannot be made, {present} {what}; choose another {setting}"
        if present == target:
            with tempfile.NamedTemporaryFile(dir=target, prefix=".write-check-"):
                pass
        else:
            first = target
            while first.parent != present:
                first = first.parent
            first.mkdir()
            first.rmdir()
    except OSError as exc:
        why = exc.strerror or str(exc)
        if present == target:
            return f"{where}: no file can be written in it ({why}); choose another {setting}"
        return f"{where}: cannot be made ({why}: {exc.filename or present}); choose another {setting}"
    return None


def check_writable(paths: Mapping[str, "str | os.PathLike | None"]) -> None:
    """Raise :class:`pipeline.runtime.config.ConfigError` (one line each, exit status 2 in an entry
    point) for every ``setting -> path`` of ``paths`` where no folder can be made or written
    (:func:`unwritable_problem`); call it before any work, with every folder the command writes."""
    raise_if([p for setting, path in paths.items() if (p := unwritable_problem(path, setting))])


# ---------------------------------------------------------------------------------------------
# A folder that cannot be written


class StorageError(UserError, OSError):
    """A file system refused a write or a read: full, read-only, or not permitted. The message is
    one line: what, where, and what to do."""

    def __str__(self) -> str:
        return str(self.strerror)


STORAGE_ADVICE = {
    errno.ENOSPC: "the disk is full: free space there, or write the output elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space there, or write the output elsewhere",
    errno.EROFS: "the file system is read-only: write the output elsewhere (output_dir=<a writable folder>)",
    errno.EACCES: "permission denied: make it readable and writable for this user, or use another folder",
    errno.EPERM: "operation not permitted: make it writable for this user, or use another folder",
}


def storage_error(exc: BaseException, where: str = "") -> StorageError | None:
    """``exc`` as one line if it is a file system's refusal (:data:`STORAGE_ADVICE`), else None.
    ``where`` says what was being done. What finished before is kept and marked complete, and
    nothing half-written is, so the same command resumes once the cause is fixed."""
    if not isinstance(exc, OSError) or exc.errno not in STORAGE_ADVICE:
        return None
    path = exc.filename if exc.filename is not None else None
    what = os.strerror(exc.errno)
    text = f"{where + ': ' if where else ''}{what}{f' ({path})' if path else ''}; {STORAGE_ADVICE[exc.errno]}; "
    return StorageError(exc.errno, text + "what finished is kept, and the same command resumes")
