"""The HTML page: document text escaped (``<script>`` renders as text), every character shown once
and in order, student boundaries as boxes, losses in tooltips; the loss colour scale."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest

from pipeline.inspection.align_report import align_record
from storage_schemas.reader import DocumentRecord
from pipeline.inspection.html import StudentView, document_section, page
from pipeline.inspection.pieces import PALETTE, LossScale, cut_pieces
from pipeline.method.tokenization import encode

HOSTILE = ('<script>alert("x")</script> & <b>bold</b> "quotes" \'single\' </div></span>\n'
           "emoji 🙂 family 👨\u200d👩\u200d👧 中文 x² ≤ ∞\n\n  spaces  & &amp; &lt;")


@pytest.fixture(scope="module")
def record(real_tokenizer) -> DocumentRecord:
    """The hostile text tokenized by a real teacher tokenizer (Mistral: byte-fallback pieces share
    a span), with made-up losses and the first one NaN."""
    enc = encode(real_tokenizer("mistral"), HOSTILE)
    losses = np.linspace(0.1, 9.0, len(enc)).astype(np.float32)
    losses[0] = np.nan
    return DocumentRecord("doc:<script>", HOSTILE, enc.ids, enc.starts, enc.ends, losses, "shard-000000.parquet", 0)


@pytest.fixture(scope="module")
def student_view(record, real_tokenizer) -> StudentView:
    tok = real_tokenizer("llama-spm")
    enc = encode(tok, record.text)
    aligned = align_record(record, enc)
    return StudentView("llama-spm", enc, tok.convert_ids_to_tokens(enc.ids.tolist()), aligned.teacher_loss)


def doc_div(fragment: str) -> str:
    return re.search(r'<div class="doc">(.*)</div>', fragment, re.S).group(1)


def visible_text(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


@pytest.mark.parametrize("with_student", [False, True])
def test_document_text_is_escaped_and_shown_once_in_order(record, student_view, with_student):
    scale = LossScale.from_values(record.losses)
    fragment = document_section(record, scale, student_view if with_student else None)
    out = page("title <script>", [fragment], scale, [("dataset", "<i>x</i>")])
    assert "<script" not in out.lower()
    assert "<h2>doc:&lt;script&gt;</h2>" in out and "<title>title &lt;script&gt;</title>" in out
    assert "<i>x</i>" not in out and "&lt;i&gt;x&lt;/i&gt;" in out
    assert visible_text(doc_div(fragment)) == HOSTILE
    for title in re.findall(r'title="([^"]*)"', out):
        assert "<" not in title and ">" not in title
    assert out.startswith("<!DOCTYPE html>") and "http" not in out  # self-contained


def test_student_boundaries_are_boxes_with_losses_in_tooltips(record, student_view):
    scale = LossScale.from_values(record.losses)
    markup = doc_div(document_section(record, scale, student_view))
    boxes = re.findall(r'<span class="s" title="([^"]*)">(.*?)</span></span>', markup, re.S)
    # one box per student span (byte-fallback pieces of one character share theirs)
    spans = set(zip(student_view.encoding.starts.tolist(), student_view.encoding.ends.tolist()))
    assert len(boxes) == len(spans) < len(student_view.encoding)
    first = html.unescape(boxes[0][0])
    assert first.startswith("student #0 id ") and "L_t(max)" in first
    titles = [html.unescape(t) for t in re.findall(r'title="([^"]*)"', markup)]
    assert any("teacher #0 " in t and "loss nan" in t for t in titles)
    assert any(re.search(r"teacher #\d+ id \d+ '🙂'|teacher #\d+ id \d+ '.*' \(\d+,\d+\) loss", t) for t in titles)
    pieces = cut_pieces(len(record.text), record.starts, record.ends, record.losses,
                        (student_view.encoding.starts, student_view.encoding.ends))
    assert markup.count('<span class="q') == len(pieces)


def test_loss_scale_buckets():
    losses = np.arange(100, dtype=np.float64)
    scale = LossScale.from_values(losses)
    buckets = scale.bucket(np.r_[losses, np.nan, np.inf])
    assert buckets[-2] == buckets[-1] == -1
    counts = np.bincount(buckets[:-2], minlength=len(PALETTE))
    assert counts.tolist() == [10] * len(PALETTE)
    assert len(scale.labels()) == len(PALETTE)
