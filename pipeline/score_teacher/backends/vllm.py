"""The vLLM backend (optional extra ``vocagno[vllm]``, GPU clusters; docs/METHOD.md §1.2).

Each window goes in as ``TokensPrompt(prompt_token_ids=...)`` so vLLM scores exactly the ids (and
therefore the offsets) that stage 1 stores, with greedy
``SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0, detokenize=False)`` and, where the
installed vLLM has it, ``flat_logprobs=True``. ``prompt_logprobs[j]`` then holds the prompt's own
token at every position but the first; the loss is looked up by the actual id, never by rank or
position. Flat logprobs (``FlatLogprobs``: a few flat lists per request) are converted with numpy,
without building one dict per position; the per-position mappings of older versions still work.

Engine settings (checked against the engine's own rules before any engine starts):

* ``max_model_len = window + 1``: vLLM refuses a prompt unless prompt length + the one requested
  output token fits ``max_model_len``; :func:`engine_window` shortens the window by one where the
  model has no position left for that token;
* ``max_num_seqs`` is set explicitly and ``max_num_batched_tokens`` is vLLM's own default unless
  configured (then it must be at least ``max_num_seqs``, as vLLM requires);
* prefix caching is off: cached prefixes return no prompt logprobs.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pipeline.config import ConfigError
from pipeline.score_teacher.backends.base import ScorerConfig


class PromptLogprobError(RuntimeError):
    pass


def engine_window(window: int, max_positions: int | None) -> int:
    """The longest window the engine can score for a teacher with ``max_positions`` positions.

    A window of ``w`` tokens needs ``max_model_len >= w + 1`` (the prompt plus one output token),
    and ``max_model_len`` may not exceed the model's positions, so ``w <= max_positions - 1``.
    """
    if max_positions is None:
        return window
    if max_positions < 3:
        raise ConfigError(f"the teacher has {max_positions} positions; the vllm backend needs at least 3")
    return min(window, max_positions - 1)


def engine_args(cfg: ScorerConfig) -> dict:
    """Keyword arguments for ``vllm.LLM``; raises ValueError on settings the engine would refuse."""
    if cfg.max_num_seqs < 1:
        raise ConfigError(f"scorer.max_num_seqs must be >= 1, got {cfg.max_num_seqs}")
    args = dict(
        model=cfg.model,
        revision=cfg.revision,
        dtype=cfg.dtype,
        trust_remote_code=cfg.trust_remote_code,
        max_model_len=cfg.window + 1,  # the prompt plus the one output token vLLM insists on
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=False,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        skip_tokenizer_init=True,
        seed=cfg.seed,
    )
    if cfg.max_num_batched_tokens is not None:  # None: vLLM's default for the GPU it runs on
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ConfigError(
                f"scorer.max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= scorer.max_num_seqs "
                f"({cfg.max_num_seqs}); vLLM refuses fewer; null uses vLLM's default")
        args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if not cfg.allow_bin:
        args["load_format"] = "safetensors"  # never unpickle downloaded weights
    return args


def greedy_prompt_logprob_params(sampling_params_cls) -> Any:
    """``SamplingParams`` for scoring: one greedy output token, the prompt's own logprob at every
    position, no detokenisation; flat logprobs where the installed vLLM knows them (0.11+)."""
    kwargs = dict(prompt_logprobs=0, max_tokens=1, temperature=0.0, detokenize=False)
    try:
        return sampling_params_cls(**kwargs, flat_logprobs=True)
    except TypeError:  # an older vLLM without flat_logprobs: per-position dicts
        return sampling_params_cls(**kwargs)


def prompt_logprobs_to_losses(token_ids: Sequence[int], prompt_logprobs: Any) -> np.ndarray:
    """Convert one request's ``prompt_logprobs`` into float32 losses (NaN at position 0).

    ``prompt_logprobs`` is either vLLM's flat layout (``FlatLogprobs``: ``start_indices``,
    ``end_indices``, ``token_ids``, ``logprobs``; position ``j``'s entries are
    ``token_ids[start_indices[j]:end_indices[j]]``) or a sequence with one entry per position: None
    (position 0), ``{token_id: Logprob}`` (``Logprob`` has ``.logprob``) or ``{token_id: float}``.
    A missing entry for the prompt's own token is an error, never a silent zero.
    """
    if prompt_logprobs is None:
        raise PromptLogprobError("vLLM returned no prompt_logprobs: was prompt_logprobs=0 requested?")
    if all(hasattr(prompt_logprobs, k) for k in ("start_indices", "end_indices", "token_ids", "logprobs")):
        return _flat_to_losses(np.asarray(token_ids, dtype=np.int64), prompt_logprobs)
    return _dicts_to_losses(token_ids, prompt_logprobs)


def _flat_to_losses(targets: np.ndarray, flat: Any) -> np.ndarray:
    n = len(targets)
    starts = np.asarray(flat.start_indices, dtype=np.int64)  # (n,)
    ends = np.asarray(flat.end_indices, dtype=np.int64)  # (n,)
    if len(starts) != n or len(ends) != n:
        raise PromptLogprobError(f"vLLM returned {len(starts)} prompt logprobs for {n} prompt tokens")
    ids = np.asarray(flat.token_ids, dtype=np.int64)  # (E,) every entry of every position
    values = np.asarray(flat.logprobs, dtype=np.float64)  # (E,)
    counts = ends - starts  # (n,) entries per position
    if (counts < 0).any() or (n and (starts.min(initial=0) < 0 or ends.max(initial=0) > len(ids))):
        raise PromptLogprobError("vLLM returned flat prompt logprobs with inconsistent position ranges")
    # entry e belongs to position pos[e] and sits at ids[entry[e]]
    pos = np.repeat(np.arange(n), counts)  # (sum counts,)
    entry = np.arange(len(pos)) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
    hit = (ids[entry] == targets[pos]) & (pos > 0)
    hit_pos, hit_entry = pos[hit], entry[hit]
    found, first = np.unique(hit_pos, return_index=True)  # first entry of each position with its own id
    losses = np.full(n, np.nan, dtype=np.float32)
    losses[found] = -values[hit_entry[first]]
    if len(found) != max(n - 1, 0):
        missing = np.setdiff1d(np.arange(1, n), found)[0]
        raise PromptLogprobError(
            f"prompt position {missing}: no logprob for the prompt's own token id {int(targets[missing])}")
    return losses


def _dicts_to_losses(token_ids: Sequence[int], prompt_logprobs: Sequence[Any]) -> np.ndarray:
    n = len(token_ids)
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
    def __init__(self, cfg: ScorerConfig, **engine_overrides):
        """``engine_overrides`` replace entries of :func:`engine_args` (the GPU bench passes
        ``load_format="dummy"`` for random weights)."""
        try:
            from vllm import (  # optional and heavy: only where this backend runs
                LLM,
                SamplingParams,
            )
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the vllm backend needs the optional extra: pip install 'vocagno[vllm]' "
                "(in its own environment: vLLM pins its own torch and transformers)"
            ) from exc
        self.cfg = cfg
        self.llm = LLM(**{**engine_args(cfg), **engine_overrides})
        self.params = greedy_prompt_logprob_params(SamplingParams)

    def describe(self) -> dict:
        return {"backend": "vllm", "dtype": self.cfg.dtype, "device": "cuda"}

    def score(self, windows: Sequence[np.ndarray]) -> list[np.ndarray]:
        from vllm.inputs import TokensPrompt  # optional and heavy: only where this backend runs

        too_long = [len(w) for w in windows if len(w) > self.cfg.window]
        if too_long:
            raise PromptLogprobError(f"a window of {too_long[0]} tokens exceeds the engine's window {self.cfg.window}")
        prompts = [TokensPrompt(prompt_token_ids=np.asarray(w, dtype=np.int64).tolist()) for w in windows]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        losses = []
        for prompt, out in zip(prompts, outputs):
            if list(out.prompt_token_ids) != prompt["prompt_token_ids"]:
                raise PromptLogprobError("vLLM returned outputs for a different prompt than the one sent")
            losses.append(prompt_logprobs_to_losses(prompt["prompt_token_ids"], out.prompt_logprobs))
        return losses
