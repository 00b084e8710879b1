"""A corpus file that ``data.files`` lists more than once (twice by name, by a glob too, by a link
to it) is noted in one warning line and scored once, through the real command. The reference is
pyarrow's count of each file's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]


def test_a_file_listed_four_times_is_noted_once_and_scored_once(micro_teacher, micro_corpus, tmp_path):
    first, second = micro_corpus
    link = tmp_path / "the-same.parquet"
    link.symlink_to(first)
    out = tmp_path / "scored"
    files = [first, first, first.parent / "*.parquet", link]
    run = subprocess.run([sys.executable, "-m", "stages.score_teacher", "teacher.embedded=false", "teacher.name=micro",
                          f"teacher.model={micro_teacher}", "teacher.stride=null", "data.embedded=false",
                          "data.name=micro", f"data.files=[{','.join(map(str, files))}]", "data.rows_per_shard=80",
                          f"output_dir={out}", "progress=false", "ray.num_cpus=2",
                          f"hydra.run.dir={tmp_path / 'logs'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    noted = [ln for ln in (run.stdout + run.stderr).splitlines() if "more than once" in ln]
    assert len(noted) == 1 and noted[0].endswith(f"data.files lists a file more than once: {first} (4 times); "
                                                 "each is scored once"), noted
    manifest = json.loads((out / "manifest.json").read_text())
    rows = pq.read_metadata(first).num_rows + pq.read_metadata(second).num_rows
    skipped = sum(len(e["skipped"]) for e in manifest["shards"])
    assert manifest["totals"]["documents"] + skipped == rows, "each file's rows once"
    assert sorted({e["source"]["file"] for e in manifest["shards"]}) == sorted([first.name, second.name])
