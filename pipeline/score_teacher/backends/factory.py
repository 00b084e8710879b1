"""The backend a :class:`~pipeline.score_teacher.backends.base.ScorerConfig` asks for."""

from __future__ import annotations

from pipeline.score_teacher.backends.base import ScorerConfig, WindowScorer
from pipeline.score_teacher.backends.hf import TransformersScorer
from pipeline.score_teacher.backends.vllm import VLLMScorer


def make_scorer(cfg: ScorerConfig) -> WindowScorer:
    if cfg.backend == "transformers":
        return TransformersScorer(cfg)
    if cfg.backend == "vllm":
        return VLLMScorer(cfg)
    raise ValueError(f"unknown scoring backend {cfg.backend!r}; choose 'transformers' or 'vllm'")
