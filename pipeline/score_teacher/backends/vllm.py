"""The vLLM backend (optional extra ``vocagno[vllm]``, GPU clusters).

Each window goes in as ``TokensPrompt(prompt_token_ids=...)`` so vLLM scores exactly the ids (and
therefore the offsets) that stage 1 stores, with
``SamplingParams(prompt_logprobs=0, max_tokens=1, detokenize=False)``. ``prompt_logprobs[j]`` is then
a mapping keyed by token id that always holds the prompt's own token (entry 0 is None); the loss is
looked up by the actual id, never by rank or position in the mapping.

Hazards handled here (METHOD.md section 1): prefix caching is turned off (cached prefixes return no
prompt logprobs), and ``max_num_batched_tokens`` caps how many prompt positions materialise
full-vocabulary logits at once (prompt logprobs on 150k vocabularies otherwise run out of memory).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pipeline.score_teacher.backends.base import ScorerConfig


class PromptLogprobError(RuntimeError):
    pass


def prompt_logprobs_to_losses(token_ids: Sequence[int], prompt_logprobs: Sequence[Any] | None) -> np.ndarray:
    """Convert one request's ``prompt_logprobs`` into float32 losses (NaN at position 0).

    ``prompt_logprobs[j]`` may be None (position 0), a mapping ``{token_id: Logprob}`` (``Logprob``
    has ``.logprob``) or ``{token_id: float}``. A missing entry for the prompt's own token is an
    error, never a silent zero.
    """
    n = len(token_ids)
    if prompt_logprobs is None:
        raise PromptLogprobError("vLLM returned no prompt_logprobs: was prompt_logprobs=0 requested?")
    if len(prompt_logprobs) != n:
        raise PromptLogprobError(f"vLLM returned {len(prompt_logprobs)} prompt logprobs for {n} prompt tokens")
    losses = np.full(n, np.nan, dtype=np.float32)
    for j in range(1, n):
        entry = prompt_logprobs[j]
        tid = int(token_ids[j])
        if entry is None or tid not in entry:
            raise PromptLogprobError(f"prompt position {j}: no logprob for the prompt's own token id {tid}")
        value = entry[tid]
        losses[j] = -float(getattr(value, "logprob", value))
    return losses


class VLLMScorer:
    def __init__(self, cfg: ScorerConfig):
        try:
            from vllm import LLM, SamplingParams
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the vllm backend needs the optional extra: pip install 'vocagno[vllm]' "
                "(in its own environment: vLLM pins its own torch and transformers)"
            ) from exc
        self.cfg = cfg
        self.llm = LLM(
            model=cfg.model,
            revision=cfg.revision,
            dtype=cfg.dtype,
            trust_remote_code=cfg.trust_remote_code,
            max_model_len=cfg.window,
            max_num_batched_tokens=cfg.max_num_batched_tokens or cfg.window,
            enable_prefix_caching=False,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            skip_tokenizer_init=True,
            seed=cfg.seed,
        )
        self.params = SamplingParams(prompt_logprobs=0, max_tokens=1, detokenize=False)

    def describe(self) -> dict:
        return {"backend": "vllm", "dtype": self.cfg.dtype, "device": "cuda"}

    def score(self, windows: Sequence[np.ndarray]) -> list[np.ndarray]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in w]) for w in windows]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        losses = []
        for window, out in zip(windows, outputs):
            if list(out.prompt_token_ids) != [int(t) for t in window]:
                raise PromptLogprobError("vLLM returned outputs for a different prompt than the one sent")
            losses.append(prompt_logprobs_to_losses(window, out.prompt_logprobs))
        return losses
