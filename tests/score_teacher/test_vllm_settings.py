"""The vLLM engine's settings and window plan, checked against the engine's own rules.

vLLM cannot be installed here (it needs CUDA), so the rules it enforces are written out below from
its source (vLLM 0.33), independently of the code under test:

* a decoder prompt is refused unless ``prompt_len + 1 <= max_model_len`` (the one output token a
  generate request asks for; ``_validate_prompt_len`` in ``vllm/v1/engine/input_processor.py``);
* ``max_model_len`` may not exceed the model's positions (``max_position_embeddings``) unless an
  override variable is set (``_get_and_verify_max_len`` in ``vllm/config/model.py``);
* ``max_num_batched_tokens >= max_num_seqs`` (``SchedulerConfig.verify_max_model_len``).
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.vllm import engine_args, engine_window, greedy_prompt_logprob_params
from pipeline.windows import plan_windows


def engine_accepts_prompt(prompt_len: int, max_model_len: int) -> bool:
    return 0 < prompt_len and prompt_len + 1 <= max_model_len


def engine_accepts_max_model_len(max_model_len: int, max_positions: int) -> bool:
    return max_model_len <= max_positions


@pytest.mark.parametrize("window,positions", [(64, 64), (64, 65), (64, 4096), (4096, 4096), (4096, 32768), (2048, 2049)])
def test_every_planned_window_is_accepted_by_the_engine(window, positions):
    w = engine_window(window, positions)
    args = engine_args(ScorerConfig(model="m", window=w))
    assert engine_accepts_max_model_len(args["max_model_len"], positions)
    assert w == min(window, positions - 1), "the window is shortened only where the positions demand it"
    stride = w // 2
    for n in (1, 2, w - 1, w, w + 1, 2 * w, 3 * w + 7, 10 * window):
        plan = plan_windows(n, w, stride)
        lengths = [p.stop - p.start for p in plan]
        if plan:
            assert max(lengths) == min(n, w)  # full-length windows do occur
        for length in lengths:
            assert engine_accepts_prompt(length, args["max_model_len"]), (n, length, args["max_model_len"])


def test_a_full_length_window_through_the_stage1_path_is_accepted(micro_corpus, micro_teacher):
    """prepare() with the vllm backend on a teacher of 64 positions: windows of 63 tokens, and the
    engine's max_model_len leaves room for the output token."""
    from pipeline.score_teacher.corpus import CorpusConfig
    from pipeline.score_teacher.job import ScoreJobConfig, TeacherConfig, prepare

    job = ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(micro_teacher)),  # window None: the model's 64
        corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in micro_corpus], rows_per_shard=40),
        scorer=ScorerConfig(backend="vllm"), output_dir="unused")
    prepared = prepare(job)
    assert prepared.settings.window == prepared.scorer.window == 63
    assert prepared.identity["windows"]["window"] == 63
    args = engine_args(prepared.scorer)
    assert engine_accepts_max_model_len(args["max_model_len"], 64)
    z = np.arange(500)
    for p in plan_windows(len(z), prepared.settings.window, prepared.settings.stride):
        assert engine_accepts_prompt(p.stop - p.start, args["max_model_len"])


def test_engine_defaults_start_and_do_not_cap_a_step_at_one_window():
    for window in (63, 511, 2048, 4095):
        args = engine_args(ScorerConfig(model="m", window=window))
        assert "max_num_seqs" in args and args["max_num_seqs"] >= 1, "set explicitly, not left to the engine"
        tokens = args.get("max_num_batched_tokens")  # absent: vLLM's default (2048 or more on every GPU)
        assert tokens is None or (tokens >= args["max_num_seqs"] and tokens >= 2 * window)
        assert args["enable_prefix_caching"] is False
        assert args["load_format"] == "safetensors"
    assert engine_args(ScorerConfig(model="m", allow_bin=True)).get("load_format") is None


def test_settings_the_engine_would_refuse_are_refused_up_front():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(100\) must be >= scorer.max_num_seqs \(256\)"):
        engine_args(ScorerConfig(model="m", window=64, max_num_batched_tokens=100))
    assert engine_args(ScorerConfig(model="m", window=64, max_num_batched_tokens=8192))["max_num_batched_tokens"] == 8192


class SamplingParams033:
    """Stands in for vLLM 0.33's ``SamplingParams`` (a keyword-only struct that refuses unknown
    keywords with TypeError, as msgspec does); vLLM itself cannot run here."""

    fields = ("prompt_logprobs", "max_tokens", "temperature", "detokenize", "flat_logprobs")

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(self.fields)
        if unknown:
            raise TypeError(f"Unexpected keyword argument {sorted(unknown)[0]!r}")
        self.__dict__.update(kwargs)


class SamplingParamsOld(SamplingParams033):
    fields = ("prompt_logprobs", "max_tokens", "temperature", "detokenize")


@pytest.mark.parametrize("cls,flat", [(SamplingParams033, True), (SamplingParamsOld, None)])
def test_sampling_is_greedy_with_flat_logprobs_where_available(cls, flat):
    p = greedy_prompt_logprob_params(cls)
    assert (p.prompt_logprobs, p.max_tokens, p.temperature, p.detokenize) == (0, 1, 0.0, False)
    assert getattr(p, "flat_logprobs", None) is flat
