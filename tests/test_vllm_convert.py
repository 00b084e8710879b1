"""vLLM output conversion, tested everywhere with stand-in output objects (vLLM itself needs a GPU
and its own environment, so the objects it returns are imitated here); the real engine is tested
in test_vllm_engine where vllm imports."""

from dataclasses import dataclass

import numpy as np
import pytest

from pipeline.score_teacher.backends.vllm import PromptLogprobError, prompt_logprobs_to_losses


@dataclass
class FakeLogprob:  # the shape of vllm.sequence.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def test_losses_are_looked_up_by_the_actual_token_id():
    ids = [5, 7, 9]
    # prompt_logprobs=0 returns the prompt token; a sampler may add the top-1 token too, with rank 1
    prompt_logprobs = [None, {3: FakeLogprob(-0.1, 1), 7: FakeLogprob(-2.0, 4)}, {9: FakeLogprob(-0.5, 1)}]
    losses = prompt_logprobs_to_losses(ids, prompt_logprobs)
    assert np.isnan(losses[0])
    np.testing.assert_allclose(losses[1:], [2.0, 0.5])
    assert losses.dtype == np.float32


def test_plain_float_entries_are_accepted():
    assert prompt_logprobs_to_losses([1, 2], [None, {2: -1.25}])[1] == 1.25


@pytest.mark.parametrize("prompt_logprobs,match", [
    (None, "no prompt_logprobs"),
    ([None], "1 prompt logprobs for 2"),
    ([None, {99: FakeLogprob(-1.0)}], "own token id 2"),
    ([None, None], "own token id 2"),
])
def test_missing_entries_are_errors_never_zero(prompt_logprobs, match):
    with pytest.raises(PromptLogprobError, match=match):
        prompt_logprobs_to_losses([1, 2], prompt_logprobs)
