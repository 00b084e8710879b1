"""Rich tables and coloured text for the terminal; the commands
(:mod:`pipeline.inspection.commands`) print what these return."""

from __future__ import annotations

import numpy as np
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from pipeline.inspection.align_report import AlignReport
from pipeline.inspection.pieces import LossScale, cut_pieces
from pipeline.inspection.summary import DatasetSummary
from pipeline.inspection.validate import ValidationReport
from pipeline.inspection.vocab_overlap import VocabOverlap
from pipeline.folders.rehearsal import NOTE as REHEARSAL_NOTE
from pipeline.folders.rehearsal import is_rehearsal
from storage_schemas import describe_teacher
from storage_schemas.layout import shard_index
from storage_schemas.reader import DocumentRecord


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.2f}%"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v:,}" for k, v in counts.items()) or "none"


def _cells(*values) -> list[Text]:
    """Table cells as plain text: data (doc ids, token text like ``[/math]``) is never rich markup."""
    return [v if isinstance(v, Text) else Text(str(v)) for v in values]


def _key_value_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    for key, value in rows:
        table.add_row(*_cells(key, value))
    return table


# --------------------------------------------------------------------------------------------
# Summary and one document
# --------------------------------------------------------------------------------------------


def summary_renderables(s: DatasetSummary) -> list:
    status = "complete" if s.complete else f"partial: {s.shards_listed} of {s.shards_planned} planned shards"
    if s.damaged:
        status = (f"{status} in its manifest, but {len(s.damaged)} of its {s.shards_listed} listed shards are damaged "
                  "and left out of every figure below")
    q = s.quantiles
    rehearsal = [("REHEARSAL", REHEARSAL_NOTE)] if is_rehearsal({"teacher": s.teacher}) else []
    overview = _key_value_table(escape(f"scored dataset {s.name}"), [
        *rehearsal,
        ("folder", f"{s.folder} ({status})"),
        ("teacher", describe_teacher(s.teacher)),
        ("documents", f"{s.documents:,} stored ({s.empty_documents:,} with zero tokens)"),
        ("teacher tokens", f"{s.tokens:,}"),
        ("bytes on disk", f"{s.bytes_on_disk:,} ({_size(s.bytes_on_disk)}; {s.bytes_per_token:.2f} bytes per teacher token)"),
        ("loss mean", f"{s.loss_mean:.4f} nats (NaN ignored; min {s.loss_min:.4f}, max {s.loss_max:.4f})"),
        ("loss quantiles", ", ".join(f"p{100 * k:g} {v:.3f}" for k, v in q.items())
         + f"  (within {s.histogram.bin_width:g} nats)"),
        ("NaN losses", f"{s.losses_nan:,} ({_pct(s.nan_share)} of tokens)"),
        ("infinite losses", f"{s.losses_inf:,}" + ("  <- breaks the contract: run command=validate" if s.losses_inf else "")),
        ("skipped (not stored)", _reasons(s.skipped)),
        ("stored with zero tokens", _reasons(s.zero_token)),
        ("scored, noted", _reasons(s.noted)),
    ])
    shards = Table(title="per shard", title_justify="left")
    for name in ("shard", "docs", "tokens", "size", "B/token", "loss", "NaN", "skipped"):
        shards.add_column(name, justify="left" if name == "shard" else "right", no_wrap=True)
    for r in s.per_shard.iter_rows(named=True):
        shards.add_row(*_cells(r["file"].removesuffix(".parquet"), f"{r['documents']:,}", f"{r['tokens']:,}", _size(r["bytes"]),
                       f"{r['bytes_per_token']:.2f}" if r["tokens"] else "n/a",
                       f"{r['mean_loss']:.4f}" if r["mean_loss"] is not None else "n/a",
                       _pct(r["nan_share"]) if r["nan_share"] is not None else "n/a", f"{r['skipped']:,}"))
    out = [overview, shards]
    if s.damaged:
        out[:0] = [Text(f"warning: {file}: {problem}", style="yellow") for file, problem in s.damaged.items()] + [
            Text("warning: make validate names every problem of every shard; the stage-1 command again with "
                 f"rescore_shards=[{','.join(str(shard_index(f)) for f in s.damaged)}] scores the damaged ones again",
                 style="yellow")]
    for title, frame in ((f"highest mean loss (documents with >= {s.min_tokens} tokens)", s.highest),
                         (f"lowest mean loss (documents with >= {s.min_tokens} tokens)", s.lowest)):
        table = Table(title=title, title_justify="left")
        for name in ("doc_id", "file", "tokens", "mean loss"):
            table.add_column(name, justify="right" if name in ("tokens", "mean loss") else "left")
        for r in frame.iter_rows(named=True):
            table.add_row(*_cells(r["doc_id"], r["file"], f"{r['tokens']:,}", f"{r['mean_loss']:.4f}"))
        out.append(table)
    return out


