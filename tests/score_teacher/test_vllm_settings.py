"""The vLLM engine's settings and window plan, checked against the engine's own rules, in the main
environment (vLLM lives in .venv-vllm: the rules below are also checked against the real engine in
tests/vllm_engine, ``make test-vllm``).

The rules the engine enforces, written out from its source (vLLM 0.32/0.33), independently of the
code under test:

* a decoder prompt is refused unless ``prompt_len + 1 <= max_model_len`` (the one output token a
  generate request asks for; ``_validate_prompt_len`` in ``vllm/v1/engine/input_processor.py``);
* ``max_model_len`` may not exceed the model's positions (``max_position_embeddings``) unless an
  override variable is set (``_get_and_verify_max_len`` in ``vllm/config/model.py``);
* ``max_num_batched_tokens >= max_num_seqs`` (``SchedulerConfig.verify_max_model_len``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.runtime.config import ConfigError
from pipeline.folders.dataset_card import _engines, engine_text
from pipeline.score_teacher.backends.vllm import (
    EngineStartError,
    cpu_kv_cache_bytes,
    engine_args,
    engine_window,
    kv_bytes_per_token,
    root_cause,
    start_failure,
)
from pipeline.method.windows import plan_windows


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


def test_a_full_length_window_through_the_stage1_path_is_accepted(micro_teacher):
    """Stage 1's window plan for the vllm backend on a teacher of 64 positions: windows of 63 tokens,
    and the engine's max_model_len leaves room for the output token (prepare() itself, which needs
    vLLM installed, runs against the real engine in tests/vllm_engine/test_vllm_teachers.py)."""
    from pipeline.score_teacher.config import TeacherConfig
    from pipeline.score_teacher.prepare import plan_window

    window = plan_window(TeacherConfig(name="micro", model=str(micro_teacher)), "vllm", 64)  # window None: 64 - 1
    assert window == 63
    args = engine_args(ScorerConfig(backend="vllm", model=str(micro_teacher), window=window))
    assert engine_accepts_max_model_len(args["max_model_len"], 64)
    z = np.arange(500)
    for p in plan_windows(len(z), window, window // 2):
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


def test_the_cpu_kv_cache_holds_four_windows_of_the_teachers_keys_and_values():
    from transformers import Qwen2Config

    tiny = Qwen2Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    assert kv_bytes_per_token(tiny, "float32") == 4 * 2 * 32 * 2 * 4 == 2048  # layers, KV heads, head, K+V, bytes
    assert cpu_kv_cache_bytes(2048, 511) == 64 << 20, "16,384 tokens are 32 MiB: the 64 MiB floor"
    qwen7b = Qwen2Config(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28)
    assert kv_bytes_per_token(qwen7b, "bfloat16") == 28 * 4 * 128 * 2 * 2 == 57344
    assert cpu_kv_cache_bytes(57344, 4095) == 57344 * 4 * 4096 == 896 << 20
    assert cpu_kv_cache_bytes(None, 511) == 1 << 30, "a config without the sizes: 1 GiB"


def test_the_memory_setting_is_the_kv_cache_on_a_cpu_and_the_gpu_share_on_a_gpu():
    cfg = ScorerConfig(model="m", window=511)
    cpu, gpu = engine_args(cfg, on_cpu=True, kv_per_token=2048), engine_args(cfg, on_cpu=False)
    assert cpu["kv_cache_memory_bytes"] == 64 << 20 and "gpu_memory_utilization" not in cpu and cpu["enforce_eager"]
    assert gpu["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in gpu and "enforce_eager" not in gpu
    assert cpu["dtype"] == gpu["dtype"] == "float32", "explicit: vLLM's auto is bfloat16 on a CPU"
    both = ScorerConfig(model="m", window=511, kv_cache_memory_bytes=5 << 30)
    for on_cpu in (True, False):
        args = engine_args(both, on_cpu=on_cpu)
        assert args["kv_cache_memory_bytes"] == 5 << 30 and "gpu_memory_utilization" not in args


# What vLLM 0.32's processes logged when they failed to start (the engine's log file, excerpts)
KV_TOO_BIG = """ValueError: Available memory on node 0 (19.16/23.54 GiB) on kv cache allocation is less than requested memory for kv (100.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.
EngineCore failed to start.
Traceback (most recent call last):
RuntimeError: Worker failed with error 'Available memory on node 0 ...', please check the stack trace above for the root cause"""
HEAD_DIM = """WorkerProc hit an exception.
Traceback (most recent call last):
  File "/venv/vllm/_custom_ops.py", line 3865, in cpu_attn_get_scheduler_metadata
RuntimeError: Unsupported CPU attention configuration: head_dim=8 isa=1 kv_cache_idx=0
RuntimeError: Worker failed with error 'Unsupported CPU attention configuration: head_dim=8 isa=1 kv_cache_idx=0'"""


def test_a_start_failure_is_one_line_with_the_root_cause_and_the_fix():
    engine_error = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    cfg = ScorerConfig(model="/m", window=511, kv_cache_memory_bytes=100 << 30)
    err = start_failure(cfg, root_cause(engine_error, KV_TOO_BIG), on_cpu=True, log_path="/tmp/x.log")
    assert isinstance(err, EngineStartError) and "\n" not in str(err)
    assert str(err) == ("the vLLM engine could not start for /m: ValueError: Available memory on node 0 (19.16/23.54 "
                        "GiB) on kv cache allocation is less than requested memory for kv (100.0 GiB). (set "
                        "scorer.kv_cache_memory_bytes (now 107374182400) to what this machine can hold, at least one "
                        "window's keys and values; the engine's log: /tmp/x.log)")
    dead = start_failure(cfg, root_cause(RuntimeError("EngineCore encountered an issue."), HEAD_DIM), on_cpu=True)
    assert "RuntimeError: Unsupported CPU attention configuration: head_dim=8" in str(dead)
    assert "use scorer.backend=transformers, or a GPU)" in str(dead)
    pydantic = ValueError("1 validation error for ModelConfig\n  Value error, Model architectures ['FooBar'] are not "
                          "supported for now. Supported architectures: dict_keys(['A', 'B'])")
    arch = start_failure(cfg, root_cause(pydantic, ""), on_cpu=False)
    assert str(arch) == ("the vLLM engine could not start for /m: Model architectures ['FooBar'] are not supported for "
                         "now. (vLLM does not run this teacher's architecture: use scorer.backend=transformers)")


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_backend_without_vllm_is_refused_before_ray(micro_corpus, micro_teacher):
    from pipeline.score_teacher.corpus import CorpusConfig
    from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
    from pipeline.score_teacher.prepare import prepare

    job = ScoreJobConfig(teacher=TeacherConfig(name="micro", model=str(micro_teacher)),
                         corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in micro_corpus]),
                         scorer=ScorerConfig(backend="vllm"), output_dir="unused")
    with pytest.raises(ConfigError, match=r"vLLM is not installed in this Python environment; make setup-vllm"):
        prepare(job)


def test_the_card_names_every_engine_that_scored_shards():
    vllm_cpu = {"name": "vllm", "distribution": "vllm-cpu", "version": "0.32.0", "device": "cpu"}
    hf = {"name": "transformers", "version": "5.24.0", "torch": "2.13.0", "device": "cpu"}
    assert engine_text(vllm_cpu) == "vllm 0.32.0 (vllm-cpu, cpu)"
    assert engine_text(hf) == "transformers 5.24.0 (torch 2.13.0, cpu)"
    shards = [{"scored_by": {"engine": vllm_cpu}}, {"scored_by": {"engine": {**vllm_cpu, "version": "0.32.1"}}},
              {"scored_by": {"engine": vllm_cpu}}, {"index": 3}]
    assert _engines({"shards": shards[:1]}) == "vllm 0.32.0 (vllm-cpu, cpu)"
    assert _engines({"shards": shards}) == ("not recorded: 1 shard; vllm 0.32.0 (vllm-cpu, cpu): 2 shards; "
                                            "vllm 0.32.1 (vllm-cpu, cpu): 1 shard")


def test_engine_logs_of_processes_gone_are_removed_and_failed_starts_kept(tmp_path, monkeypatch):
    import subprocess
    import tempfile

    from pipeline.score_teacher.backends.vllm import _remove_logs_of_gone_processes

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    names = [f"vllm-engine-{gone.pid}-a.log", f"vllm-engine-{gone.pid}-a.log.json", f"vllm-engine-{os.getpid()}-b.log",
             f"vllm-engine-failed-{gone.pid}-c.log"]
    for name in names:
        (tmp_path / name).write_text("")
    _remove_logs_of_gone_processes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
