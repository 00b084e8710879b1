"""The inspection commands behind ``make inspect`` (``command=``), one function each, on a config
composed from ``conf/inspect/inspect.yaml`` and typed by :func:`inspect_config` (every problem at
once); :func:`run` runs the command and returns the exit status (1: validation found
errors). The stage only composes and checks the config.

Commands (``command=``):

* ``summary`` (default), ``path=<dataset>``: documents, tokens, bytes per token, loss quantiles and
  mean, NaN share, skipped documents by reason, a per-shard table, the highest- and lowest-loss
  documents, one document coloured by loss (``doc=<doc_id>`` or the first one). Writes
  ``summary.json``.
* ``validate``, ``path=<dataset>``: every contract invariant over every shard; prints every problem
  (file, row, document), writes ``validation.json`` and exits with status 1 if any is an error.
* ``vocab-overlap``, ``teacher=T student=S`` (Hydra keys cannot start with ``--``): raw and
  normalised vocabulary overlap (docs/METHOD.md §3.2). ``teacher`` defaults to the dataset's
  teacher tokenizer when ``path`` is given.
* ``align-report``, ``path=<dataset> student=S``: mapped share, IoS, IoU, teacher tokens per student
  token, chunk-level comparison (docs/METHOD.md §2.1, §2.3); ``align.write_aligned=true`` writes the aligned student tokens.
* ``html``, ``path=<dataset> [student=S] [doc=<doc_id>]``: a self-contained page of documents
  coloured by teacher loss with the student token boundaries.
* ``plots``, ``path=<dataset> [student=S]``: PNG loss histogram; with a student also the mapped
  share, teacher tokens per student token and chunk-level IoU/IoS against the chunk count.
* ``card``, ``path=<dataset>``: (re)writes the dataset card ``README.md`` in the dataset folder
  itself (:mod:`pipeline.folders.dataset_card`; stage 1 writes it at the end of every run).
* ``two-teachers``, ``path=<dataset> other=<dataset> student=S``: the same corpus scored by two
  teachers, aligned to one student: correlation of the aligned losses and the share of tokens where
  the teachers' top-``two_teachers.ratio`` selections disagree (:mod:`pipeline.inspection.two_teachers`).
* ``compare``, ``path=<dataset> other=<dataset>``: the same corpus scored twice (another backend,
  dtype, storage or cluster): documents, ids and offsets must be equal; losses compared per token
  (max / p99 / mean |difference|, the share of tokens whose top-``compare.ratio`` selection flips),
  tokens scored with another left context counted apart; only the shards both folders hold; exit
  status 1 past ``compare.max_abs`` / ``compare.flip_share`` (:mod:`pipeline.inspection.parity`).
  Writes ``compare/<corpus>--<teacher>--<digest of other's location>.json`` (:func:`result_name`).

Outputs go to ``out_dir`` (default ``<dataset>/inspect``; for a dataset on an object store the
local ``outputs/inspect/<scheme>/<bucket>/<key>``; ``outputs/inspect/vocab-overlap`` for an overlap
without a dataset); every file written is printed. ``path`` may be a local folder or an ``s3://`` /
``gs://`` URI (:mod:`storage_schemas.filesystem`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from rich.console import Console
from rich.markup import escape

from pipeline.method.alignment import AGGREGATIONS
from pipeline.runtime.config import build, check_at_least, check_choice, raise_if
from pipeline.folders.dataset_card import write_card
from pipeline.inspection import plots, terminal
from pipeline.inspection.align_report import align_record, align_report
from pipeline.inspection.html import StudentView, document_section, page
from pipeline.inspection.parity import compare_folders
from pipeline.inspection.pieces import LossScale
from pipeline.inspection.summary import DEFAULT_QUANTILES, summarize
from pipeline.inspection.two_teachers import renderables, two_teachers
from pipeline.inspection.validate import validate_dataset
from pipeline.inspection.vocab_overlap import load_vocabulary, vocab_overlap
from pipeline.method.loss_histogram import DEFAULT_BIN_WIDTH
from pipeline.folders.model_source import check_tokenizer_source
from pipeline.folders.output_folder import check_writable, overlap_problem
from pipeline.method.tokenization import encode, load_tokenizer
from storage_schemas import ContractError, filesystem, read_manifest, strict_json
from storage_schemas import filesystem as sfs
from storage_schemas.reader import ScoredDataset, teacher_tokenizer_location

Resolve = Callable[[str], "str | Path"]  # makes a user's relative path absolute (the stage passes Hydra's)

INSPECT_DIR = "inspect"  # default output folder inside the dataset folder
REMOTE_OUT_ROOT = "outputs/inspect"  # default output root for a dataset on an object store
OVERLAP_OUT_DIR = "outputs/inspect/vocab-overlap"  # vocab-overlap without a dataset
NEEDS_PATH = ("summary", "validate", "align-report", "html", "plots", "card", "two-teachers", "compare")
NEEDS_STUDENT = ("vocab-overlap", "align-report", "two-teachers")
WRITES_FILES = ("html", "plots")  # their files are what they make; the others print what they find


def default_out_dir(folder) -> Path:
    """Where inspection outputs go unless told otherwise: ``<dataset>/inspect``, or for a dataset on
    an object store ``outputs/inspect/<scheme>/<bucket>/<key>`` (relative: the caller resolves it)."""
    if sfs.is_remote(folder):
        scheme, rest = str(folder).split("://", 1)
        return Path(REMOTE_OUT_ROOT) / scheme / rest.strip("/")
    return Path(folder) / INSPECT_DIR


@dataclass(frozen=True)
class SummarySettings:
    top_k: int = 10  # highest- and lowest-mean-loss documents listed
    min_tokens: int = 16  # ...among documents with at least this many teacher tokens
    quantiles: tuple[float, ...] = DEFAULT_QUANTILES
    bin_width: float = DEFAULT_BIN_WIDTH  # loss histogram bin (nats): quantiles are exact to within one bin
    show_document: bool = True  # print one document coloured by loss, and its highest-loss tokens
    max_chars: int = 3000
    checksums: bool = True  # each shard's sha256 against the manifest's (reads every byte): a damaged one is named

    def problems(self) -> list[str]:
        found: list[str] = []
        if not all(0.0 <= q <= 1.0 for q in self.quantiles):
            found.append(f"quantiles: {list(self.quantiles)} must lie in [0, 1]")
        if self.bin_width <= 0:
            found.append(f"bin_width: {self.bin_width} must be > 0")
        check_at_least(found, "top_k", self.top_k, 1)
        check_at_least(found, "min_tokens", self.min_tokens, 0)
        check_at_least(found, "max_chars", self.max_chars, 1)
        return found


@dataclass(frozen=True)
class ValidateSettings:
    checksums: bool = True  # sha256 of every shard against the manifest (reads every byte)
    special_ids: str | list[int] = "auto"  # ids whose empty text slice is legal; auto: the teacher tokenizer's
    max_lines: int = 200  # problems printed (all of them go to validation.json)

    def problems(self) -> list[str]:
        found: list[str] = []
        if isinstance(self.special_ids, str) and self.special_ids != "auto":
            found.append(f"special_ids: {self.special_ids!r} is not auto or a list of token ids")
        check_at_least(found, "max_lines", self.max_lines, 1)
        return found


@dataclass(frozen=True)
class AlignSettings:
    how: str = "max"  # aggregation of teacher losses per student token
    chunk_counts: tuple[int, ...] = (1, 4, 16, 64, 256)
    limit_docs: int | None = 2000  # documents aligned (null: all of them)
    write_aligned: bool = False  # write <out_dir>/aligned/<student>/shard-NNNNNN.parquet

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "how", self.how, AGGREGATIONS)
        if not all(n >= 1 for n in self.chunk_counts):
            found.append(f"chunk_counts: {list(self.chunk_counts)} must be positive integers")
        check_at_least(found, "limit_docs", self.limit_docs, 1)
        return found


@dataclass(frozen=True)
class HtmlSettings:
    max_chars: int = 20000  # characters shown per document

    def problems(self) -> list[str]:
        found: list[str] = []
        check_at_least(found, "max_chars", self.max_chars, 1)
        return found


@dataclass(frozen=True)
class TwoTeachersSettings:
    ratio: float = 0.4  # each teacher's top share (lowest L_t for a flat student); uses align.how and align.limit_docs

    def problems(self) -> list[str]:
        return [] if 0.0 < self.ratio <= 1.0 else [f"ratio: {self.ratio} is not in (0, 1]"]


@dataclass(frozen=True)
class CompareSettings:
    ratio: float = 0.4  # the share a flat student selects per document, whose flips are counted
    limit_docs: int | None = None  # documents compared (None: all of them)
    max_abs: float | None = None  # exit 1 when a same-context token's |loss difference| exceeds this (nats)
    flip_share: float | None = None  # exit 1 when more same-context tokens flip than this share

    def problems(self) -> list[str]:
        found = [] if 0.0 < self.ratio <= 1.0 else [f"ratio: {self.ratio} is not in (0, 1]"]
        check_at_least(found, "limit_docs", self.limit_docs, 1)
        for key in ("max_abs", "flip_share"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                found.append(f"{key}: {getattr(self, key)} must be >= 0")
        return found


@dataclass(frozen=True)
class InspectConfig:
    """``make inspect``'s settings (``conf/inspect/inspect.yaml`` overrides them)."""

    command: str = "summary"
    path: str | None = None  # the scored dataset folder (manifest.json + shard-NNNNNN.parquet)
    other: str | None = None  # two-teachers, compare: the same corpus scored again (another teacher, backend, dtype)
    out_dir: str | None = None  # None: <path>/inspect (vocab-overlap without a path: outputs/inspect/vocab-overlap)
    teacher: str | None = None  # vocab-overlap: hub id, folder, .gguf or SentencePiece .model; None: the dataset's
    student: str | None = None  # the student tokenizer (same forms)
    doc: str | int | None = None  # summary/html: a doc_id to show; None: the first document
    progress: bool = True
    summary: SummarySettings = field(default_factory=SummarySettings)
    validate: ValidateSettings = field(default_factory=ValidateSettings)
    align: AlignSettings = field(default_factory=AlignSettings)
    html: HtmlSettings = field(default_factory=HtmlSettings)
    two_teachers: TwoTeachersSettings = field(default_factory=TwoTeachersSettings)
    compare: CompareSettings = field(default_factory=CompareSettings)

    def problems(self) -> list[str]:
        """What the settings of one command need of the others."""
        problems: list[str] = []
        check_choice(problems, "command", self.command, COMMANDS)
        if self.command in NEEDS_PATH and not self.path:
            problems.append(f"path: command={self.command} needs path=<scored dataset folder>")
        if self.command in NEEDS_STUDENT and not self.student:
            problems.append(f"student: command={self.command} needs student=<tokenizer>")
        if self.command == "vocab-overlap" and not (self.teacher or self.path):
            problems.append("teacher: command=vocab-overlap needs teacher=<tokenizer> (or path=<dataset> to use its teacher's)")
        if self.command in ("two-teachers", "compare") and not self.other:
            problems.append(f"other: command={self.command} needs other=<the second scored dataset folder>")
        return problems


