"""Alignment on real text with the real vocabulary pairs of the real-model study: SmolLM2's byte-level
BPE (the teacher) against stories260K's 512-token BPE with byte fallback, Llama-2's SentencePiece
(TinyLlama's) and Qwen2.5's byte-level BPE (students). Every student token's teacher tokens and
aggregated loss are checked against a brute-force reference over every pair of tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.method.alignment import align_document, align_spans
from pipeline.method.tokenization import encode, load_tokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    return load_tokenizer(str(smollm2_gguf))


@pytest.fixture(scope="module")
def students(stories260k, shared_tokenizers):
    return {"stories260k": load_tokenizer(str(stories260k)),
            "llama-2": load_tokenizer(str(shared_tokenizers / "ggml-vocab-llama-spm.gguf")),
            "qwen2.5": load_tokenizer(str(shared_tokenizers / "ggml-vocab-qwen2.gguf"))}


def brute_force(s, t, losses) -> tuple[list[set[int]], np.ndarray]:
    """Each student token's overlapping teacher tokens (every pair tried) and the max of their
    finite losses (NaN where none)."""
    sets, agg = [], np.full(len(s.ids), np.nan)
    for i, (c, d) in enumerate(zip(s.starts.tolist(), s.ends.tolist())):
        js = {j for j, (a, b) in enumerate(zip(t.starts.tolist(), t.ends.tolist())) if d > c and b > a and a < d and b > c}
        sets.append(js)
        finite = [losses[j] for j in js if not math.isnan(losses[j])]
        if finite:
            agg[i] = max(finite)
    return sets, agg


@pytest.mark.parametrize("student_name", ["stories260k", "llama-2", "qwen2.5"])
def test_alignment_on_real_text_equals_brute_force(smollm2_tokenizer, students, real_documents, student_name):
    rng = np.random.default_rng(0)
    mismatches, tokens, mapped = 0, 0, 0
    for text in real_documents:
        s, t = encode(students[student_name], text), encode(smollm2_tokenizer, text)
        losses = rng.gamma(2.0, 1.0, len(t.ids)).astype(np.float32)
        losses[0] = np.nan  # the first teacher token has no loss
        sets, want = brute_force(s, t, losses)
        lo, hi = align_spans(s.starts, s.ends, t.starts, t.ends)
        doc = align_document(s, t.starts, t.ends, losses, "max")
        for i in range(len(s.ids)):
            got_set = set(range(lo[i], hi[i])) if s.ends[i] > s.starts[i] else set()
            same_loss = (np.isnan(want[i]) and not doc.mapped[i]) or doc.teacher_loss[i] == np.float32(want[i])
            mismatches += (got_set != sets[i]) or not same_loss
        tokens += len(s.ids)
        mapped += int(doc.mapped.sum())
    assert mismatches == 0
    # every student token with characters has a teacher token with a loss, except at each text's start
    assert mapped >= tokens - 4 * len(real_documents)


def test_byte_fallback_student_splits_real_math_into_bytes(students, real_documents):
    """stories260K's vocabulary has little for LaTeX: real math falls back to byte pieces, one
    character each where it is ASCII, several sharing one character's span where it is not (the
    alignment above gives such tokens the same teacher tokens)."""
    tok = students["stories260k"]
    byte_pieces, pieces, shared = 0, 0, 0
    for text in real_documents:
        enc = encode(tok, text)
        names = tok.convert_ids_to_tokens(enc.ids.tolist())
        for name, a, b in zip(names, enc.starts.tolist(), enc.ends.tolist()):
            if name.startswith("<0x"):
                byte_pieces += 1
                assert b - a == 1, (name, text[a:b])  # one character, whatever its bytes
                if ord(text[a]) > 127:
                    shared += 1
        pieces += len(names)
    assert byte_pieces > 0.03 * pieces
    assert shared >= 2  # a character of several bytes: several pieces, one span
