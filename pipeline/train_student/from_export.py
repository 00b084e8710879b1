"""Training on ``make export-student``'s rows (``data.export``) instead of tokenizing and aligning
the scored folders again (docs/export.md, "Training from an export").

A packed export's row ``k`` is stage 2's sample ``k`` (``stream[kL : kL + L + 1]`` with each
token's teacher loss), so :class:`ExportDataset` hands the trainer exactly the batches the scored
folders would give: the same tensors, made by the same code (:meth:`PackedDataset._sample`), with
``mapped`` where the teacher loss is not NaN, as the alignment defines it.

That holds only for an export made with the run's settings, so :func:`open_export_data` first
compares what the export's identity records with what the run would compute (:func:`setting_differences`):
the student tokenizer (by sha256), ``student.seq_len``, the order and packing (``data.seed``,
``shuffle``, ``epochs``, ``add_bos``, ``add_eos``), each teacher's alignment (``loss.alignment``,
``aggregate``, ``n_chunks``, resolved as stage 2 resolves them), the combination of several
teachers, ``data.held_out_shards``, and, when ``data.folders`` are given, the teachers and scored
shards themselves (by identity and sha256) and the shards held out. Any difference refuses the export, naming each one. The export must be
complete and packed; its shards are checked against the manifest (size, or sha256 with
``data.verify=sha256``) before training, and each row's ``sample_index`` when it is read.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pyarrow.parquet as pq
import torch

from pipeline.runtime.config import UserError
from pipeline.folders.export_folder import EXPORT_VERSION, EXPORT_VERSION_KEY, teacher_loss_column
from pipeline.student_data.held_out_shards import held_out_record, hold_out
from pipeline.student_data.several_teachers import open_teachers, unique_names
from pipeline.student_data.build import teacher_identity
from pipeline.student_data.dataset import PackedDataset, Window
from pipeline.student_data.packing import document_tokens
from pipeline.student_data.settings import AlignmentConfig, StudentDataError, resolve_alignment
from pipeline.method.tokenization import bos_token_id, fingerprint
from storage_schemas import MANIFEST_NAME
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ScoredDataset

log = logging.getLogger(__name__)


class ExportMismatchError(UserError, ValueError):
    """The export was made with other settings than the run's, or is not one stage 2 can train on."""


# --------------------------------------------------------------------------------------------
# The dataset


@dataclass(frozen=True)
class ExportPlan:
    """What the trainer and a mixture read of a plan, from the export's packing record."""

    seq_len: int
    n_samples: int
    n_tokens: int
    epochs: int
    record: dict = field(default_factory=dict)  # the export's packing summary (documents, BOS/EOS, ...)

    def summary(self) -> dict:
        return {k: v for k, v in self.record.items() if k not in ("layout", "seed", "shuffle", "epochs")}


@dataclass(frozen=True)
class ExportShard:
    path: object  # a Path, or a URI string on an object store
    first_row: int
    rows: int


@dataclass(frozen=True)
class ExportTeachers:
    """What the trainer's per-teacher metrics need of several teachers (as :class:`TeacherSources` gives)."""

    names: tuple[str, ...]
    combine: str
    weights: tuple[float, ...] | None


