"""A self-contained HTML page: a document's text with per-token teacher loss as colour and the
student token boundaries as boxes.

One file, no scripts, no external resources. Every text fragment (document text, token strings,
ids) goes through :func:`html.escape`, so a document containing ``<script>`` shows as text.

The text is cut into pieces at every teacher and student boundary (:func:`layout.cut_pieces`);
each piece has the background colour of its teacher loss bucket (quantiles of the dataset, the
legend gives the ranges), a thin mark where a teacher token starts, and a tooltip naming its
teacher token(s) with their losses and its student token(s) with the aggregated ``L_t``.
Consecutive pieces of one student token sit in a bordered box, so the border is the student
boundary. Characters no student token covers are outside any box.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipeline.inspection.pieces import PALETTE, LossScale, cut_pieces
from pipeline.method.tokenization import Encoding
from storage_schemas.reader import DocumentRecord

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #111; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 2em; }
table.meta { border-collapse: collapse; font-size: 0.9em; }
table.meta td { padding: 1px 10px 1px 0; vertical-align: top; }
.doc { font-family: ui-monospace, monospace; font-size: 14px; line-height: 1.9; white-space: pre-wrap;
       word-break: break-word; border: 1px solid #ccc; padding: 10px; background: #fff; }
.s { border: 1px solid #444; border-radius: 3px; padding: 1px 0; margin-right: 1px; }
.ts { box-shadow: inset 1px 0 0 rgba(0, 0, 0, 0.45); }
.legend span { display: inline-block; padding: 2px 6px; font-size: 0.8em; font-family: ui-monospace, monospace; }
.note { color: #555; font-size: 0.85em; }
"""


def _css_classes(scale: LossScale) -> str:
    rules = [f".q{k} {{ background: {scale.colour(k)}; color: {scale.text_colour(k)}; }}" for k in range(len(PALETTE))]
    rules.append(f".qn {{ background: {scale.colour(-1)}; color: #000; }}")
    return "\n".join(rules)


def _cls(bucket: int) -> str:
    return "qn" if bucket < 0 else f"q{bucket}"


def _e(value) -> str:
    return html.escape(str(value), quote=True)


@dataclass(frozen=True)
class StudentView:
    """A student tokenization of the document and, optionally, its aligned teacher losses."""

    name: str
    encoding: Encoding
    tokens: Sequence[str]  # token strings, as the student tokenizer spells them
    teacher_loss: np.ndarray | None = None  # (N,) aggregated L_t per student token
    how: str = "max"


def legend_html(scale: LossScale) -> str:
    items = [f'<span class="{_cls(k)}">{_e(label)}</span>' for k, label in enumerate(scale.labels())]
    items.append('<span class="qn">NaN (no prediction)</span>')
    return '<div class="legend">teacher loss, nats (dataset deciles): ' + "".join(items) + "</div>"


def _meta_table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="meta">{body}</table>'


@dataclass(frozen=True)
class _Shown:
    """One tokenization clipped to the shown text: original indices, spans, and a tooltip line each."""

    index: np.ndarray  # (K,) indices into the full tokenization
    starts: np.ndarray  # (K,)
    ends: np.ndarray  # (K,) clipped to the shown text
    notes: list[str]

    @classmethod
    def clip(cls, starts, ends, n: int, note) -> "_Shown":
        index = np.flatnonzero(np.asarray(starts) < n)  # tokens that start inside the shown text
        clipped = np.minimum(np.asarray(ends)[index], n)
        return cls(index, np.asarray(starts)[index], clipped, [note(int(i)) for i in index])


def _teacher_tokens(record: DocumentRecord, n: int) -> _Shown:
    def note(j: int) -> str:
        a, b = int(record.starts[j]), int(record.ends[j])
        return f"teacher #{j} id {int(record.ids[j])} {record.text[a:b]!r} ({a},{b}) loss {float(record.losses[j]):.3f}"

    return _Shown.clip(record.starts, record.ends, n, note)


