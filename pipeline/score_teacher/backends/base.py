"""The interface every teacher backend implements, and the factory that picks one.

A backend scores *windows*: token-id sequences no longer than the teacher's context. For a window
``w`` it returns ``losses`` with ``losses[i] = -log p(w[i] | w[:i])`` in float32 and
``losses[0] = NaN`` (nothing predicts the first token of a window). Window planning and stitching
(:mod:`pipeline.score_teacher.windows`) are shared by all backends, so every backend stores the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from pipeline.config import check_choice

BACKENDS = ("transformers", "vllm")


@dataclass(frozen=True)
class ScorerConfig:
    """How the teacher is run (docs/METHOD.md §1.2); model, revision and window come from the teacher."""

    backend: str = "transformers"  # transformers | vllm
    model: str = ""  # hub id or local folder
    revision: str | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    trust_remote_code: bool = False
    allow_bin: bool = False  # also load pickle (.bin) weights, through torch.load(weights_only=True)
    window: int = 2048
    # transformers backend
    max_batch_tokens: int = 16384  # padded tokens per forward
    max_logits_bytes: int = 256 * 2**20  # bound on the fp32 logits block of one head chunk
    attn_implementation: str | None = None  # None: the transformers default (sdpa)
    # vllm backend
    gpu_memory_utilization: float = 0.85
    max_num_batched_tokens: int | None = None  # tokens per engine step; None: vLLM's default for the GPU
    max_num_seqs: int = 256  # requests per engine step; max_num_batched_tokens must be >= this
    tensor_parallel_size: int = 1
    seed: int = 0

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "backend", self.backend, BACKENDS)
        return found


class WindowScorer(Protocol):
    """Scores windows of teacher token ids; see the module docstring."""

    def score(self, windows: Sequence[np.ndarray]) -> list[np.ndarray]: ...

    def describe(self) -> dict: ...