class ExportDataset(torch.utils.data.Dataset):
    """The export's packed rows as training samples, by number (module docstring). Picklable; each
    data-loader worker keeps its own few decoded row groups."""

    def __init__(self, shards: Sequence[ExportShard], plan: ExportPlan, teachers: ExportTeachers | None,
                 cache_row_groups: int = 4):
        self.shards = list(shards)
        self.plan = plan
        self.teachers = teachers
        self.end = plan.n_samples
        self.cache_row_groups = cache_row_groups
        self._starts = np.asarray([s.first_row for s in self.shards], dtype=np.int64)
        self._groups: dict[int, np.ndarray] = {}  # shard -> first row of each row group
        self._cache: OrderedDict[tuple[int, int], dict] = OrderedDict()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_groups": {}, "_cache": OrderedDict()}

    def __len__(self) -> int:
        return self.plan.n_samples

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([k])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        return [PackedDataset._sample(self.window(int(k))) for k in indices]

    def window(self, k: int) -> Window:
        """Row ``k`` as the stream window stage 2 would have cut (its tokens and their teacher losses)."""
        if not 0 <= k < len(self):
            raise IndexError(f"sample {k} outside 0..{len(self) - 1}")
        s = int(np.searchsorted(self._starts, k, side="right")) - 1
        row = k - int(self._starts[s])
        starts = self._group_starts(s)
        g = int(np.searchsorted(starts, row, side="right")) - 1
        group, r = self._group(s, g), row - int(starts[g])
        if int(group["sample_index"][r]) != k:
            raise StudentDataError(f"{self.shards[s].path} row {row}: holds sample {int(group['sample_index'][r])}, "
                                   f"the manifest places sample {k} there; export it again")
        losses = group["teacher_loss"][r]
        each = group["teacher_losses"][r] if group["teacher_losses"] is not None else None
        return Window(index=k, ids=group["input_ids"][r], teacher_loss=losses, mapped=~np.isnan(losses),
                      teacher_losses=each, documents=[])

    def _group_starts(self, s: int) -> np.ndarray:
        if s not in self._groups:
            meta = pq.ParquetFile(self.shards[s].path).metadata
            rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self._groups[s] = np.cumsum([0, *rows[:-1]]).astype(np.int64)
        return self._groups[s]

    def _group(self, s: int, g: int) -> dict:
        key = (s, g)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        shard = self.shards[s]
        n_teachers = len(self.teachers.names) if self.teachers is not None else 0
        columns = ["sample_index", "input_ids", "teacher_loss", *map(teacher_loss_column, range(n_teachers))]
        try:
            table = pq.ParquetFile(shard.path).read_row_group(g, columns=columns)
        except Exception as exc:
            raise StudentDataError(f"{shard.path}: row group {g} cannot be read ({type(exc).__name__}: {exc}); "
                                   "export it again") from exc
        width = self.plan.seq_len + 1

        def matrix(name: str, dtype) -> np.ndarray:
            column = table.column(name).combine_chunks()
            values = column.flatten().to_numpy(zero_copy_only=False)
            if values.size != len(table) * width:
                raise StudentDataError(f"{shard.path}: row group {g}: {name} rows are not {width} long "
                                       f"(student.seq_len {self.plan.seq_len} + 1); export it again")
            return values.reshape(len(table), width).astype(dtype, copy=False)

        teacher_losses = np.stack([matrix(teacher_loss_column(t), np.float32) for t in range(n_teachers)], axis=2) \
            if n_teachers else None  # (R, L+1, T)
        decoded = {"sample_index": table.column("sample_index").to_numpy(), "input_ids": matrix("input_ids", np.int64),
                   "teacher_loss": matrix("teacher_loss", np.float32), "teacher_losses": teacher_losses}
        self._cache[key] = decoded
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return decoded


# --------------------------------------------------------------------------------------------
# Opening and checking an export


def read_export_manifest(folder) -> dict:
    """The export's manifest; a folder that holds no complete packed export is refused."""
    path = sfs.child(sfs.location(folder), MANIFEST_NAME)
    if not sfs.is_file(path):
        raise ExportMismatchError(f"data.export: {folder} holds no {MANIFEST_NAME}; it is not a make export-student "
                                  "folder (or the export has not started)")
    manifest = json.loads(sfs.read_bytes(path))
    version = manifest.get(EXPORT_VERSION_KEY) if isinstance(manifest, dict) else None
    if version is None:
        raise ExportMismatchError(f"data.export: {folder} holds another kind of output (its {MANIFEST_NAME} is not "
                                  "an export's); point data.export at a make export-student folder")
    if version != EXPORT_VERSION:
        raise ExportMismatchError(f"data.export: {folder} holds export version {version}, this code reads "
                                  f"{EXPORT_VERSION}; export it again")
    if not manifest.get("complete"):
        done, planned = len(manifest.get("shards", [])), manifest.get("n_shards_planned")
        raise ExportMismatchError(f"data.export: {folder} is incomplete ({done} of {planned} shards); run the same "
                                  "make export-student command again to finish it")
    layout = (manifest["identity"].get("packing") or {}).get("layout")
    if layout != "packed":
        raise ExportMismatchError(f"data.export: {folder} holds one row per document (export.layout={layout}); "
                                  "training needs the packed samples: export with export.layout=packed")
    return manifest


