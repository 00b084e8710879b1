"""The score taken apart (pipeline.method.guided_loss): ranking by the student's loss alone, by the
teacher's loss alone (lowest first), byte-fallback pieces kept out of the ranking, and the trainer's
trained / left metrics, each against selections worked by hand or counted by brute force."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from pipeline.method.guided_loss import SelectionConfig, guided_loss
from pipeline.method.tokenization import byte_fallback_ids, load_tokenizer

NAN = float("nan")


def hand_batch():
    """One sequence of 7 positions; position 6 ignored, position 4 unmapped.

    l_s = [2, 1, 4, 3, 5, 0.5, 9], L_t = [1, 0.2, 3.5, 2, nan, 0.1, 0]; the 5 mapped valid tokens are
    positions 0, 1, 2, 3, 5; k = ceil(0.4 * 5) = 2.
    """
    token_loss = torch.tensor([[2.0, 1.0, 4.0, 3.0, 5.0, 0.5, 9.0]], requires_grad=True)
    labels = torch.tensor([[1, 1, 1, 1, 1, 1, -100]])
    teacher = torch.tensor([[1.0, 0.2, 3.5, 2.0, NAN, 0.1, 0.0]])
    return token_loss, labels, teacher


def selected_positions(result) -> list[int]:
    return result.selected[0].nonzero().flatten().tolist()


def test_each_half_of_the_score_ranks_as_worked_by_hand():
    token_loss, labels, teacher = hand_batch()
    # excess D = l_s - L_t over the mapped: 1, 0.8, 0.5, 1, 0.4 -> the top 2: positions 0 and 3
    guided = guided_loss(token_loss, labels, teacher, config=SelectionConfig(mode="guided"))
    assert selected_positions(guided) == [0, 3]
    # the student's hardest: l_s 2, 1, 4, 3, 0.5 -> positions 2 and 3
    student = guided_loss(token_loss, labels, teacher, config=SelectionConfig(mode="student_loss"))
    assert selected_positions(student) == [2, 3]
    # the teacher's easiest: L_t 1, 0.2, 3.5, 2, 0.1 -> positions 5 and 1
    easy = guided_loss(token_loss, labels, teacher, config=SelectionConfig(mode="teacher_loss"))
    assert selected_positions(easy) == [1, 5]
    # the loss: the selected plus the unmapped position 4 (unmapped=include), mean of l_s
    assert easy.loss.item() == pytest.approx((1.0 + 0.5 + 5.0) / 3)
    assert student.loss.item() == pytest.approx((4.0 + 3.0 + 5.0) / 3)
    assert easy.trained[0].tolist() == [False, True, False, False, True, True, False]


def test_byte_pieces_out_of_the_ranking_are_treated_as_unmapped():
    token_loss, labels, teacher = hand_batch()
    byte_pieces = torch.tensor([[False, False, True, True, False, False, False]])  # positions 2 and 3
    cfg = SelectionConfig(mode="guided", byte_fallback="exclude")
    # candidates 0, 1, 5 (D 1, 0.8, 0.4), k = ceil(1.2) = 2 -> 0 and 1; trained: those, the byte
    # pieces 2 and 3 and the unmapped 4
    out = guided_loss(token_loss, labels, teacher, config=cfg, byte_pieces=byte_pieces)
    assert selected_positions(out) == [0, 1]
    assert out.trained[0].tolist() == [True, True, True, True, True, False, False]
    excluded = guided_loss(token_loss, labels, teacher, config=SelectionConfig(byte_fallback="exclude", unmapped="exclude"),
                           byte_pieces=byte_pieces)
    assert excluded.trained[0].tolist() == [True, True, False, False, False, False, False]
    with pytest.raises(ValueError, match="byte_pieces"):
        guided_loss(token_loss, labels, teacher, config=cfg)


@pytest.mark.parametrize("mode", ["student_loss", "teacher_loss", "guided"])
@pytest.mark.parametrize("rank_over", ["batch", "sequence"])
def test_the_selection_is_the_brute_force_top_k(mode, rank_over):
    """On random batches: the selected set is the top ceil(0.4 n) of the candidates by the mode's
    score (ties never occur with continuous losses), per sequence or over the batch."""
    gen = np.random.default_rng(3)
    for _ in range(20):
        l_s = gen.exponential(2.0, size=(3, 9))
        l_t = gen.exponential(1.0, size=(3, 9))
        l_t[gen.random((3, 9)) < 0.2] = np.nan
        byte = gen.random((3, 9)) < 0.25
        labels = np.where(gen.random((3, 9)) < 0.1, -100, 1)
        out = guided_loss(torch.tensor(l_s), torch.tensor(labels), torch.tensor(l_t),
                          config=SelectionConfig(mode=mode, rank_over=rank_over, byte_fallback="exclude"),
                          byte_pieces=torch.tensor(byte))
        score = {"student_loss": l_s, "teacher_loss": -l_t, "guided": l_s - l_t}[mode]
        expected = np.zeros((3, 9), dtype=bool)
        groups = [[(r, c) for r in range(3) for c in range(9)]] if rank_over == "batch" else \
            [[(r, c) for c in range(9)] for r in range(3)]
        for group in groups:
            cands = [p for p in group if labels[p] != -100 and not np.isnan(l_t[p]) and not byte[p]]
            k = math.ceil(0.4 * len(cands)) if cands else 0
            for p in sorted(cands, key=lambda p: -score[p])[:k]:
                expected[p] = True
        assert (out.selected.numpy() == expected).all()


def test_byte_fallback_pieces_of_real_tokenizers(shared_dir):
    """stories260K and Llama-2 spell bytes as <0x00>..<0xFF> (256 pieces); Qwen2's byte-level BPE has none."""
    for name, count in (("models/stories260K", 256), ("tokenizers/ggml-vocab-llama-spm.gguf", 256),
                        ("tokenizers/ggml-vocab-qwen2.gguf", 0)):
        path = shared_dir / name
        if not path.exists():
            pytest.skip(f"{path} is not in the shared folder")
        tok = load_tokenizer(str(path))
        table = byte_fallback_ids(tok)
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        assert int(table.sum()) == count
        assert sorted(p for p, b in zip(pieces, table) if b) == sorted(f"<0x{i:02X}>" for i in range(count))
        if count:  # a character outside the vocabulary is spelled in its UTF-8 bytes
            ids = tok("∮", add_special_tokens=False)["input_ids"]
            assert [pieces[i] for i in ids if table[i]] == ["<0xE2>", "<0x88>", "<0xAE>"]


