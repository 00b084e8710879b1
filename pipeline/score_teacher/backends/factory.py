"""The backend a :class:`~pipeline.score_teacher.backends.base.ScorerConfig` asks for."""

from __future__ import annotations

from pipeline.score_teacher.backends.base import ScorerConfig, WindowScorer
from pipeline.score_teacher.backends.hf import TransformersScorer
from pipeline.score_teacher.backends.rehearsal import RehearsalScorer
from pipeline.score_teacher.backends.server import ApiKey, ServerScorer
from pipeline.score_teacher.backends.vllm import VLLMScorer


def make_scorer(cfg: ScorerConfig, api_key: ApiKey | None = None) -> WindowScorer:
    """``api_key``: the served teacher's key (server backend), read from the environment by the driver."""
    if cfg.backend == "transformers":
        return TransformersScorer(cfg)
    if cfg.backend == "vllm":
        return VLLMScorer(cfg)
    if cfg.backend == "server":
        return ServerScorer(cfg, api_key)
    if cfg.backend == "rehearsal":
        return RehearsalScorer(cfg)
    raise ValueError(f"unknown scoring backend {cfg.backend!r}; choose 'transformers', 'vllm', 'server' or 'rehearsal'")
