"""``rescore_shards=[i]``: one shard scored again without touching its marker by hand, through the real
command. A shard whose bytes were changed in place (the same size, so its marker still names it) is
scored again and equals the untouched original byte for byte (the scoring is deterministic); the
other shards are not rewritten; ``make inspect`` names the setting for the damaged shard, ``plan=true``
counts it as pending, and ``make inspect`` then finds nothing damaged. An index past the plan
is one line, before anything changes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}


def tree(folder: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.iterdir()) if p.is_file()}


def stage1(micro_teacher, micro_corpus, out: Path, logs: Path, *extra: str) -> subprocess.CompletedProcess:
    """micro_scored's own job (conftest), so a shard scored again is the same shard."""
    return subprocess.run([sys.executable, "-m", "stages.score_teacher", "teacher.embedded=false", "teacher.name=micro",
                           f"teacher.model={micro_teacher}", "teacher.stride=null", "data.embedded=false",
                           "data.name=owm-micro", f"data.files=[{','.join(map(str, micro_corpus))}]",
                           "data.rows_per_shard=40", "scorer.max_batch_tokens=2048", "pool.num_actors=1",
                           "pool.num_cpus=1", "ray.num_cpus=2", "progress=false", f"output_dir={out}",
                           f"hydra.run.dir={logs}", *extra], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=ENV)


def inspect(folder: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.inspect", f"path={folder}", "summary.show_document=false",
                           f"out_dir={out}", f"hydra.run.dir={out / 'logs'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=ENV)


def test_one_shard_is_scored_again_and_equals_the_original(micro_teacher, micro_corpus, micro_scored, tmp_path):
    out = Path(shutil.copytree(micro_scored, tmp_path / "ds"))
    original = hashlib.sha256((micro_scored / "shard-000001.parquet").read_bytes()).hexdigest()
    data = bytearray((out / "shard-000001.parquet").read_bytes())
    data[len(data) // 3: len(data) // 3 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 3: len(data) // 3 + 64])
    (out / "shard-000001.parquet").write_bytes(bytes(data))
    before = tree(out)

    past = stage1(micro_teacher, micro_corpus, out, tmp_path / "logs", "rescore_shards=[1,9]")
    assert past.returncode == 2 and past.stderr.strip() == (
        "error: rescore_shards: [9] past this job's plan of 4 shard(s) (0-3)"), past.stderr[-3000:]
    assert tree(out) == before
    damaged = inspect(out, tmp_path / "inspect-before")  # the damaged shard, and the setting that scores it again
    assert "shard-000001.parquet" in damaged.stdout and "rescore_shards=[1]" in " ".join(damaged.stdout.split())
    planned = stage1(micro_teacher, micro_corpus, out, tmp_path / "logs", "rescore_shards=[1]", "plan=true",
                     "plan_measure=false")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "3 already done (kept)" in " ".join(planned.stdout.split()), planned.stdout[-3000:]
    assert tree(out) == before

    run = stage1(micro_teacher, micro_corpus, out, tmp_path / "logs", "rescore_shards=[1]")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "1 scored now, 3 already done, 4 planned" in run.stdout
    after = tree(out)
    assert after["shard-000001.parquet"][0] == original, "scored again: the original bytes"
    assert {n: v for n, v in after.items() if n.startswith("shard-") and "000001" not in n} == \
        {n: v for n, v in before.items() if n.startswith("shard-") and "000001" not in n}, "the others not rewritten"
    marker = json.loads((out / "shard-000001.done.json").read_text())
    assert marker["sha256"] == original and json.loads((out / "manifest.json").read_text())["complete"]
    inspected = inspect(out, tmp_path / "inspect")
    assert inspected.returncode == 0 and "warning" not in inspected.stdout and f"{out} (complete)" in inspected.stdout
