"""vLLM output conversion in the main environment, on outputs the real engine never returns
(missing entries, wrong lengths: they must be errors, never zero losses) and on the cost of the flat
layout; what the real engine returns, in every layout, is tested against it in
tests/vllm_engine/test_vllm_engine.py (make test-vllm)."""

from dataclasses import dataclass

import numpy as np
import pytest

from pipeline.score_teacher.backends.vllm import PromptLogprobError, prompt_logprobs_to_losses


@dataclass
class FakeLogprob:  # the shape of vllm.sequence.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@pytest.mark.parametrize("prompt_logprobs,match", [
    (None, "no prompt_logprobs"),
    ([None], "1 prompt logprobs for 2"),
    ([None, {99: FakeLogprob(-1.0)}], "own token id 2"),
    ([None, None], "own token id 2"),
])
def test_missing_entries_are_errors_never_zero(prompt_logprobs, match):
    with pytest.raises(PromptLogprobError, match=match):
        prompt_logprobs_to_losses([1, 2], prompt_logprobs)


class FlatLogprobsStandIn:
    """Stands in for ``vllm.logprobs.FlatLogprobs`` (vLLM 0.33), which cannot be installed here: the
    same flat fields, written from its source (position ``j``'s entries are
    ``token_ids[start_indices[j]:end_indices[j]]`` with their ``logprobs``, ranks and decoded
    tokens; position 0 has none). vLLM's class also acts as a list of per-position dicts, building
    one dict per position on access: that access is imitated and counted, and must not be used."""

    def __init__(self, positions: list[dict[int, float] | None]):
        self.start_indices, self.end_indices = [], []
        self.token_ids, self.logprobs, self.ranks, self.decoded_tokens = [], [], [], []
        self.per_position_access = 0
        for entries in positions:
            self.start_indices.append(len(self.logprobs))
            for rank, (tid, value) in enumerate((entries or {}).items(), start=1):
                self.token_ids.append(tid)
                self.logprobs.append(value)
                self.ranks.append(rank)
                self.decoded_tokens.append(None)
            self.end_indices.append(len(self.logprobs))

    def __len__(self):
        return len(self.start_indices)

    def __getitem__(self, j):
        self.per_position_access += 1
        return {self.token_ids[i]: FakeLogprob(self.logprobs[i]) for i in range(self.start_indices[j], self.end_indices[j])}

    def __iter__(self):
        return (self[j] for j in range(len(self)))


def test_flat_logprobs_are_converted_without_a_dict_per_position():
    ids = [5, 7, 9, 7]
    # the prompt's own token is not always the first entry of a position: look it up by id
    flat = FlatLogprobsStandIn([None, {3: -0.1, 7: -2.0}, {9: -0.5}, {1: -0.2, 4: -0.9, 7: -3.25}])
    losses = prompt_logprobs_to_losses(ids, flat)
    assert flat.per_position_access == 0
    assert np.isnan(losses[0]) and losses.dtype == np.float32
    np.testing.assert_array_equal(losses[1:], np.float32([2.0, 0.5, 3.25]))


@pytest.mark.parametrize("positions,match", [
    ([None], "1 prompt logprobs for 2"),
    ([None, {99: -1.0}], "position 1: .*own token id 2"),
    ([None, None], "position 1: .*own token id 2"),
])
def test_flat_missing_entries_are_errors_never_zero(positions, match):
    with pytest.raises(PromptLogprobError, match=match):
        prompt_logprobs_to_losses([1, 2], FlatLogprobsStandIn(positions))


def test_flat_one_token_prompt_has_only_nan():
    losses = prompt_logprobs_to_losses([4], FlatLogprobsStandIn([None]))
    assert losses.shape == (1,) and np.isnan(losses[0])