def inspect_config(values: Mapping) -> InspectConfig:
    """The typed settings from a composed config (plain mapping); every problem in one :class:`ConfigError`."""
    problems: list[str] = []
    cfg = build(InspectConfig, values, "", problems, drop=("hydra",))
    raise_if(problems)
    return replace(cfg, doc=None if cfg.doc is None else str(cfg.doc))


def tokenizer_slug(source: str) -> str:
    """A file-name-safe name for a tokenizer source: ``org/name`` -> ``org--name``,
    ``../x/ggml-vocab-llama-spm.gguf`` -> ``ggml-vocab-llama-spm``, ``./tok/`` -> ``tok``."""
    path = Path(source)
    if path.suffix in (".gguf", ".model", ".json") or source.startswith(("/", ".", "~")) or path.is_dir():
        name = re.sub(r"\.(gguf|model|json)$", "", path.name)
    else:
        name = source.strip("/").replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "tokenizer"


def _local(source: str | None, resolve: Resolve = Path, setting: str = "tokenizer") -> str | None:
    """A tokenizer source made absolute when it names a local file or folder; a hub id is checked
    at once (cache, then one short hub request): one line naming ``setting`` if it cannot be had."""
    if source and Path(resolve(source)).exists():
        return str(Path(resolve(source)).resolve())
    if source:
        check_tokenizer_source(setting, source)
    return source


