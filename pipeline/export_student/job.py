"""The export as a library call: :func:`run_export` reads as its steps.

1. Load the student's tokenizer (a fast one: offsets are the alignment) and check ``seq_len``
   against the student's positions; open and validate the scored folders, one group per teacher.
2. Count the student tokens and plan the stream (:func:`pipeline.student_data.build.build_student_data`,
   the length cache shared with stage 2): the rows, and so every shard, are a function of the
   inputs and the settings. The identity (:func:`export_identity`) says which.
3. Take the output folder (its lock; refuse another kind of folder, or another identity), then
   write each shard not yet marked done: its rows read, tokenized, aligned and combined a batch at
   a time (:class:`pipeline.export_student.rows.RowSource`), its files in every format written
   whole, then its marker (:mod:`pipeline.folders.shard_folder`). The manifest follows the markers.
4. When every shard is done: litdata's index, the manifest (complete) and the card.

Everything that can fail on bad input fails before the output folder is touched.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from pipeline.runtime.config import UserError
from pipeline.folders.dataset_card import manifest_terms, shared_terms
from pipeline.export_student.card import write_card
from pipeline.export_student.config import ExportJobConfig
from pipeline.export_student.formats import LITDATA_INDEX, LITDATA_SUFFIX, shard_parts, write_litdata_index
from pipeline.export_student.rows import Row, RowSource, row_schema, rows_table
from pipeline.folders.export_folder import EXPORT_VERSION, EXPORT_VERSION_KEY
from pipeline.folders.folder_lock import exclusive_writer
from pipeline.student_data.held_out_shards import held_out_record, hold_out
from pipeline.folders.model_source import model_positions, refuse_seq_len
from pipeline.folders.output_folder import has_aside, overlap_problem
from pipeline.folders.provenance import code_version
from pipeline.folders.rehearsal import refuse_rehearsal, warn_rehearsal
from pipeline.student_data.several_teachers import open_teachers, teacher_names
from pipeline.folders.shard_folder import (
    DatasetMismatchError,
    FolderKind,
    ShardProgress,
    finished_shards,
    manifest_of,
    prepare_folder,
    refuse_mismatch,
    remove_unreferenced,
    write_marker,
    write_shard_files,
)
from pipeline.student_data.build import StudentData, build_student_data, teacher_identity
from pipeline.student_data.packing import document_tokens
from pipeline.student_data.settings import PackingConfig
from pipeline.method.tokenization import fingerprint, load_tokenizer, require_fast
from storage_schemas import CARD_NAME, MANIFEST_NAME, ContractError, write_json_atomic
from storage_schemas import filesystem as sfs
from storage_schemas import store_calls

log = logging.getLogger(__name__)

EXPORT = FolderKind(what="student export", version_key=EXPORT_VERSION_KEY, version=EXPORT_VERSION, verb="exported",
                    redo="export it again", derived=(MANIFEST_NAME, CARD_NAME, LITDATA_INDEX))


class NothingToExportError(UserError, ValueError):
    """The scored data gives no row with these settings."""


@dataclass
class ExportSummary:
    output_dir: str
    layout: str
    formats: list[str]
    rows: int
    shards_planned: int
    shards_done_before: int
    shards_written: int
    tokens: int  # stream tokens (BOS/EOS included) in the whole export's rows: the manifest's totals.tokens
    student_tokens: int  # the documents' own, one pass (pipeline.student_data.packing.document_tokens), as stage 2 reports
    tokens_this_run: int
    mapped_fraction: float
    bytes: dict[str, int]  # per format, whole export
    complete: bool
    seconds: float  # wall, this run, set-up included
    write_cpu_seconds: float = 0.0  # process CPU time writing this run's shards (read, align, encode, write)
    teachers: list[str] = field(default_factory=list)
    store_calls: dict = field(default_factory=dict)  # object-store requests and the client's retries (store_calls)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_this_run / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# 1-2. Inputs and plan


def load_student_tokenizer(job: ExportJobConfig):
    """The student's tokenizer; one that reports no character offsets is refused."""
    s = job.student
    tokenizer = load_tokenizer(s.tokenizer or s.model, revision=s.revision, trust_remote_code=s.trust_remote_code)
    require_fast(tokenizer, "student tokenizer")
    return tokenizer


