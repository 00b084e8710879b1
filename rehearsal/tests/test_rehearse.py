"""``make rehearse`` end to end at a tiny fraction of OpenWebMath (126 documents, 5 shards): every
step runs as the real command and is measured, the report holds what it should. No timing is
asserted (speed is the rehearsal's own business, in bench-results/scale.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["fractions=[0.00002]", "rows_per_shard=30", "window=512", "stride=256", "train_steps=3", "seq_len=64",
        "micro_batch_size=2", "export_seq_len=256", "markers_shards=40", "pool_pages=2000"]


def rehearse(tmp_path: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "rehearsal", *TINY, f"work_dir={tmp_path / 'work'}", f"out_dir={tmp_path / 'out'}",
           "docs_page=null", f"hydra.run.dir={tmp_path / 'logs'}", *extra]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((tmp_path / "out" / "scale.json").read_text())


@pytest.mark.long
def test_a_tiny_rehearsal_through_every_stage(shared_tokenizers, tmp_path):
    report = rehearse(tmp_path, "s3_fraction=null", "kill_fraction=null")
    (result,) = report["fractions"]
    assert result["documents"] == 126 and result["shards"] == 5 and result["teacher_tokens"] > 50_000
    corpus = result["corpus"]
    assert corpus["documents"] == 126 and corpus["files"] == [{"file": "train-00000-of-00114.parquet", "rows": 126,
                                                              "bytes": corpus["parquet_bytes"]}]
    data = tmp_path / "work" / "corpora" / "0.002pct" / "data" / "train-00000-of-00114.parquet"
    assert pq.ParquetFile(data).schema_arrow.names == ["url", "text", "date", "metadata"]
    steps = result["steps"]
    assert list(steps) == ["corpus", "stage1", "rerun", "count", "train", "export", "summary", "validate"]
    for name, step in steps.items():
        assert step["returncode"] == 0 and step["wall_s"] > 0 and step["cpu_s"] > 0, name
        assert step["roles"]["driver"]["peak_rss_mib"] > 0, name
    stage1 = steps["stage1"]
    # every actor that loaded the teacher is counted as one; a second actor may still be starting when
    # the first has scored the shards left (the pool then stops it), so the job's own list is the floor
    started = {a["pid"] for a in stage1["summary"]["actors"]}
    assert 1 <= len(started) <= stage1["roles"]["scorer actor"]["processes"] <= 2
    assert stage1["roles"]["raylet"]["processes"] == 1
    assert stage1["files_written"] == 2 * 5 + 2 and stage1["bytes_written"] > 0  # shards, markers, manifest, card
    assert stage1["summary"]["shards_scored"] == 5 and stage1["summary"]["rehearsal"]
    assert result["checks"]["rerun_scored_nothing"] and steps["rerun"]["summary"]["shards_scored"] == 0
    assert steps["count"]["result"]["student_tokens"] == result["student_tokens"] > 50_000
    assert steps["count"]["roles"]["spawned worker"]["processes"] == 2  # data.length_workers=2
    assert "first_step_s" in steps["train"]["events"] and steps["train"]["roles"]["forked worker"]["processes"] == 2
    assert steps["export"]["manifest_totals"]["rows"] > 0 and steps["export"]["files_written"] > 0
    markers = report["markers"]
    assert markers["shards"] == 40 and set(markers["operations"]) == {
        "resume planning", "manifest writing", "driver bookkeeping", "marker validation", "open for training",
        "full validation"}
    ops = markers["operations"]
    assert ops["resume planning"]["done"] == 40 and ops["marker validation"]["errors"] == 0
    assert ops["marker validation"]["shards"] == ops["full validation"]["shards"] == 40 and ops["full validation"]["errors"] == 0
    assert ops["open for training"]["shards"] == 40 and ops["driver bookkeeping"]["tokens"] == 40 * 8
    assert {t["target"] for t in report["targets"]} >= {"make rehearse: wall minutes"}
    md = (tmp_path / "out" / "scale.md").read_text()
    assert "## Targets" in md and "## The bill for all of OpenWebMath" in md and "| 0.002pct" in md
    assert (tmp_path / "out" / "scale.png").stat().st_size > 0


@pytest.mark.slow
def test_a_tiny_rehearsal_killed_and_on_s3(shared_tokenizers, tmp_path):
    """The same fraction also on moto's S3 server, and with stage 1 and the export SIGKILLed once
    each at a random moment and rerun: byte-identical output, no marked shard written again."""
    pytest.importorskip("moto.server")
    report = rehearse(tmp_path, "s3_fraction=0.00002", "kill_fraction=0.00002", "kills=1",
                      "steps=[corpus,stage1,rerun,count,export,s3,kills]")
    (result,) = report["fractions"]
    for what in ("stage1", "export"):
        k = result["kills"][what]
        assert k["identical"] and k["redone_at_most_in_flight"], k
    s3 = result["s3"]
    assert s3["rerun_scored_nothing"] and all(s["returncode"] == 0 for s in s3["steps"].values())
    assert math.isfinite(s3["moto_cpu_s"])