def document_text(record: DocumentRecord, scale: LossScale, max_chars: int = 3000) -> Text:
    """The document's text, each teacher token on the background colour of its loss bucket."""
    text = record.text[:max_chars]
    pieces = cut_pieces(len(text), np.minimum(record.starts, len(text)), np.minimum(record.ends, len(text)), record.losses)
    buckets = scale.bucket(pieces.loss)
    out = Text()
    for a, b, k in zip(pieces.starts.tolist(), pieces.ends.tolist(), buckets.tolist()):
        out.append(text[a:b], style=f"{scale.text_colour(k)} on {scale.colour(k)}")
    if len(record.text) > max_chars:
        out.append(f"\n... ({len(record.text) - max_chars:,} more characters; max_chars={max_chars})", style="italic")
    return out


def legend(scale: LossScale) -> Text:
    out = Text("teacher loss (nats): ")
    for k, label in enumerate(scale.labels()):
        out.append(f" {label} ", style=f"{scale.text_colour(k)} on {scale.colour(k)}")
    out.append(" NaN ", style=f"black on {scale.colour(-1)}")
    return out


def document_table(record: DocumentRecord, top: int = 15) -> Table:
    """The document's highest-loss teacher tokens."""
    order = np.argsort(-np.nan_to_num(record.losses.astype(np.float64), nan=-np.inf))[:top]
    table = Table(title=escape(f"highest-loss teacher tokens of {record.doc_id}"), title_justify="left")
    for name in ("#", "id", "span", "text", "loss"):
        table.add_column(name, justify="right" if name in ("#", "id", "loss") else "left")
    for k in order.tolist():
        a, b = int(record.starts[k]), int(record.ends[k])
        table.add_row(*_cells(str(k), str(int(record.ids[k])), f"({a},{b})", repr(record.text[a:b]), f"{record.losses[k]:.3f}"))
    return table


# --------------------------------------------------------------------------------------------
# Validation, overlap, alignment
# --------------------------------------------------------------------------------------------


def validation_renderables(report: ValidationReport, max_lines: int | None = None) -> list:
    lines = [str(p) for p in report.problems]
    shown = lines if max_lines is None else lines[:max_lines]
    out: list = [Text(line, style="red" if line.startswith("error") else "yellow") for line in shown]
    if len(shown) < len(lines):
        out.append(Text(f"... and {len(lines) - len(shown):,} more (all in validation.json)", style="italic"))
    verdict = "OK" if report.ok else "FAILED"
    counts = f"{len(report.errors)} errors, {len(report.warnings)} warnings"
    out.append(Text(f"validate {verdict}: {report.shards_checked} shards, {report.rows_checked:,} rows; {counts}",
                    style="bold green" if report.ok else "bold red"))
    return out


def overlap_table(o: VocabOverlap) -> Table:
    title = f"vocabulary overlap: teacher {o.teacher.source} vs student {o.student.source}"
    table = Table(title=escape(title), title_justify="left")
    for name in ("view", "teacher", "student", "shared", "of teacher", "of student", "IoU"):
        table.add_column(name, justify="left" if name == "view" else "right")
    for view, s in (("raw strings", o.raw), ("normalised", o.normalised), ("special (apart)", o.special)):
        table.add_row(*_cells(view, f"{s.teacher:,}", f"{s.student:,}", f"{s.shared:,}", _pct(s.share_of_teacher),
                      _pct(s.share_of_student), _pct(s.iou)))
    table.caption = "; ".join(
        f"{side}: {v.kind}, {len(v.tokens):,} tokens compared, {len(v.special)} special and {len(v.added):,} other added left out"
        for side, v in (("teacher", o.teacher), ("student", o.student))
    )
    return table