def check_seq_len(job: ExportJobConfig) -> None:
    """Packed rows feed ``seq_len`` positions to the student: no more than it has."""
    if job.export.layout == "packed":
        s = job.student
        refuse_seq_len(s.seq_len, s.model, model_positions(s.model, s.revision, s.trust_remote_code))


def check_output_dir(job: ExportJobConfig) -> None:
    """The export never goes into, over or around what it reads: a scored folder (it would mix
    with the shards stage 2 reads), the student's model or tokenizer, whatever ``overwrite`` says."""
    s = job.student
    inputs = [*((f"data.folders[{i}]", f) for i, f in enumerate(job.data.folders)),
              ("student.model", s.model), ("student.tokenizer", s.tokenizer)]
    problem = overlap_problem(job.output_dir, inputs)
    if problem:
        raise DatasetMismatchError(f"{problem}; whatever overwrite says, write the export to a folder of its own "
                                   "(output_dir=<a new folder>)")


def prepare_data(job: ExportJobConfig, tokenizer) -> StudentData:
    d = job.data
    scored = open_teachers(d.folders, on_bad_shard=d.on_bad_shard, verify=d.verify, allow_partial=d.allow_partial)
    warn_rehearsal(refuse_rehearsal(scored, d.allow_rehearsal))
    scored = hold_out(scored, d.held_out_shards)
    packing = PackingConfig(seq_len=job.student.seq_len, seed=d.seed, shuffle=d.shuffle, epochs=d.epochs,
                            add_bos=d.add_bos, add_eos=d.add_eos)
    return build_student_data(scored, tokenizer, packing, job.alignment, cache_dir=d.cache_dir,
                              num_proc=d.length_workers, on_bad_shard=d.on_bad_shard,
                              missing_documents=d.missing_documents)


def export_terms(data: StudentData) -> dict:
    """The terms of the corpora the export was made from (their scored manifests': license, language,
    source datasets), for the card: a license only where every scored folder has the same."""
    teachers = data.teachers.datasets if data.teachers is not None else [data.scored]
    return shared_terms([manifest_terms(f.manifest) for t in teachers for f in t.folders])


def export_identity(job: ExportJobConfig, data: StudentData, tokenizer, n_rows: int) -> dict:
    """What the export is, never where things are: every teacher's scored data (identities, the
    shards used, by sha256) and resolved alignment, the combination, the student tokenizer, the
    packing and order, the shard plan and the formats. A rerun with any of these changed is refused."""
    teachers = data.teachers.datasets if data.teachers is not None else [data.scored]
    alignments = data.dataset.teachers.alignments if data.teachers is not None else (data.alignment,)
    identity = {
        "teachers": [{**teacher_identity(t, a), "shards_skipped": sorted(sfs.name(str(s.get("file", ""))) for s in t.skipped)}
                     for t, a in zip(teachers, alignments)],
        "combine": None,
        "student": {"tokenizer_sha256": fingerprint(tokenizer), "vocab_size": len(tokenizer),
                    "bos_id": tokenizer.bos_token_id, "eos_id": tokenizer.eos_token_id},
        "packing": {"layout": job.export.layout, "seed": job.data.seed, "shuffle": job.data.shuffle,
                    "epochs": job.data.epochs, **data.plan.summary()},
        "rows": n_rows,
        "rows_per_shard": job.export.rows_per_shard,
        "formats": list(job.export.formats),
        "compression": job.export.compression,
    }
    if data.teachers is not None:
        sources = data.dataset.teachers
        identity["combine"] = {"how": sources.combine, "weights": sources.weights,
                               "missing_documents": data.teachers.missing_rule}
    if job.data.held_out_shards:  # only then: an export that holds nothing out keeps its identity
        identity["held_out_shards"] = job.data.held_out_shards
        identity["shards_held_out"] = held_out_record(data.scored.folders[0], job.data.held_out_shards)
    return identity


# ---------------------------------------------------------------------------------------------
# 3. Shards


def shard_rows(index: int, rows_per_shard: int, n_rows: int) -> range:
    return range(index * rows_per_shard, min((index + 1) * rows_per_shard, n_rows))


