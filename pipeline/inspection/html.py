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

from pipeline.inspection.dataset import DocumentRecord
from pipeline.inspection.layout import PALETTE, LossScale, cut_pieces
from pipeline.tokenization import Encoding

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


def document_section(
    record: DocumentRecord, scale: LossScale, student: StudentView | None = None,
    max_chars: int = 20000, heading: str | None = None,
) -> str:
    """One document as an HTML fragment (a heading, its numbers and the coloured text)."""
    text = record.text[:max_chars]
    n = len(text)
    t_keep = record.starts < n  # teacher tokens that start inside the shown text
    t_starts, t_ends = record.starts[t_keep], np.minimum(record.ends[t_keep], n)
    t_ids, t_losses = record.ids[t_keep], record.losses[t_keep]
    spans = []
    if student is not None:
        s_keep = student.encoding.starts < n
        s_starts, s_ends = student.encoding.starts[s_keep], np.minimum(student.encoding.ends[s_keep], n)
        s_index = np.flatnonzero(s_keep)
        spans.append((s_starts, s_ends))
    pieces = cut_pieces(n, t_starts, t_ends, t_losses, *spans)
    buckets = scale.bucket(pieces.loss)
    t_cover = pieces.covering(t_starts, t_ends)
    s_cover = pieces.covering(s_starts, s_ends) if student is not None else [[] for _ in range(len(pieces))]
    teacher_starts = set(t_starts.tolist())

    def teacher_note(j: int) -> str:
        a, b = int(t_starts[j]), int(t_ends[j])
        return f"teacher #{j} id {int(t_ids[j])} {text[a:b]!r} ({a},{b}) loss {float(t_losses[j]):.3f}"

    def student_note(k: int) -> str:
        i = int(s_index[k])
        loss = "" if student.teacher_loss is None else f" L_t({student.how}) {float(student.teacher_loss[i]):.3f}"
        return f"student #{i} id {int(student.encoding.ids[i])} {student.tokens[i]!r} ({int(s_starts[k])},{int(s_ends[k])}){loss}"

    parts: list[str] = []
    open_box: int | None = None
    for p in range(len(pieces)):
        a, b = int(pieces.starts[p]), int(pieces.ends[p])
        box = min(s_cover[p]) if s_cover[p] else None
        if box != open_box:
            if open_box is not None:
                parts.append("</span>")
            if box is not None:
                parts.append(f'<span class="s" title="{_e(student_note(box))}">')
            open_box = box
        notes = [teacher_note(j) for j in t_cover[p]] or ["no teacher token"]
        notes += [student_note(k) for k in s_cover[p]]
        mark = " ts" if a in teacher_starts else ""
        parts.append(f'<span class="{_cls(int(buckets[p]))}{mark}" title="{_e(chr(10).join(notes))}">{_e(text[a:b])}</span>')
    if open_box is not None:
        parts.append("</span>")

    rows = [("document", f"{record.doc_id} ({record.file} row {record.row})"),
            ("teacher tokens", f"{len(record):,}; mean loss {np.nanmean(record.losses):.4f}" if len(record) and np.isfinite(record.losses).any() else f"{len(record):,}"),
            ("characters", f"{len(record.text):,}" + (f" (first {max_chars:,} shown)" if len(record.text) > max_chars else ""))]
    if student is not None:
        rows.append(("student", f"{student.name}: {len(student.encoding):,} tokens, boxed"))
        if student.teacher_loss is not None and len(student.encoding):
            rows.append(("mapped", f"{100 * np.mean(~np.isnan(student.teacher_loss)):.2f}% of student tokens"))
    title = heading or record.doc_id
    return f"<h2>{_e(title)}</h2>\n{_meta_table(rows)}\n<div class=\"doc\">{''.join(parts)}</div>\n"


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
