"""The bench's export case at tiny sizes reports its figures in the right shape (no timing is asserted)."""

from __future__ import annotations

import math

import pytest


@pytest.mark.slow  # about a minute: two child processes measured for memory
def test_export_bench_case_quick(tiny_student, micro_scored, student_tokenizer, tmp_path):
    from benchmarks.export import ExportBenchConfig, run

    cfg = ExportBenchConfig(max_shards=2, seq_len=32, rows_per_shard=64, repeats=1, warmup=0, scale=2,
                            memory_rows_per_shard=16, formats=["parquet", "megatron"])
    result = run(cfg, tmp_path, tiny_student, student_tokenizer, micro_scored)
    figures = {f["key"]: f for f in result["figures"]}
    assert set(figures) == {"export_throughput", "export_bytes_parquet", "export_bytes_megatron", "export_memory"}
    for f in figures.values():
        assert f["status"] in ("pass", "miss", "info") and f["note"], f
        assert isinstance(f["value"], float) and math.isfinite(f["value"]) and f["value"] > 0, f
    assert 4 < figures["export_bytes_megatron"]["value"] < 16  # an int32 and a float32 per token, and the index