def _student_tokens(student: StudentView, n: int) -> _Shown:
    enc = student.encoding

    def note(i: int) -> str:
        loss = "" if student.teacher_loss is None else f" L_t({student.how}) {float(student.teacher_loss[i]):.3f}"
        return f"student #{i} id {int(enc.ids[i])} {student.tokens[i]!r} ({int(enc.starts[i])},{int(enc.ends[i])}){loss}"

    return _Shown.clip(enc.starts, enc.ends, n, note)


def _coloured_text(text: str, scale: LossScale, teacher: _Shown, losses: np.ndarray, student: _Shown | None) -> str:
    """The text as pieces coloured by loss; consecutive pieces of one student token in a box."""
    extra = [(student.starts, student.ends)] if student is not None else []
    pieces = cut_pieces(len(text), teacher.starts, teacher.ends, losses, *extra)
    buckets = scale.bucket(pieces.loss)
    t_cover = pieces.covering(teacher.starts, teacher.ends)
    s_cover = pieces.covering(student.starts, student.ends) if student is not None else [[]] * len(pieces)
    teacher_starts = set(teacher.starts.tolist())
    parts: list[str] = []
    open_box: int | None = None
    for p in range(len(pieces)):
        a, b = int(pieces.starts[p]), int(pieces.ends[p])
        box = min(s_cover[p]) if s_cover[p] else None
        if box != open_box:
            parts.append("</span>" if open_box is not None else "")
            parts.append(f'<span class="s" title="{_e(student.notes[box])}">' if box is not None else "")
            open_box = box
        notes = [teacher.notes[j] for j in t_cover[p]] or ["no teacher token"]
        notes += [student.notes[k] for k in s_cover[p]]
        mark = " ts" if a in teacher_starts else ""
        parts.append(f'<span class="{_cls(int(buckets[p]))}{mark}" title="{_e(chr(10).join(notes))}">{_e(text[a:b])}</span>')
    parts.append("</span>" if open_box is not None else "")
    return "".join(parts)


def _section_rows(record: DocumentRecord, student: StudentView | None, max_chars: int) -> list[tuple[str, str]]:
    finite = record.losses[np.isfinite(record.losses)]
    mean = f"; mean loss {finite.mean():.4f}" if finite.size else ""
    shown = f" (first {max_chars:,} shown)" if len(record.text) > max_chars else ""
    rows = [("document", f"{record.doc_id} ({record.file} row {record.row})"),
            ("teacher tokens", f"{len(record):,}{mean}"), ("characters", f"{len(record.text):,}{shown}")]
    if student is not None:
        rows.append(("student", f"{student.name}: {len(student.encoding):,} tokens, boxed"))
        if student.teacher_loss is not None and len(student.encoding):
            rows.append(("mapped", f"{100 * np.mean(~np.isnan(student.teacher_loss)):.2f}% of student tokens"))
    return rows


def document_section(
    record: DocumentRecord, scale: LossScale, student: StudentView | None = None,
    max_chars: int = 20000, heading: str | None = None,
) -> str:
    """One document as an HTML fragment (a heading, its numbers and the coloured text)."""
    text = record.text[:max_chars]
    teacher = _teacher_tokens(record, len(text))
    shown_student = _student_tokens(student, len(text)) if student is not None else None
    body = _coloured_text(text, scale, teacher, record.losses[teacher.index], shown_student)
    rows = _section_rows(record, student, max_chars)
    return f"<h2>{_e(heading or record.doc_id)}</h2>\n{_meta_table(rows)}\n<div class=\"doc\">{body}</div>\n"


def page(title: str, sections: list[str], scale: LossScale, meta: list[tuple[str, str]]) -> str:
    """The whole self-contained page."""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{_e(title)}</title>\n<style>{CSS}\n{_css_classes(scale)}</style>\n</head>\n<body>\n"
        f"<h1>{_e(title)}</h1>\n{_meta_table(meta)}\n{legend_html(scale)}\n"
        '<p class="note">Colour: teacher loss of the token(s) under each character. Boxes: student tokens. '
        "A dark mark on the left: a teacher token starts. Hover for token ids, spans and losses.</p>\n"
        + "".join(sections)
        + "</body>\n</html>\n"
    )
