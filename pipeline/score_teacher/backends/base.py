"""The interface every teacher backend implements, and the factory that picks one.

A backend scores *windows*: token-id sequences no longer than the teacher's context. For a window
``w`` it returns ``losses`` with ``losses[i] = -log p(w[i] | w[:i])`` in float32 and
``losses[0] = NaN`` (nothing predicts the first token of a window). Window planning and stitching
(:mod:`pipeline.method.windows`) are shared by all backends, so every backend stores the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from pipeline.runtime.config import check_at_least, check_choice

BACKENDS = ("transformers", "vllm", "server", "rehearsal")


@dataclass(frozen=True)
class ScorerConfig:
    """How the teacher is run (docs/METHOD.md §1.2); model, revision and window come from the teacher."""

    backend: str = "transformers"  # transformers | vllm | server | rehearsal (a stand-in: pipeline.folders.rehearsal)
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
    gpu_memory_utilization: float = 0.85  # GPU: the share of its memory vLLM takes (weights + KV cache)
    kv_cache_memory_bytes: int | None = None  # the KV cache's size; None: GPU from the share above, CPU a few windows
    max_num_batched_tokens: int | None = None  # tokens per engine step; None: vLLM's default for the GPU
    max_num_seqs: int = 256  # requests per engine step; max_num_batched_tokens must be >= this
    tensor_parallel_size: int = 1
    seed: int = 0  # vllm's sampling seed; rehearsal: the seed of its hash
    # server backend: a teacher already served (docs/served-teacher.md); the API key is read from the
    # environment variable api_key_env in the driver and never written anywhere
    url: str | None = None  # http(s)://host:port of an OpenAI-compatible server (vLLM's)
    served_model: str | None = None  # the name it serves the teacher under; None: the entry named teacher.model
    api_key_env: str = "VOCAGNO_SERVER_KEY"  # unset or empty: requests carry no key
    in_flight_per_actor: int = 8  # requests one actor keeps in flight
    max_in_flight: int = 64  # requests all actors keep in flight together (at most this many actors)
    request_timeout_s: float = 120.0  # for one request's answer
    retry_for_s: float = 300.0  # a window still failing this long after its first failure stops the job

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "backend", self.backend, BACKENDS)
        check_choice(found, "dtype", self.dtype, ("float32", "bfloat16", "float16"))
        for key in ("max_batch_tokens", "max_logits_bytes", "max_num_seqs", "tensor_parallel_size"):
            check_at_least(found, key, getattr(self, key), 1)
        check_at_least(found, "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_at_least(found, "kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        found += self._server_problems()
        return found

    def _server_problems(self) -> list[str]:
        found: list[str] = []
        if self.backend == "server" and not self.url:
            found.append("url: required with backend=server: http://host:port of the server")
        elif self.url and not str(self.url).startswith(("http://", "https://")):
            found.append(f"url: {self.url!r} must start with http:// or https://")
        check_at_least(found, "in_flight_per_actor", self.in_flight_per_actor, 1)
        check_at_least(found, "max_in_flight", self.max_in_flight, 1)
        for key in ("request_timeout_s", "retry_for_s"):
            if getattr(self, key) <= 0:
                found.append(f"{key}: {getattr(self, key)} must be > 0")
        return found


class WindowScorer(Protocol):
    """Scores windows of teacher token ids; see the module docstring."""

    def score(self, windows: Sequence[np.ndarray]) -> list[np.ndarray]: ...

    def describe(self) -> dict: ...