def export_shards(folder, manifest: dict, verify: str) -> list[ExportShard]:
    """The export's Parquet shards in order, each checked against its manifest entry (size, or
    sha256 with ``verify="sha256"``); every damaged or missing file is named."""
    root = sfs.location(folder)
    shards, bad = [], []
    for entry in manifest["shards"]:
        path = sfs.child(root, entry["file"])
        size = sfs.size(path)
        if size is None:
            bad.append(f"{path}: missing")
        elif size != entry.get("bytes"):
            bad.append(f"{path}: {size} bytes, the manifest records {entry.get('bytes')}")
        elif verify == "sha256" and sfs.sha256(path) != entry.get("sha256"):
            bad.append(f"{path}: its sha256 is not the manifest's")
        shards.append(ExportShard(path=path, first_row=int(entry["first_row"]), rows=int(entry["rows"])))
    if bad:
        raise StudentDataError("data.export: damaged export shard(s), export them again (make export-student "
                               "redoes a shard whose file changed):\n" + "\n".join(bad))
    return shards


def setting_differences(identity: dict, tokenizer, seq_len: int, data, alignment: AlignmentConfig) -> list[str]:
    """What differs between the export's ``identity`` and what this run (student tokenizer,
    ``seq_len``, ``data`` settings, ``alignment``) would train on, one line each, named by setting."""
    packing, teachers = identity.get("packing") or {}, identity.get("teachers") or []
    add_bos = data.add_bos if data.add_bos is not None else bos_token_id(tokenizer) is not None
    found = []

    def differ(setting: str, exported, run) -> None:
        if exported != run:
            found.append(f"{setting}: the export has {exported!r}, this run {run!r}")

    differ("student tokenizer (sha256)", (identity.get("student") or {}).get("tokenizer_sha256"), fingerprint(tokenizer))
    differ("student.seq_len", packing.get("seq_len"), seq_len)
    for key, run in (("seed", data.seed), ("shuffle", data.shuffle), ("epochs", data.epochs), ("add_bos", add_bos),
                     ("add_eos", data.add_eos)):
        differ(f"data.{key}", packing.get(key), run)
    for i, teacher in enumerate(teachers):
        resolved = resolve_alignment(alignment, tokenizer, ((teacher.get("folders") or [{}])[0]).get("identity") or {})
        where = f" (teacher {i})" if len(teachers) > 1 else ""
        exported = teacher.get("alignment") or {}
        for key, name in (("method", "loss.alignment"), ("aggregate", "loss.aggregate"), ("n_chunks", "loss.n_chunks")):
            differ(name + where, exported.get(key), getattr(resolved, key))
    if len(teachers) > 1:
        combine = identity.get("combine") or {}
        weights = list(alignment.teacher_weights) if alignment.combine == "weighted" else None
        differ("loss.combine", combine.get("how"), alignment.combine)
        differ("loss.teacher_weights", combine.get("weights"), weights)
        differ("data.missing_documents", combine.get("missing_documents"), data.missing_documents)
    differ("data.held_out_shards", identity.get("held_out_shards", 0), data.held_out_shards)
    if data.folders:
        found += teacher_differences(teachers, data)
        if data.held_out_shards and identity.get("held_out_shards") == data.held_out_shards:
            held = held_out_record(ScoredDataset.open(data.folders[0]).folders[0], data.held_out_shards)
            if identity.get("shards_held_out") != held:
                found.append("data.held_out_shards: the shards the export held out are not those of data.folders' "
                             "first folder (the scoring changed since the export, or another corpus)")
    return found


