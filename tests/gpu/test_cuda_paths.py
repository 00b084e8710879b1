"""The CUDA paths of the method against independent references computed on the CPU (``pytest -m gpu``;
skipped where there is no CUDA device). They need only torch, transformers and pytest, so they run
on a bare GPU machine: the teacher's per-token losses from the scorer on the GPU against a float64
log-softmax of the same weights on the CPU, in float32 and in bfloat16, with padded batches of
windows of several lengths; the guided loss's selection on the GPU against the brute-force
selection of METHOD §2.2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def tiny_llama(vocab: int = 300, seed: int = 0):
    """A random Llama whose weights are large enough that each loss depends clearly on its context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def reference_window_losses(model, window: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[next token] in float64 on the CPU, NaN at position 0."""
    cpu = type(model)(model.config).double().eval()
    cpu.load_state_dict({k: v.detach().double().cpu() for k, v in model.state_dict().items()})
    with torch.no_grad():
        logits = cpu(input_ids=torch.tensor(window, dtype=torch.long)[None]).logits[0]  # (T, V) float64
    logp = torch.log_softmax(logits, dim=-1)
    out = np.full(len(window), np.nan)
    out[1:] = -logp[torch.arange(len(window) - 1), torch.tensor(window[1:])].numpy()
    return out


@pytest.fixture(scope="module")
def windows():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 300, n, dtype=np.int64) for n in (200, 37, 128, 2, 199, 64)]


# bfloat16: its rounding of weights and activations moves a loss by ~0.03 nats on average on this
# model (0.25 at most), measured on a CPU; a wrong context or padding moves it by nats
@pytest.mark.parametrize("dtype,max_abs,mean_abs", [("float32", 2e-4, 2e-5), ("bfloat16", 0.5, 0.06)])
def test_scorer_on_cuda_equals_a_float64_reference(windows, dtype, max_abs, mean_abs):
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer

    model = tiny_llama()
    references = [reference_window_losses(model, w) for w in windows]
    gpu_model = model.to("cuda", getattr(torch, dtype))
    # a small token budget: several padded batches of mixed lengths; a small logits budget: many head chunks
    scorer = TransformersScorer(ScorerConfig(dtype=dtype, device="cuda", window=256, max_batch_tokens=400,
                                             max_logits_bytes=4 * 300 * 50), model=gpu_model)
    got = scorer.score(windows)
    for w, g, ref in zip(windows, got, references):
        assert g.dtype == np.float32 and g.shape == (len(w),)
        assert np.isnan(g[0]) and np.isfinite(g[1:]).all()
        assert np.abs(g[1:] - ref[1:]).max() < max_abs, (dtype, len(w), np.abs(g[1:] - ref[1:]).max())
    all_got = np.concatenate([g[1:] for g in got])
    all_ref = np.concatenate([r[1:] for r in references])
    assert all_ref.std() > 0.3, "the reference's losses vary, so a wrong context would show"
    assert np.abs(all_got - all_ref).mean() < mean_abs


def brute_force_trained(token_loss, valid, teacher, ratio: float) -> torch.Tensor:
    """METHOD §2.2 by hand, ranked over the batch: the mapped valid tokens sorted by excess loss
    l_s - L_t, largest first (ties: earlier position first), the first ceil(ratio * n) kept; unmapped
    valid tokens are always trained (``unmapped=include``)."""
    batch, length = token_loss.shape
    candidates = [(b, t) for b in range(batch) for t in range(length)
                  if valid[b, t] and not math.isnan(teacher[b, t])]
    excess = {bt: float(token_loss[bt] - teacher[bt]) for bt in candidates}
    ranked = sorted(candidates, key=lambda bt: (-excess[bt], bt))
    trained = torch.zeros(batch, length, dtype=torch.bool)
    for bt in ranked[:max(1, math.ceil(ratio * len(candidates) - 1e-6))]:
        trained[bt] = True
    for b in range(batch):
        for t in range(length):
            if valid[b, t] and math.isnan(teacher[b, t]):
                trained[b, t] = True
    return trained


def test_guided_selection_on_cuda_equals_the_brute_force_one():
    from pipeline.method.guided_loss import SelectionConfig, guided_loss

    g = torch.Generator().manual_seed(5)
    shape = (3, 50)
    token_loss = (torch.rand(shape, generator=g) * 6).cuda().requires_grad_(True)
    teacher = torch.rand(shape, generator=g) * 6
    teacher[torch.rand(shape, generator=g) < 0.2] = float("nan")  # unmapped
    valid = torch.rand(shape, generator=g) > 0.1
    loss, stats = guided_loss(token_loss, None, teacher.cuda(), None, SelectionConfig(mode="guided", ratio=0.4),
                              valid=valid.cuda())
    loss.backward()
    want = brute_force_trained(token_loss.detach().cpu(), valid, teacher, 0.4)
    assert (token_loss.grad.cpu() != 0).tolist() == want.tolist()
    torch.testing.assert_close(loss.detach().cpu(), token_loss.detach().cpu()[want].mean())