def shard_stats(rows: list[Row], layout: str) -> dict:
    """A shard's counts and the exact sum, min and max of its teacher losses (the card's quantiles
    are read from the shards, :func:`pipeline.export_student.card.loss_histogram`). Each token of
    the stream counts once: a packed row after the first begins with the token that ends the row
    before it, so that token is left out there."""
    shared = layout == "packed"
    losses = np.concatenate([r.teacher_loss[1:] if shared and r.index > 0 else r.teacher_loss
                             for r in rows]).astype(np.float64)
    finite = losses[np.isfinite(losses)]
    return {"tokens": int(losses.size), "mapped": int(finite.size), "loss_sum": float(finite.sum()),
            "loss_min": float(finite.min()) if finite.size else None,
            "loss_max": float(finite.max()) if finite.size else None}


def write_export_shard(job: ExportJobConfig, source: RowSource, index: int, n_rows: int, schema) -> dict:
    """Read, align and write shard ``index`` in every format, then its marker; returns the marker's entry."""
    e = job.export
    span = shard_rows(index, e.rows_per_shard, n_rows)
    rows = [row for start in range(span.start, span.stop, e.batch_rows)
            for row in source.rows(range(start, min(start + e.batch_rows, span.stop)))]
    record: dict = {}
    files = write_shard_files(job.output_dir, index, shard_parts(e.formats, rows_table(rows, schema), rows,
                                                                 e.compression, record))
    main, parts = files[0], files[1:]
    entry = {"file": main["file"], "index": index, "rows": len(rows), "first_row": span.start,
             "bytes": main["bytes"], "sha256": main["sha256"], "parts": parts, **shard_stats(rows, e.layout), **record}
    write_marker(job.output_dir, entry)
    return entry


def format_of(file: str) -> str:
    if file.endswith(".parquet"):
        return "parquet"
    return "litdata" if file.endswith(LITDATA_SUFFIX) else "megatron"


def totals_of(done: dict[int, dict]) -> dict:
    """The manifest's totals: rows, tokens, mapped tokens, the teacher losses' sum, min and max, bytes per format."""
    entries = [done[i] for i in sorted(done)]
    size: dict[str, int] = {}
    for e in entries:
        for f in [{"file": e["file"], "bytes": e["bytes"]}, *e.get("parts", [])]:
            size[format_of(f["file"])] = size.get(format_of(f["file"]), 0) + int(f["bytes"])
    lows = [e["loss_min"] for e in entries if e.get("loss_min") is not None]
    highs = [e["loss_max"] for e in entries if e.get("loss_max") is not None]
    return {"shards": len(entries), "rows": sum(e["rows"] for e in entries), "tokens": sum(e["tokens"] for e in entries),
            "mapped": sum(e["mapped"] for e in entries), "loss_sum": sum(e["loss_sum"] for e in entries),
            "loss_min": min(lows) if lows else None, "loss_max": max(highs) if highs else None,
            "bytes": size}


def write_manifest(folder, identity: dict, done: dict[int, dict], n_planned: int, about: dict) -> dict:
    """``about``: the manifest's fields that are never compared on a rerun, where the inputs were
    (``location``) and the corpus's terms (``terms``)."""
    manifest = manifest_of(EXPORT, identity, done, n_planned, totals_of(done), code_version=code_version(),
                           **about)
    write_json_atomic(sfs.child(folder, MANIFEST_NAME), manifest)
    return manifest


# ---------------------------------------------------------------------------------------------
# The run


def run_export(job: ExportJobConfig) -> ExportSummary:
    """Export (module docstring). The output folder's lock is held throughout, so a second launch
    into the same folder is refused instead of interleaving shards. A refusal is one line (the
    problems of a several-line message joined by ``; ``), of the same error class."""
    store_calls.start(own=True)  # before any S3 request: this run's counts are its own
    try:
        return _run_export(job)
    except (UserError, ContractError) as exc:
        lines = [line.strip().lstrip("- ") for line in str(exc).splitlines() if line.strip()]
        if len(lines) < 2:
            raise
        raise type(exc)("; ".join(lines)) from exc


