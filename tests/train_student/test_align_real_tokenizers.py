"""pipeline.method.alignment on the project's real tokenizers (see ../shared/tokenizers/README.md).

Student: TinyLlama / Llama-2 SentencePiece. Teachers: Qwen2.5 and DeepSeekMath (byte-level BPE)
and Mistral (its own SentencePiece). Each tokenizer is loaded once per session (Qwen2's GGUF
takes ~10 s).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.method.alignment import align_document, align_spans, alignment_quality, overlap_pairs
from pipeline.method.tokenization import encode

TOKENIZERS = Path(__file__).resolve().parents[2].parent / "shared" / "tokenizers"
pytestmark = pytest.mark.skipif(
    not TOKENIZERS.is_dir(), reason=f"real tokenizer vocabularies not found at {TOKENIZERS}"
)

STUDENT = "ggml-vocab-llama-spm.gguf"
TEACHERS = {
    "qwen2": "ggml-vocab-qwen2.gguf",
    "deepseek": "ggml-vocab-deepseek-llm.gguf",
    "mistral": "mistral-v1.tokenizer.model",
}

TEXTS = [
    "Let $f(x) = \\frac{x^2+1}{\\sqrt{x}}$ and $\\mathbb{R}^n$, so $\\int_0^1 f\\,dx \\leq 𝔽$.",
    "Hi 🙂! Family: 👨\u200d👩\u200d👧\u200d👦, flags 🇫🇷🇯🇵, thumbs 👍🏽.",
    "中文数学：设 x² + y² = 1，求最大值。日本語のテキスト。",
    "line one\r\nline two\n\nparagraph\n\n\n  indented    runs   of spaces\t\ttabs ",
    "Special strings as text: <s> </s> <unk> <|endoftext|> <|im_start|>user<|im_end|>",
    "  leading spaces, e\u0301 combining, ﬁ ligature, ｆｕｌｌ width, 𝕊𝕥𝕣 math letters",
    "🙂 starts with an emoji\n",
]


@pytest.fixture(scope="session")
def student(real_tokenizer):
    return real_tokenizer("llama-spm")


@pytest.fixture(scope="session")
def teachers(real_tokenizer):
    return {name: real_tokenizer(name) for name in TEACHERS}


def brute_force_pairs(s, t) -> set[tuple[int, int]]:
    return {
        (i, j)
        for i, (c, d) in enumerate(zip(s.starts.tolist(), s.ends.tolist()))
        if d > c
        for j, (a, b) in enumerate(zip(t.starts.tolist(), t.ends.tolist()))
        if b > a and a < d and b > c
    }


def spans_of(tokenizer, text: str, piece: str):
    """Spans of the tokens whose string is ``piece``."""
    enc = encode(tokenizer, text)
    tokens = tokenizer.convert_ids_to_tokens(enc.ids.tolist())
    return [(int(a), int(b)) for tok, a, b in zip(tokens, enc.starts, enc.ends) if tok == piece]


@pytest.mark.parametrize("teacher_name", list(TEACHERS))
def test_alignment_with_real_teachers(student, teachers, teacher_name):
    teacher = teachers[teacher_name]
    rng = np.random.default_rng(0)
    for text in TEXTS:
        s, t = encode(student, text), encode(teacher, text)
        # Real tokenizers: starts and ends both non-decreasing, so ranges are exact.
        for enc in (s, t):
            assert np.all(np.diff(enc.starts) >= 0) and np.all(np.diff(enc.ends) >= 0)
        lo, hi = align_spans(s.starts, s.ends, t.starts, t.ends)
        range_pairs = {(i, j) for i in range(len(s)) for j in range(lo[i], hi[i])}
        owner, j = overlap_pairs(s.starts, s.ends, t.starts, t.ends)
        assert range_pairs == set(zip(owner.tolist(), j.tolist())) == brute_force_pairs(s, t)

        losses = rng.uniform(0.1, 8.0, size=len(t))
        doc = align_document(s, t.starts, t.ends, losses, "max")
        non_empty = s.ends > s.starts
        assert np.array_equal(doc.mapped, non_empty), text  # finite losses: all mapped

        q = alignment_quality(s.starts, s.ends, t.starts, t.ends, mapped=doc.mapped)
        assert np.all(q.ios[doc.mapped] == 1.0), text
        assert q.iou == 1.0, text

        # A NaN teacher loss (e.g. the first token, no left context) unmaps only tokens
        # whose every teacher token is NaN.
        losses[0] = np.nan
        doc = align_document(s, t.starts, t.ends, losses, "mean")
        only_first = [i for i in range(len(s)) if set(range(lo[i], hi[i])) == {0}]
        assert set(np.flatnonzero(~doc.mapped & non_empty).tolist()) == set(only_first)


def test_same_tokenizer_is_one_to_one(student):
    for text in TEXTS:
        s = encode(student, text)
        losses = np.arange(len(s), dtype=np.float64)
        doc = align_document(s, s.starts, s.ends, losses, "max", one_to_one=True)
        np.testing.assert_array_equal(doc.teacher_loss, losses.astype(np.float32))
        # Plain overlap is one-to-one exactly for the tokens whose span no other token shares.
        lo, hi = align_spans(s.starts, s.ends, s.starts, s.ends)
        spans = list(zip(s.starts.tolist(), s.ends.tolist()))
        unique = np.array([spans.count(sp) == 1 for sp in spans])
        assert np.all(lo[unique] == np.flatnonzero(unique)) and np.all(hi[unique] - lo[unique] == 1)
        assert np.all(hi[~unique] - lo[~unique] > 1)


def test_llama_offset_quirks(student):
    # The first word's virtual leading space has no source character; later ones include it.
    assert spans_of(student, "Let the world", "▁Let") == [(0, 3)]
    assert spans_of(student, "Let the world", "▁world") == [(7, 13)]
    # Byte-fallback pieces of one character all carry that character's span.
    enc = encode(student, "I am happy 🙂")
    assert len(enc) >= 4 and enc.starts[-4:].tolist() == [11] * 4 and enc.ends[-4:].tolist() == [12] * 4
    # Special-token strings stay text: non-empty spans that cover them.
    enc = encode(student, "a </s> b")
    assert np.all(enc.ends > enc.starts)


@pytest.mark.parametrize("teacher_name", ["qwen2", "deepseek"])
def test_byte_level_split_characters_overlap(teachers, teacher_name):
    # A character split across byte-level tokens: the token ending inside it and the next
    # token share it, e.g. ' 👨' (31, 33) then '👨' (32, 33). Starts go back, ends do not.
    enc = encode(teachers[teacher_name], TEXTS[1])
    overlapping = np.flatnonzero(enc.starts[1:] < enc.ends[:-1])
    assert overlapping.size > 0
    assert np.all(np.diff(enc.ends) >= 0)
    # ' 🙂' is one token spanning a space and an emoji (characters 2..4 of "Hi 🙂!").
    assert (2, 4) in list(zip(enc.starts.tolist(), enc.ends.tolist()))


REAL = ["llama-spm", "qwen2", "deepseek", "mistral"]


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype == np.float32 and np.array_equal(x.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("student_name", REAL)
def test_batched_fast_path_equals_align_document_on_real_tokenizers(real_tokenizer, student_name):
    """Every real tokenizer pair takes align_documents' fast path (no document falls back) and
    gets align_document's losses bit for bit, with NaN losses and a teacher BOS (0, 0) span."""
    from pipeline.method.alignment import _SharedLine, align_documents
    from pipeline.method.tokenization import encode_batch

    texts = [*TEXTS, "", " ", TEXTS[0] * 3]
    student = encode_batch(real_tokenizer(student_name), texts)
    rng = np.random.default_rng(1)
    for teacher_name in [n for n in REAL if n != student_name]:
        spans = []
        for k, t in enumerate(encode_batch(real_tokenizer(teacher_name), texts)):
            starts, ends = t.starts, t.ends
            if k % 2:  # a teacher whose tokenizer adds BOS stores it with an empty span first
                starts, ends = np.r_[np.int32(0), starts], np.r_[np.int32(0), ends]
            losses = rng.gamma(2.0, 1.0, starts.size).astype(np.float32)
            losses[rng.random(starts.size) < 0.15] = np.nan
            spans.append((starts, ends, losses))
        assert _SharedLine.of(student, spans).non_monotone_documents().size == 0
        for how in ("max", "mean", "min"):
            for s, t, got in zip(student, spans, align_documents(student, spans, how)):
                want = align_document(s, *t, how)
                assert same_bits(got.teacher_loss, want.teacher_loss), (student_name, teacher_name, how)
                assert np.array_equal(got.mapped, want.mapped)
