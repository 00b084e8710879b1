"""The warm study's endpoints (repro/endpoints.py) against references computed here: per-token losses
against one plain forward, the bytes of tokens that share a span, and the easy / hard / answer parts
against a brute force over every pair of student and teacher tokens."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from repro.endpoints import TeacherDocument, measure, token_bytes


def test_tokens_that_share_a_span_share_its_bytes():
    # "a∮b": ∮ is three UTF-8 bytes, spelled by three byte pieces that each carry its span (1, 2)
    starts, ends = np.array([0, 1, 1, 1, 2]), np.array([1, 2, 2, 2, 3])
    assert token_bytes("a∮b", starts, ends).tolist() == [1, 1, 1, 1, 1]
    # a leading virtual space (empty span) has no byte; "é" is two bytes in one token
    assert token_bytes("é x", np.array([0, 0, 1]), np.array([0, 1, 3])).tolist() == [0, 2, 2]


@pytest.fixture(scope="module")
def texts():
    return ["Let x be a real number with x^2 = 4.\n\nThen x = 2 or x = -2, and ∮ f = 0.",
            "A ring R is local if it has exactly one maximal ideal; every field is local."]


def test_token_losses_equal_one_plain_forward(tiny_student, texts):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.method.bits_per_byte import first_token, text_losses, token_losses

    tok = AutoTokenizer.from_pretrained(tiny_student)
    model = AutoModelForCausalLM.from_pretrained(tiny_student)
    got = token_losses(model, tok, texts, window=63)
    sums = text_losses(model, tok, texts, window=63)
    for text, t, s in zip(texts, got, sums):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) < 63  # one block: the reference is one forward over [first, *ids]
        x = torch.tensor([[first_token(tok), *ids]])
        with torch.no_grad():
            ref = F.cross_entropy(model(input_ids=x).logits[0, :-1].float(), x[0, 1:], reduction="none")
        assert t.nats == pytest.approx(ref.double().numpy(), abs=1e-5)
        assert t.ids.tolist() == ids and math.isclose(t.nats.sum(), s.nats, rel_tol=1e-9)
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        assert list(zip(t.starts.tolist(), t.ends.tolist())) == [tuple(o) for o in offsets]
    # windows of 7: many blocks, each token still predicted once
    short = token_losses(model, tok, texts, window=7)
    assert [len(t.nats) for t in short] == [len(t.nats) for t in got]


def test_the_parts_equal_a_brute_force_over_token_pairs(tiny_student, texts, tmp_path):
    """Teacher tokens: the words and spaces of each text with made-up losses (one NaN, as the first
    token of a document has); the easy / hard / answer sums by brute force over every student and
    teacher token pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.method.bits_per_byte import token_losses

    rng = np.random.default_rng(0)
    teacher = {}
    for text in texts:
        spans = [m.span() for m in re.finditer(r"\S+|\s+", text)]
        losses = rng.exponential(2.0, len(spans))
        losses[0] = np.nan
        teacher[text] = TeacherDocument(np.array([a for a, _ in spans]), np.array([b for _, b in spans]), losses)
    threshold = float(np.nanmedian(np.concatenate([d.losses for d in teacher.values()])))
    rows = [{"text": texts[0], "origin": "gsm8k"}, {"text": texts[1], "origin": "stacks"}]
    got = measure(str(tiny_student), rows, teacher, threshold, window=63)

    model = AutoModelForCausalLM.from_pretrained(tiny_student)
    per = token_losses(model, AutoTokenizer.from_pretrained(tiny_student), texts, window=63)
    want = {"easy": [0.0, 0.0], "hard": [0.0, 0.0], "unmapped": [0.0, 0.0], "answers": [0.0, 0]}
    for text, t in zip(texts, per):
        doc = teacher[text]
        spans = list(zip(t.starts.tolist(), t.ends.tolist()))
        for i, (c, d) in enumerate(spans):
            over = [doc.losses[j] for j in range(len(doc.losses)) if doc.starts[j] < d and doc.ends[j] > c]
            over = [x for x in over if not np.isnan(x)]
            part = "unmapped" if d <= c or not over else ("easy" if max(over) <= threshold else "hard")
            share = len(text[c:d].encode()) / spans.count((c, d))
            want[part][0] += t.nats[i]
            want[part][1] += share
        if text is texts[0]:
            start = text.index("\n\n") + 2
            want["answers"][0] += sum(n for n, (c, _) in zip(t.nats, spans) if c >= start)
            want["answers"][1] = len(text[start:].encode())
    for name, key in (("easy", "teacher_easy"), ("hard", "teacher_hard"), ("unmapped", "unmapped"),
                      ("answers", "gsm8k_answers")):
        assert got[key]["nats"] == pytest.approx(want[name][0], rel=1e-9)
        assert got[key]["bytes"] == pytest.approx(want[name][1], rel=1e-9)
        assert got[key]["bits_per_byte"] == pytest.approx(want[name][0] / math.log(2) / want[name][1], rel=1e-9)
    assert got["teacher_easy"]["tokens"] > 0 and got["teacher_hard"]["tokens"] > 0
    total = sum(len(t.encode()) for t in texts)
    assert got["bytes"] == total and got["bits_per_byte"] == pytest.approx(sum(t.nats.sum() for t in per) / math.log(2) / total)