@pytest.fixture(scope="module")
def shared_dir():
    from pathlib import Path

    return Path(__file__).resolve().parents[2].parent / "shared"


def test_the_trained_and_left_metrics_equal_a_count_by_hand():
    """GuidedTrainer's sums for the trained / left metrics (pipeline.train_student.trainer) on the
    hand batch with two byte pieces, against the values worked out by hand."""
    from pipeline.train_student.trainer import _trained_and_left

    token_loss, labels, teacher = hand_batch()
    byte_pieces = torch.tensor([[False, True, False, True, True, False, False]])
    out = guided_loss(token_loss, labels, teacher, config=SelectionConfig(mode="guided"), byte_pieces=byte_pieces)
    # trained: 0, 3 (selected) and 4 (unmapped); left: 1, 2, 5; position 6 ignored
    sums = [float(x) for x in _trained_and_left(out, teacher, byte_pieces)]
    n_left, l_s_left, n_tm, l_t_trained, n_lm, l_t_left, byte_t, byte_l = sums
    assert n_left == 3 and l_s_left == pytest.approx(1.0 + 4.0 + 0.5)
    assert n_tm == 2 and l_t_trained == pytest.approx(1.0 + 2.0)  # position 4 has no teacher loss
    assert n_lm == 3 and l_t_left == pytest.approx(0.2 + 3.5 + 0.1)
    assert byte_t == 2 and byte_l == 1  # positions 3, 4 trained; 1 left
