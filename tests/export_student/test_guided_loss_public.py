"""The public loss (pipeline.method.guided_loss) as another trainer calls it: the hand-worked example of
docs/METHOD.md §2.2, NaN teacher losses as the only sign of an unmapped token, a valid mask instead
of labels, logits against a float64 brute force, and the per-token masks it returns."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.method.guided_loss import GuidedLoss, SelectionConfig, guided_loss

NAN = float("nan")
# METHOD §2.2: targets ▁Thus ▁sq rt ( 4 9 )= 7 ▁ b1 b2 b3 b4 EOS
L_S = [6.0, 5.0, 0.5, 1.2, 3.1, 1.5, 0.7, 4.4, 7.0, 9.0, 0.2, 3.0, 0.1, 2.5]
L_T = [NAN, 4.2, 4.2, 0.3, 2.0, 1.1, 0.6, 0.9, 7.5, 7.5, 7.5, 7.5, 7.5, NAN]


@pytest.mark.parametrize("unmapped, mode, want_loss, want_kept", [
    ("include", "guided", (4.4 + 9.0 + 3.1 + 1.2 + 5.0 + 6.0 + 2.5) / 7, 7),  # 4.457
    ("exclude", "guided", 22.7 / 5, 5),  # 4.54
    ("include", "cpt", 44.2 / 14, 14),  # 3.157
])
def test_the_hand_worked_example_of_method_2_2(unmapped, mode, want_loss, want_kept):
    token_loss = torch.tensor([L_S], requires_grad=True)
    result = guided_loss(token_loss, torch.zeros(1, 14, dtype=torch.long), torch.tensor([L_T]),
                         config=SelectionConfig(mode=mode, unmapped=unmapped))
    assert isinstance(result, GuidedLoss)
    loss, stats = result  # unpacks as (loss, stats)
    assert loss.item() == pytest.approx(want_loss, abs=1e-5) and int(stats.n_kept) == want_kept
    if mode == "guided":  # ceil(0.4 * 12) = 5 selected: 7, b1, 4, (, ▁sq
        assert result.selected[0].nonzero().flatten().tolist() == [1, 3, 4, 7, 9]
        assert int(stats.n_mapped) == 12 and int(stats.n_selected) == 5


def test_a_valid_mask_stands_for_labels_with_per_token_losses():
    """Megatron's loss_mask as ``valid``: the same as -100 labels at the masked positions."""
    gen = torch.Generator().manual_seed(0)
    token_loss = torch.rand(3, 20, generator=gen) * 5
    teacher = torch.rand(3, 20, generator=gen) * 5
    teacher[torch.rand(3, 20, generator=gen) < 0.2] = NAN
    valid = torch.rand(3, 20, generator=gen) > 0.1
    labels = torch.where(valid, 7, -100)
    for config in (SelectionConfig(), SelectionConfig(rank_over="sequence", unmapped="exclude", ratio=0.25)):
        a = guided_loss(token_loss, None, teacher, config=config, valid=valid)
        b = guided_loss(token_loss, labels, teacher, ~torch.isnan(teacher), config)
        assert torch.equal(a.loss, b.loss) and a.stats.to_dict() == pytest.approx(b.stats.to_dict(), nan_ok=True)
        assert torch.equal(a.selected, b.selected)
    with pytest.raises(ValueError, match="labels"):
        guided_loss(token_loss, None, teacher)


def test_logits_against_a_float64_brute_force():
    """Cross-entropy from logits (float64 log-softmax by hand), the top ceil(0.4 n) mapped tokens of the
    micro-batch by l_s - L_t (ties: the earlier position), unmapped included, mean over the trained."""
    gen = torch.Generator().manual_seed(1)
    batch, length, vocab = 2, 12, 17
    logits = torch.randn(batch, length, vocab, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    labels[0, 0] = -100
    teacher = torch.rand(batch, length, generator=gen) * 4
    teacher[0, 3] = teacher[1, 5] = NAN
    loss, stats = guided_loss(logits, labels, teacher)

    flat = logits.detach().double()
    ls = {(b, t): float(torch.logsumexp(flat[b, t], 0) - flat[b, t, labels[b, t]])
          for b in range(batch) for t in range(length) if labels[b, t] != -100}
    mapped = [p for p in ls if not math.isnan(float(teacher[p]))]
    ranked = sorted(mapped, key=lambda p: (-(ls[p] - float(teacher[p])), p))
    trained = set(ranked[:math.ceil(0.4 * len(mapped))]) | {p for p in ls if p not in mapped}
    assert int(stats.n_kept) == len(trained) and int(stats.n_valid) == len(ls)
    assert loss.item() == pytest.approx(sum(ls[p] for p in trained) / len(trained), rel=1e-6)
    loss.backward()
    touched = {(b, t) for b in range(batch) for t in range(length) if logits.grad[b, t].abs().sum() > 0}
    assert touched == trained


def test_the_result_reads_as_the_loss_stats_pair_callers_used():
    result = guided_loss(torch.tensor([L_S]), torch.zeros(1, 14, dtype=torch.long), torch.tensor([L_T]))
    loss, stats = result
    assert result[0] is loss and result[1] is stats and len(result) == 2 and result[-1] is stats
