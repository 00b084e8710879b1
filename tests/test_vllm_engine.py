"""The vLLM backend end to end on a tiny model; runs only where vllm imports and a GPU exists."""

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vllm is an optional extra (its own environment, GPU)")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs a GPU")
def test_vllm_losses_match_transformers(micro_teacher):
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.backends.hf import TransformersScorer
    from pipeline.score_teacher.backends.vllm import VLLMScorer

    ids = np.random.default_rng(0).integers(0, 300, size=40).astype(np.int32)
    cfg = ScorerConfig(model=str(micro_teacher), window=64, dtype="float32", gpu_memory_utilization=0.2)
    expected = TransformersScorer(cfg).score([ids])[0]
    got = VLLMScorer(cfg).score([ids])[0]
    np.testing.assert_allclose(got, expected, atol=2e-3, equal_nan=True)