def align_renderables(r: AlignReport) -> list:
    d = r.to_dict()
    tok = d["token_level"]
    scope = f"first {r.documents:,} documents (limit_docs={r.limit_docs})" if r.limit_docs else f"all {r.documents:,} documents"
    overview = _key_value_table(escape(f"alignment of student {r.student} with the teacher tokens"), [
        ("dataset", f"{r.dataset} ({scope})"),
        ("tokens", f"{d['student_tokens']:,} student, {d['teacher_tokens']:,} teacher "
                   f"({d['teacher_tokens'] / max(d['student_tokens'], 1):.3f} teacher per student)"),
        ("mapped share", f"{_pct(tok['mapped_share'])} of student tokens (aggregation {r.how})"),
        ("IoS (token level)", f"mean {tok['ios_mean']:.4f}; {_pct(tok['ios_full_share'])} of mapped tokens fully covered"),
        ("IoU (token level)", f"per token mean {tok['iou_mean']:.4f}; per document mean {tok['doc_iou_mean']:.4f}"),
        ("teacher tokens per student token", ", ".join(f"{k}: {v:,}" for k, v in d["teacher_per_student"].items())
         + f" (mean {d['mean_teacher_per_mapped_student']:.3f} over mapped)"),
        ("student tokens per teacher token", ", ".join(f"{k}: {v:,}" for k, v in d["student_per_teacher"].items())),
        ("per-document mapped share", ", ".join(f"{k} {_pct(v)}" for k, v in d["doc_mapped_share"].items())),
    ])
    chunks = Table(title="token-level vs chunk-level alignment", title_justify="left")
    for name in ("alignment", "mapped share", "IoS mean", "IoU mean", "fully covered"):
        chunks.add_column(name, justify="left" if name == "alignment" else "right")
    rows = [("token level", tok)] + [(f"{n} chunk{'s' if int(n) > 1 else ''}", q) for n, q in d["chunk_level"].items()]
    for label, q in rows:
        chunks.add_row(*_cells(label, _pct(q["mapped_share"]), f"{q['ios_mean']:.4f}", f"{q['iou_mean']:.4f}",
                               _pct(q["ios_full_share"])))
    return [overview, chunks]


# --------------------------------------------------------------------------------------------
# Two scored folders compared
# --------------------------------------------------------------------------------------------


def parity_renderables(p, over: list[str]) -> list:
    """The comparison of two scored folders (:class:`pipeline.inspection.parity.Parity`)."""
    wa, wb = p.windows
    held = "".join(f"; {len(names)} in the {which} only ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})"
                   for which, names in zip(("first", "second"), p.only_in) if names)
    rows = [("first", p.a), ("second", p.b), ("shards", f"{p.shards:,} held by both, compared{held}"),
            ("documents", f"{p.documents:,} compared, {p.n_mismatched} differing"),
            ("windows", f"{wa.get('window')}/{wa.get('stride')} vs {wb.get('window')}/{wb.get('stride')}"
                        + ("" if wa == wb else " (another plan: tokens with another context counted apart)"))]
    for title, d in (("same context", p.same_context.to_dict()), ("context differs", p.context_differs.to_dict())):
        if d["tokens"] or title == "same context":
            rows.append((title, f"{d['tokens']:,} tokens: |loss diff| max {d['max_abs']:.3g}, p99 {d['p99_abs']:.3g}, "
                                f"mean {d['mean_abs']:.3g} nats; {d['flip_share']:.4%} flip at ratio {p.ratio} "
                                f"({d['flips']:,} tokens); {d['nan_mismatch']} NaN in one folder only"))
    items: list = [_key_value_table("scored folders compared", rows)]
    items += [escape(f"document: {m}") for m in p.mismatches]
    items.append(escape("over tolerance: " + "; ".join(over)) if over else "within tolerance")
    return items