def write_json(path: Path, obj, console: Console) -> Path | None:
    """Write ``obj`` as JSON; a folder that cannot be written is a warning, not a failure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(strict_json(obj), indent=1, ensure_ascii=False) + "\n")
    except OSError as exc:
        problem = escape(f"could not write {path} ({exc}); set out_dir=<a writable folder>")
        console.print(f"[yellow]{problem}[/yellow]")
        return None
    console.print(f"wrote {path}", markup=False)
    return path


def _dataset_location(path: str, resolve: Resolve):
    """A dataset folder as the reader takes it: an object-store URI as is, a local path absolute."""
    return sfs.location(path) if sfs.is_remote(path) else Path(resolve(path)).resolve()


class Context:
    """What every command needs: the config, the console, the dataset and the output folder."""

    def __init__(self, cfg: InspectConfig, console: Console, resolve: Resolve = Path):
        self.cfg = cfg
        self.console = console
        self.resolve = resolve
        self.path = _dataset_location(cfg.path, resolve) if cfg.path else None
        if cfg.out_dir:
            self.out_dir = Path(resolve(cfg.out_dir))
            inputs = {"path": self.path, "other": cfg.other and _dataset_location(cfg.other, resolve),
                      "teacher": cfg.teacher and resolve(cfg.teacher), "student": cfg.student and resolve(cfg.student)}
            raise_if([p + "; write the reports to a folder of their own (or leave out_dir for <path>/inspect)"
                      for p in [overlap_problem(self.out_dir, inputs, setting="out_dir", inside_ok=True)] if p])
        elif self.path is not None:
            self.out_dir = Path(resolve(str(default_out_dir(self.path))))
        else:
            self.out_dir = Path(resolve(OVERLAP_OUT_DIR))
        if cfg.out_dir or cfg.command in WRITES_FILES:  # else a report that cannot be saved is still printed
            check_writable({"out_dir": self.out_dir})
        self._dataset = None
        self._summary = None

    @property
    def dataset(self):
        if self._dataset is None:
            self._dataset = ScoredDataset.open(self.path)
        return self._dataset

    def summary(self):
        if self._summary is None:
            s = self.cfg.summary
            self._summary = summarize(self.dataset, top_k=s.top_k, min_tokens=s.min_tokens,
                                      quantiles=tuple(s.quantiles), bin_width=s.bin_width, checksums=s.checksums)
            if self._summary.damaged:  # what is shown later (a document, a page) comes from the sound shards
                self._dataset = replace(self.dataset, shards=[p for p in self.dataset.shards
                                                              if sfs.name(p.path) not in self._summary.damaged])
        return self._summary

    def loss_scale(self):
        return LossScale.from_quantile_function(self.summary().histogram.quantile)

    def student_tokenizer(self):
        return load_tokenizer(_local(self.cfg.student, self.resolve, "student"))

    def align_report(self, tokenizer, write: bool):
        a = self.cfg.align
        slug = tokenizer_slug(self.cfg.student)
        return align_report(
            self.dataset, tokenizer, student=self.cfg.student, how=a.how, chunk_counts=tuple(a.chunk_counts),
            limit_docs=a.limit_docs, write_dir=self.out_dir / "aligned" / slug if write else None,
            progress=bool(self.cfg.progress),
        )


# --------------------------------------------------------------------------------------------
# Commands: each returns the exit status
# --------------------------------------------------------------------------------------------


def cmd_summary(ctx: Context) -> int:
    summary = ctx.summary()
    for item in terminal.summary_renderables(summary):
        ctx.console.print(item)
    if ctx.cfg.summary.show_document and summary.documents:
        record = ctx.dataset.find_document(ctx.cfg.doc, min_tokens=0 if ctx.cfg.doc else 1)
        scale = ctx.loss_scale()
        where = f"({record.file} row {record.row}, {len(record):,} teacher tokens)"
        ctx.console.print(f"\n[bold]{escape(record.doc_id)}[/bold] {where}")
        ctx.console.print(terminal.legend(scale))
        ctx.console.print(terminal.document_text(record, scale, ctx.cfg.summary.max_chars))
        ctx.console.print(terminal.document_table(record))
    write_json(ctx.out_dir / "summary.json", summary.to_dict(), ctx.console)
    return 0


def _special_ids(ctx: Context, manifest: dict) -> list[int]:
    setting = ctx.cfg.validate.special_ids
    if setting != "auto":
        return [int(i) for i in setting]
    source = teacher_tokenizer_location(manifest)
    if not manifest.get("identity"):
        return []  # no manifest: validate_dataset reports it
    if not source or not Path(source).exists():
        ctx.console.print("[dim]validate: the teacher tokenizer is not local; every empty text slice counts as an error[/dim]")
        return []

    return list(load_tokenizer(source).all_special_ids)


def cmd_validate(ctx: Context) -> int:
    try:
        manifest = read_manifest(ctx.path)
    except ContractError:
        manifest = {}  # reported by validate_dataset itself
    report = validate_dataset(ctx.path, checksums=bool(ctx.cfg.validate.checksums), special_ids=_special_ids(ctx, manifest))
    for item in terminal.validation_renderables(report, ctx.cfg.validate.max_lines):
        ctx.console.print(item)
    write_json(ctx.out_dir / "validation.json", report.to_dict(), ctx.console)
    return 0 if report.ok else 1


def cmd_vocab_overlap(ctx: Context) -> int:
    teacher = _local(ctx.cfg.teacher or ctx.dataset.teacher_tokenizer, ctx.resolve, "teacher")
    student = _local(ctx.cfg.student, ctx.resolve, "student")
    overlap = vocab_overlap(load_vocabulary(teacher), load_vocabulary(student))
    ctx.console.print(terminal.overlap_table(overlap))
    for key, values in overlap.examples.items():
        ctx.console.print(f"[dim]{key.replace('_', ' ')}:[/dim] " + escape(", ".join(repr(v) for v in values[:8])))
    name = f"{tokenizer_slug(teacher)}--vs--{tokenizer_slug(student)}.json"
    write_json(ctx.out_dir / "vocab-overlap" / name if ctx.path else ctx.out_dir / name, overlap.to_dict(), ctx.console)
    return 0


def cmd_align_report(ctx: Context) -> int:
    report = ctx.align_report(ctx.student_tokenizer(), write=bool(ctx.cfg.align.write_aligned))
    for item in terminal.align_renderables(report):
        ctx.console.print(item)
    slug = tokenizer_slug(ctx.cfg.student)
    write_json(ctx.out_dir / "align" / f"{slug}.json", report.to_dict(), ctx.console)
    if ctx.cfg.align.write_aligned:
        partial = f" (first {report.documents:,} documents only: align.limit_docs)" if ctx.cfg.align.limit_docs else ""
        ctx.console.print(f"wrote aligned student tokens to {ctx.out_dir / 'aligned' / slug}/{partial}", markup=False)
    return 0


def _html_documents(ctx: Context) -> list[tuple[str, object]]:
    """(heading, record) pairs: ``doc``, or the first, highest- and lowest-loss documents."""
    ds = ctx.dataset
    if ctx.cfg.doc:
        return [(ctx.cfg.doc, ds.find_document(ctx.cfg.doc, min_tokens=0))]
    summary = ctx.summary()
    picks = [("first document", ds.find_document(None, min_tokens=1))]
    for label, frame in (("highest mean loss", summary.highest), ("lowest mean loss", summary.lowest)):
        if frame.height and frame["doc_id"][0] not in {r.doc_id for _, r in picks}:
            picks.append((label, ds.find_document(frame["doc_id"][0])))
    return [(f"{label}: {record.doc_id}", record) for label, record in picks]


def cmd_html(ctx: Context) -> int:
    documents = _html_documents(ctx)  # first: an unknown doc id fails before the dataset-wide pass
    scale = ctx.loss_scale()
    tokenizer = ctx.student_tokenizer() if ctx.cfg.student else None
    sections = []
    for heading, record in documents:
        view = None
        if tokenizer is not None:
            encoding = encode(tokenizer, record.text)
            aligned = align_record(record, encoding, ctx.cfg.align.how)
            view = StudentView(ctx.cfg.student, encoding, tokenizer.convert_ids_to_tokens(encoding.ids.tolist()),
                               aligned.teacher_loss, ctx.cfg.align.how)
        sections.append(document_section(record, scale, view, ctx.cfg.html.max_chars, heading))
    meta = [("dataset", f"{ctx.dataset.name} ({ctx.path})"), ("teacher", ctx.dataset.teacher_model),
            ("student", ctx.cfg.student or "none (student=<tokenizer> to show its boundaries)")]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", ctx.cfg.doc) if ctx.cfg.doc else "overview"
    if ctx.cfg.student:
        name += f"--{tokenizer_slug(ctx.cfg.student)}"
    path = ctx.out_dir / "html" / f"{name}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(f"teacher losses: {ctx.dataset.name}", sections, scale, meta), encoding="utf-8")
    ctx.console.print(f"wrote {path}", markup=False)
    return 0


def cmd_plots(ctx: Context) -> int:
    folder = ctx.out_dir / "plots"
    written = [plots.loss_histogram(ctx.summary(), folder / "loss_histogram.png")]
    if ctx.cfg.student:
        report = ctx.align_report(ctx.student_tokenizer(), write=False)
        sub = folder / tokenizer_slug(ctx.cfg.student)
        written += [plots.mapped_share(report, sub / "mapped_share.png"),
                    plots.teacher_per_student(report, sub / "teacher_per_student.png"),
                    plots.chunk_quality(report, sub / "chunk_quality.png")]
    for path in written:
        ctx.console.print(f"wrote {path}", markup=False)
    return 0


def cmd_card(ctx: Context) -> int:
    folder = ctx.cfg.path if filesystem.is_remote(ctx.cfg.path) else ctx.path
    ctx.console.print(f"wrote {write_card(folder)}", markup=False)
    return 0


def cmd_two_teachers(ctx: Context) -> int:
    other = ScoredDataset.open(_dataset_location(ctx.cfg.other, ctx.resolve))
    report = two_teachers(ctx.dataset, other, ctx.student_tokenizer(), student=ctx.cfg.student, how=ctx.cfg.align.how,
                          ratio=float(ctx.cfg.two_teachers.ratio), limit_docs=ctx.cfg.align.limit_docs)
    for item in renderables(report):
        ctx.console.print(item)
    name = f"{tokenizer_slug(other.name)}--{tokenizer_slug(ctx.cfg.student)}.json"
    write_json(ctx.out_dir / "two-teachers" / name, report.to_dict(), ctx.console)
    return 0


def cmd_compare(ctx: Context) -> int:
    """Exit status 1 when the folders hold other documents, ids or offsets, or the same-context
    losses differ past the tolerance given."""
    other = ScoredDataset.open(_dataset_location(ctx.cfg.other, ctx.resolve))
    c = ctx.cfg.compare
    parity = compare_folders(ctx.dataset, other, ratio=c.ratio, limit_docs=c.limit_docs)
    same = parity.same_context.to_dict()
    over = []
    if parity.n_mismatched:
        over.append(f"{parity.n_mismatched} document(s) differ in their text, token ids or offsets")
    if c.max_abs is not None and parity.same_context.compared and same["max_abs"] > c.max_abs:
        over.append(f"max |loss difference| {same['max_abs']:.3g} > compare.max_abs={c.max_abs:g}")
    if c.flip_share is not None and same["flip_share"] > c.flip_share:
        over.append(f"flip share {same['flip_share']:.3g} > compare.flip_share={c.flip_share:g}")
    if parity.same_context.nan_mismatch and c.max_abs is not None:
        over.append(f"{parity.same_context.nan_mismatch} token(s) NaN in one folder only")
    for item in terminal.parity_renderables(parity, over):
        ctx.console.print(item)
    write_json(ctx.out_dir / "compare" / f"{result_name(other)}.json", {**parity.to_dict(), "over_tolerance": over},
               ctx.console)
    return 1 if over else 0


def result_name(other: ScoredDataset) -> str:
    """The name of a comparison's result with ``other``: its corpus and teacher, and a digest of where
    it is (scored folders all end in ``v1``, and one corpus and teacher may be scored in several places)."""
    where = hashlib.sha256(str(other.folders[0].path).encode()).hexdigest()[:8]
    return f"{tokenizer_slug(other.name)}--{where}"


COMMANDS: dict[str, Callable[[Context], int]] = {
    "summary": cmd_summary,
    "validate": cmd_validate,
    "vocab-overlap": cmd_vocab_overlap,
    "align-report": cmd_align_report,
    "html": cmd_html,
    "plots": cmd_plots,
    "card": cmd_card,
    "two-teachers": cmd_two_teachers,
    "compare": cmd_compare,
}


def run(cfg: InspectConfig, console: Console | None = None, resolve: Resolve = Path) -> int:
    """Run the command of ``cfg``; returns the exit status."""
    return COMMANDS[cfg.command](Context(cfg, console or Console(soft_wrap=True), resolve))