def _run_export(job: ExportJobConfig) -> ExportSummary:
    t0 = time.perf_counter()
    check_output_dir(job)
    tokenizer = load_student_tokenizer(job)
    check_seq_len(job)
    data = prepare_data(job, tokenizer)
    source = RowSource(data, job.export.layout)
    n_rows = len(source)
    if n_rows == 0:
        raise NothingToExportError(
            f"the scored data gives no row: {data.plan.n_tokens} student tokens do not fill one packed row of "
            f"{job.student.seq_len + 1}; lower student.seq_len or use export.layout=documents")
    n_shards = math.ceil(n_rows / job.export.rows_per_shard)
    identity = export_identity(job, data, tokenizer, n_rows)
    about = {"location": {"scored_folders": [str(f) for f in job.data.folders], "student_model": job.student.model,
                          "student_tokenizer": job.student.tokenizer or job.student.model},
             "terms": export_terms(data)}
    if (sfs.is_remote(job.output_dir) or Path(job.output_dir).is_dir()) and not has_aside(job.output_dir):
        refuse_mismatch(job.output_dir, identity, EXPORT, job.overwrite)  # before creating anything there
    with exclusive_writer(job.output_dir, what="export"):
        done, aside = prepare_folder(job.output_dir, identity, job.overwrite, EXPORT)
        before = len(done)
        write_manifest(job.output_dir, identity, done, n_shards, about)
        pending = [i for i in range(n_shards) if i not in done][:job.export.limit_shards]
        cpu = time.process_time()
        try:
            written = _write_shards(job, source, pending, n_rows, identity, done, about, n_shards,
                                    row_schema(len(identity["teachers"])), on_first=aside.commit if aside else None)
        except BaseException:  # list what did finish (the markers stay the truth), then fail
            if aside is not None and aside.aside is not None:
                aside.restore()  # no shard of the new export: the old one comes back whole
            else:
                write_manifest(job.output_dir, identity, finished_shards(job.output_dir), n_shards, about)
            raise
        if aside is not None:
            aside.commit()
        cpu = time.process_time() - cpu
        done = finished_shards(job.output_dir)
        remove_unreferenced(job.output_dir, done)
        complete = len(done) == n_shards
        if complete and "litdata" in job.export.formats:
            write_litdata_index(job.output_dir, [done[i] for i in sorted(done)])
        manifest = write_manifest(job.output_dir, identity, done, n_shards, about)
        write_card(job.output_dir, manifest)
    totals = manifest["totals"]
    return ExportSummary(
        output_dir=str(job.output_dir), layout=job.export.layout, formats=list(job.export.formats), rows=n_rows,
        shards_planned=n_shards, shards_done_before=before, shards_written=len(written), tokens=totals["tokens"],
        student_tokens=document_tokens(identity["packing"], identity["packing"]["epochs"]),
        tokens_this_run=sum(e["tokens"] for e in written),
        mapped_fraction=totals["mapped"] / totals["tokens"] if totals["tokens"] else float("nan"),
        bytes=totals["bytes"], complete=complete, seconds=time.perf_counter() - t0, write_cpu_seconds=cpu,
        teachers=teacher_names(data.teachers.datasets if data.teachers is not None else [data.scored]),
        store_calls=store_calls.snapshot(),
    )


def _write_shards(job: ExportJobConfig, source: RowSource, pending: list[int], n_rows: int, identity: dict,
                  done: dict, about: dict, n_shards: int, schema, manifest_every_s: float = 10.0,
                  on_first=None) -> list[dict]:
    """Write the pending shards in order, with a progress bar; the manifest is rewritten now and
    then; ``on_first`` is called once the first shard is written."""
    rows = sum(len(shard_rows(i, job.export.rows_per_shard, n_rows)) for i in pending)
    bar = tqdm(total=rows, unit="row", desc="export", disable=not job.export.progress, dynamic_ncols=True)
    written: list[dict] = []
    progress = ShardProgress(lambda: write_manifest(job.output_dir, identity, done, n_shards, about), manifest_every_s)
    try:
        for index in pending:
            entry = write_export_shard(job, source, index, n_rows, schema)
            done[index] = entry
            written.append(entry)
            if on_first is not None and len(written) == 1:
                on_first()
            bar.update(entry["rows"])
            bar.set_postfix(shards=f"{len(done)}/{n_shards}", tok_s=f"{progress.tokens_per_s():.0f}")
            progress.scored(entry)
    finally:
        bar.close()
    return written