def teacher_differences(exported: list[dict], data) -> list[str]:
    """How the teachers and scored shards the export was made from differ from ``data.folders``'."""
    opened = hold_out(open_teachers(data.folders, on_bad_shard=data.on_bad_shard, verify=data.verify,
                                    allow_partial=data.allow_partial), data.held_out_shards)
    names = [[str(((t.get("teacher") or {}).get("teacher") or {}).get("name", "?")) for t in exported],
             [str((d.teacher.get("teacher") or {}).get("name", "?")) for d in opened]]
    if len(opened) != len(exported) or names[0] != names[1]:
        return [f"teacher: the export was made from the scored data of {', '.join(names[0]) or 'no teacher'}, "
                f"data.folders hold {', '.join(names[1])}"]
    found = []
    for i, (mine, theirs) in enumerate(zip(exported, opened)):
        now = teacher_identity(theirs, AlignmentConfig())
        for key, what in (("teacher", "its settings"), ("folders", "its scored folders' identity"),
                          ("shards_used", "the scored shards (sha256)")):
            if json.loads(json.dumps(now[key])) != mine.get(key):
                found.append(f"teacher {names[0][i]}: {what} differ between the export and data.folders "
                             "(the scoring changed since the export, or another corpus)")
    return found


@dataclass
class ExportData:
    """A run's data from an export: what :class:`pipeline.student_data.build.StudentData` gives a run."""

    dataset: ExportDataset
    folder: str
    identity_record: dict  # the export's identity
    alignment: AlignmentConfig  # the first teacher's, as exported
    scored = None  # no scored folder is read (the held-out text of data.held_out_shards is read from data.folders)

    @property
    def plan(self) -> ExportPlan:
        return self.dataset.plan

    def identity(self, tokenizer_sha256: str, packing) -> dict:
        """The run's data identity: what the export holds (its scored data, student tokenizer,
        alignment, combination, packing and rows), never where it is or in which formats."""
        keep = ["teachers", "combine", "student", "packing", "rows"]
        keep += [k for k in ("held_out_shards", "shards_held_out") if k in self.identity_record]  # only if held out
        return {"export": {k: self.identity_record.get(k) for k in keep}}

    def teacher_keys(self) -> list:
        return [t.get("teacher") for t in self.identity_record.get("teachers") or []]

    def summary(self) -> dict:
        first = (self.identity_record.get("teachers") or [{}])[0]
        return {**self.plan.summary(), "student_tokens": document_tokens(self.plan.record, self.plan.epochs),
                "alignment": self.alignment.method, "aggregate": self.alignment.aggregate,
                "shards_used": len(first.get("shards_used") or []),
                "shards_skipped": [{"file": f} for f in first.get("shards_skipped") or []],
                "teacher": ((first.get("teacher") or {}).get("teacher") or {}).get("name"), "export": self.folder,
                **({"teachers": list(self.dataset.teachers.names), "combine": self.dataset.teachers.combine}
                   if self.dataset.teachers is not None else {})}


def open_export_data(folder: str, tokenizer, seq_len: int, data, alignment: AlignmentConfig) -> ExportData:
    """The export at ``folder`` as a run's data, after every check of the module docstring."""
    manifest = read_export_manifest(folder)
    identity = manifest["identity"]
    differences = setting_differences(identity, tokenizer, seq_len, data, alignment)
    if differences:
        raise ExportMismatchError(f"data.export: {folder} was exported with other settings than this run's:\n  "
                                  + "\n  ".join(differences) + "\nExport with the run's settings (make export-student "
                                  "with the same student, data and loss settings), or train from data.folders.")
    shards = export_shards(folder, manifest, data.verify)
    packing = identity["packing"]
    plan = ExportPlan(seq_len=int(packing["seq_len"]), n_samples=int(identity["rows"]), n_tokens=int(packing["n_tokens"]),
                      epochs=int(packing["epochs"]), record=dict(packing))
    teachers = identity["teachers"]
    several = None
    if len(teachers) > 1:
        combine = identity["combine"]
        names = unique_names([str(((t.get("teacher") or {}).get("teacher") or {}).get("name", "?")) for t in teachers])
        several = ExportTeachers(names=tuple(names), combine=combine["how"],
                                 weights=tuple(combine["weights"]) if combine.get("weights") else None)
    first = teachers[0]["alignment"]
    exported = AlignmentConfig(method=first["method"], aggregate=first["aggregate"], n_chunks=first["n_chunks"])
    log.info("training on the export %s: %d samples of %d tokens (nothing tokenized or aligned)", folder,
             plan.n_samples, plan.seq_len)
    return ExportData(ExportDataset(shards, plan, several), str(folder), identity, exported)

