"""pipeline.method.guided_loss: selection counts, gradients, baselines, ranking scope."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.method.guided_loss import SelectionConfig, guided_loss, k_for

NAN = float("nan")


def hand_batch():
    """One sequence of 6 positions; position 5 ignored, position 4 unmapped.

    l_s = [2, 1, 4, 3, 5, 9], L_t = [1, 1, 1, 2, nan, 0] -> D over mapped valid = [1, 0, 3, 1].
    """
    token_loss = torch.tensor([[2.0, 1.0, 4.0, 3.0, 5.0, 9.0]], requires_grad=True)
    labels = torch.tensor([[1, 1, 1, 1, 1, -100]])
    teacher = torch.tensor([[1.0, 1.0, 1.0, 2.0, NAN, 0.0]])
    mapped = torch.tensor([[True, True, True, True, False, True]])
    return token_loss, labels, teacher, mapped


def test_hand_example_include_and_exclude():
    token_loss, labels, teacher, mapped = hand_batch()
    # 4 mapped valid tokens, ratio 0.4 -> k = ceil(1.6) = 2: D = 3 (pos 2) and the tie D = 1
    # between pos 0 and pos 3 goes to the earlier position.
    loss, stats = guided_loss(token_loss, labels, teacher, mapped, SelectionConfig(ratio=0.4))
    assert int(stats.n_selected) == 2 and int(stats.n_kept) == 3  # + unmapped pos 4
    assert loss.item() == pytest.approx((4.0 + 2.0 + 5.0) / 3)
    assert int(stats.n_valid) == 5 and int(stats.n_mapped) == 4
    assert float(stats.kept_fraction) == pytest.approx(3 / 5)
    assert float(stats.teacher_loss_kept) == pytest.approx(1.0)  # pos 2, 0
    assert float(stats.teacher_loss_dropped) == pytest.approx(1.5)  # pos 1, 3
    assert float(stats.excess_loss) == pytest.approx((1 + 0 + 3 + 1) / 4)
    assert float(stats.loss_all) == pytest.approx((2 + 1 + 4 + 3 + 5) / 5)

    config = SelectionConfig(ratio=0.4, unmapped="exclude")
    loss, stats = guided_loss(token_loss, labels, teacher, mapped, config)
    assert int(stats.n_kept) == 2
    assert loss.item() == pytest.approx((4.0 + 2.0) / 2)

    loss.backward()
    assert token_loss.grad.tolist() == [[0.5, 0.0, 0.5, 0.0, 0.0, 0.0]]


def test_k_is_a_ceiling_robust_to_float_error():
    n = torch.tensor([0, 1, 2, 3, 10, 11])
    assert k_for(n, 0.4).tolist() == [0, 1, 1, 2, 4, 5]
    assert k_for(torch.tensor([10, 100]), 0.7).tolist() == [7, 70]  # 0.7 * 10 = 7.000000000000001
    assert k_for(torch.tensor([5]), 1.0).tolist() == [5]


def test_mapped_flag_with_nan_teacher_loss_counts_as_unmapped():
    token_loss, labels, teacher, mapped = hand_batch()
    mapped[0, 4] = True  # L_t is NaN there
    _, stats = guided_loss(token_loss, labels, teacher, mapped, SelectionConfig())
    assert int(stats.n_mapped) == 4 and int(stats.n_kept) == 3


def random_batch(seed=0, batch=3, length=7, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    labels[0, :2] = -100
    teacher = torch.rand(batch, length, generator=gen) * 3
    mapped = torch.rand(batch, length, generator=gen) > 0.3
    teacher[~mapped] = NAN
    return logits, labels, teacher, mapped


def test_cpt_equals_mean_cross_entropy():
    logits, labels, teacher, mapped = random_batch()
    loss, stats = guided_loss(logits, labels, teacher, mapped, SelectionConfig(mode="cpt"))
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    torch.testing.assert_close(loss, expected)
    assert int(stats.n_kept) == int((labels != -100).sum())
    loss_no_teacher, _ = guided_loss(logits, labels, config=SelectionConfig(mode="cpt"))
    torch.testing.assert_close(loss_no_teacher, expected)


def test_cpt_statistics_call_every_trained_token_kept():
    """cpt trains every token: every mapped one counts as selected (none dropped), so the teacher
    loss of the kept tokens is the mean over the mapped valid ones, and nothing is dropped."""
    logits, labels, teacher, mapped = random_batch()
    _, stats = guided_loss(logits, labels, teacher, mapped, SelectionConfig(mode="cpt"))
    candidates = (labels != -100) & mapped
    assert float(stats.kept_fraction) == 1.0
    assert int(stats.n_selected) == int(candidates.sum()) == int(stats.n_mapped)
    torch.testing.assert_close(stats.teacher_loss_kept, teacher[candidates].mean())
    assert math.isnan(float(stats.teacher_loss_dropped))  # no token dropped


def test_per_token_loss_input_equals_logits_input():
    logits, labels, teacher, mapped = random_batch()
    token_loss = F.cross_entropy(
        logits.transpose(1, 2), labels, reduction="none", ignore_index=-100
    )  # (B, T)
    a, _ = guided_loss(logits, labels, teacher, mapped)
    b, _ = guided_loss(token_loss, labels, teacher, mapped)
    torch.testing.assert_close(a, b)


def test_bf16_logits_give_float32_loss():
    logits, labels, teacher, mapped = random_batch()
    loss, _ = guided_loss(logits.detach().bfloat16(), labels, teacher, mapped)
    assert loss.dtype == torch.float32


@pytest.mark.parametrize("unmapped", ["include", "exclude"])
def test_gradient_only_on_kept_rows(unmapped):
    logits, labels, teacher, mapped = random_batch()
    config = SelectionConfig(unmapped=unmapped)
    loss, stats = guided_loss(logits, labels, teacher, mapped, config)
    loss.backward()
    row_has_grad = logits.grad.abs().sum(dim=-1) > 0  # (B, T)
    valid = labels != -100
    candidates = mapped & valid
    n_mapped = int(candidates.sum())
    expected_kept = math.ceil(0.4 * n_mapped) + (int((valid & ~mapped).sum()) if unmapped == "include" else 0)
    assert int(row_has_grad.sum()) == int(stats.n_kept) == expected_kept
    assert torch.all(logits.grad[~row_has_grad] == 0)
    assert not torch.any(row_has_grad & ~valid)
    if unmapped == "exclude":
        assert not torch.any(row_has_grad & ~mapped)


def test_random_mode_keeps_k_and_is_reproducible():
    logits, labels, teacher, mapped = random_batch(batch=4, length=16)
    n_mapped = int((mapped & (labels != -100)).sum())
    config = SelectionConfig(mode="random", unmapped="exclude")
    picks = []
    for seed in (7, 7, 8):
        loss, stats = guided_loss(
            logits, labels, teacher, mapped, config, torch.Generator().manual_seed(seed)
        )
        assert int(stats.n_selected) == int(stats.n_kept) == math.ceil(0.4 * n_mapped)
        (grad,) = torch.autograd.grad(loss, logits)
        picks.append(grad.abs().sum(-1) > 0)
    assert torch.equal(picks[0], picks[1])
    assert not torch.equal(picks[0], picks[2])
    assert not torch.any(picks[0] & ~mapped)


def test_sequence_ranking_differs_from_batch_ranking():
    # Sequence 0 has all the large excess losses; batch ranking takes only from it.
    token_loss = torch.tensor([[9.0, 8.0, 7.0, 6.0], [1.0, 1.5, 2.0, 2.5]], requires_grad=True)
    labels = torch.zeros(2, 4, dtype=torch.long)
    teacher = torch.zeros(2, 4)
    mapped = torch.ones(2, 4, dtype=torch.bool)
    batch_cfg = SelectionConfig(ratio=0.5, rank_over="batch")
    seq_cfg = SelectionConfig(ratio=0.5, rank_over="sequence")
    loss_b, stats_b = guided_loss(token_loss, labels, teacher, mapped, batch_cfg)
    loss_s, stats_s = guided_loss(token_loss, labels, teacher, mapped, seq_cfg)
    assert int(stats_b.n_kept) == int(stats_s.n_kept) == 4
    assert loss_b.item() == pytest.approx((9 + 8 + 7 + 6) / 4)
    assert loss_s.item() == pytest.approx((9 + 8 + 2.5 + 2.0) / 4)


def test_nothing_kept_gives_connected_zero():
    logits, labels, teacher, mapped = random_batch()
    labels[:] = -100
    loss, stats = guided_loss(logits, labels, teacher, mapped)
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.all(logits.grad == 0)
    assert int(stats.n_kept) == 0 and math.isnan(stats.to_dict()["loss_all"])

    logits, labels, teacher, mapped = random_batch()
    mapped[:] = False
    loss, stats = guided_loss(logits, labels, teacher, mapped, SelectionConfig(unmapped="exclude"))
    assert loss.item() == 0.0 and loss.grad_fn is not None


def test_invalid_config_is_refused():
    for kwargs in ({"mode": "rho"}, {"ratio": 0.0}, {"ratio": 1.5}, {"rank_over": "doc"},
                   {"unmapped": "drop"}):
        with pytest.raises(ValueError):
            SelectionConfig(**kwargs)
    token_loss, labels, _, _ = hand_batch()
    with pytest.raises(ValueError, match="teacher_loss"):
        guided_loss(token_loss, labels)


@st.composite
def batches(draw):
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    n = batch * length
    floats = st.floats(0.0, 30.0, width=32)
    token_loss = draw(st.lists(floats, min_size=n, max_size=n))
    teacher = draw(st.lists(st.one_of(floats, st.just(NAN), st.just(math.inf)), min_size=n, max_size=n))
    mapped = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    valid = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    shape = (batch, length)
    return (
        torch.tensor(token_loss).view(shape).requires_grad_(),
        torch.where(torch.tensor(valid).view(shape), 0, -100),
        torch.tensor(teacher).view(shape),
        torch.tensor(mapped).view(shape),
    )


@settings(max_examples=200, deadline=None)
@given(
    data=batches(),
    mode=st.sampled_from(["guided", "random", "cpt"]),
    ratio=st.sampled_from([0.1, 0.4, 0.7, 1.0]),
    rank_over=st.sampled_from(["batch", "sequence"]),
    unmapped=st.sampled_from(["include", "exclude"]),
)
def test_property_kept_counts_and_finite_loss(data, mode, ratio, rank_over, unmapped):
    token_loss, labels, teacher, mapped = data
    config = SelectionConfig(mode=mode, ratio=ratio, rank_over=rank_over, unmapped=unmapped)
    loss, stats = guided_loss(
        token_loss, labels, teacher, mapped, config, torch.Generator().manual_seed(0)
    )
    valid = labels != -100
    candidates = valid & mapped & ~torch.isnan(teacher)  # (B, T)
    if mode == "cpt":
        expected = int(valid.sum())
    else:
        rows = candidates.sum(dim=1) if rank_over == "sequence" else candidates.sum().view(1)
        expected = sum(max(1, math.ceil(ratio * int(n) - 1e-6)) for n in rows if n > 0)
        assert int(stats.n_selected) == expected
        if unmapped == "include":
            expected += int((valid & ~candidates).sum())
    assert int(stats.n_kept) == expected
    assert math.isfinite(loss.item())
    if expected == 0:
        assert loss.item() == 0.0
    loss.backward()
    assert torch.all(token_loss.grad[~valid] == 0)
    assert int((token_loss.grad != 0).sum()) == expected
    if mode == "guided":  # exactly the brute-force selection is trained, each with weight 1/kept
        want = brute_force_trained(token_loss.detach(), valid, teacher, mapped, ratio, rank_over, unmapped)
        assert (token_loss.grad != 0).tolist() == want.tolist()
        if expected:
            torch.testing.assert_close(loss, token_loss.detach()[want].mean())


def brute_force_trained(token_loss, valid, teacher, mapped, ratio, rank_over, unmapped) -> torch.Tensor:
    """METHOD 2.2 by hand: per ranking group (the batch, or each sequence) sort the mapped valid
    tokens by excess loss l_s - L_t, largest first (ties: earlier position first, -inf last), keep
    the first ceil(ratio * n) (at least one), add the unmapped valid tokens when included."""
    batch, length = token_loss.shape
    positions = [(b, t) for b in range(batch) for t in range(length)]
    groups = [positions] if rank_over == "batch" else [positions[b * length:(b + 1) * length] for b in range(batch)]
    trained = torch.zeros(batch, length, dtype=torch.bool)
    for group in groups:
        candidates = [(b, t) for b, t in group if valid[b, t] and mapped[b, t] and not math.isnan(teacher[b, t])]
        excess = {(b, t): float(token_loss[b, t] - teacher[b, t]) for b, t in candidates}  # float32, as D
        ranked = sorted(candidates, key=lambda bt: (-excess[bt], bt))
        k = max(1, math.ceil(ratio * len(candidates) - 1e-6)) if candidates else 0
        for b, t in ranked[:k]:
            trained[b, t] = True
        if unmapped == "include":
            for b, t in group:
                if valid[b, t] and (b, t) not in excess:
                    trained[b, t] = True
    return trained


def test_tiny_ratio_still_keeps_one_token():
    assert k_for(torch.tensor([0, 1, 3, 1000]), 1e-7).tolist() == [0, 1, 1, 1]
