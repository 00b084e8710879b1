"""The vLLM backend end to end on a tiny model; runs only where vllm imports and a GPU exists."""

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vllm is an optional extra (its own environment, GPU)")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs a GPU")
def test_vllm_losses_match_transformers_on_full_length_windows(micro_teacher):
    """The micro teacher has 64 positions: the engine takes windows of 63 tokens (one position is
    left for the output token vLLM insists on); a full-length window and a short one are sent."""
    from transformers import AutoConfig

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer
    from pipeline.score_teacher.backends.vllm import VLLMScorer, engine_window

    positions = AutoConfig.from_pretrained(micro_teacher).max_position_embeddings
    window = engine_window(positions, positions)
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 300, size=n).astype(np.int32) for n in (window, 40)]
    cfg = ScorerConfig(model=str(micro_teacher), window=window, dtype="float32", gpu_memory_utilization=0.2)
    expected = TransformersScorer(cfg).score(windows)
    scorer = VLLMScorer(cfg)
    assert getattr(scorer.params, "flat_logprobs", True), "flat logprobs where this vLLM has them"
    got = scorer.score(windows)
    assert len(got[0]) == window == positions - 1
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=2e-3, equal_nan=True)
