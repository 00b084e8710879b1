"""Stage 1's bill (``plan=true``) through the real command: it refuses what the run refuses, with
the run's own one-line error (exit 2), instead of pricing a job that cannot run; its bytes on disk
against a real scoring's; its wall time from the teacher itself, never "0.0 GPU-hours" for a CPU job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}


def stage1(teacher: Path, corpus, out: Path, logs: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["teacher.embedded=false", "teacher.name=micro", f"teacher.model={teacher}", "data=open-web-math",
            "data.name=owm-micro", "data.source=files", "data.hub_id=null", "data.rows_per_shard=40",
            f"data.files=[{','.join(str(f) for f in corpus)}]", f"output_dir={out}", "progress=false",
            f"hydra.run.dir={logs}", *extra]
    return subprocess.run([sys.executable, "-m", "stages.score_teacher", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=ENV)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("case", ["window past the positions", "another window"])
def test_the_plan_refuses_what_the_run_refuses_with_its_error(case, micro_teacher, micro_corpus, micro_scored, tmp_path):
    if case == "window past the positions":  # the micro teacher has 64 positions
        out, extra = tmp_path / "scored", ["teacher.window=128"]
    else:  # the scored folder holds windows of 64 (stride 32)
        out, extra = micro_scored, ["teacher.window=48"]
    before = sorted(p.name for p in Path(out).iterdir()) if Path(out).exists() else None
    plan = stage1(micro_teacher, micro_corpus, out, tmp_path / "logs-plan", *extra, "plan=true")
    run = stage1(micro_teacher, micro_corpus, out, tmp_path / "logs-run", *extra)  # refused before Ray
    assert run.returncode == 2 and run.stderr.startswith("error: "), run.stderr[-2000:]
    assert plan.returncode == 2, (plan.stdout[-2000:], plan.stderr[-2000:])
    assert plan.stderr == run.stderr and "the bill before the run" not in plan.stdout
    assert (sorted(p.name for p in Path(out).iterdir()) if Path(out).exists() else None) == before
    if case == "another window":
        assert "windows.window: 64 != 48" in flat(plan.stderr)
    else:
        assert "does not fit the 64 positions" in plan.stderr


def test_the_plan_of_a_finished_folder_keeps_its_shards(micro_teacher, micro_corpus, micro_scored, tmp_path):
    same = stage1(micro_teacher, micro_corpus, micro_scored, tmp_path / "logs", "teacher.window=64",
                  "teacher.stride=32", "plan=true", "plan_measure=false")
    assert same.returncode == 0, same.stderr[-2000:]
    assert "4 of up to 40 documents; 4 already done (kept)" in flat(same.stdout)
    rescored = stage1(micro_teacher, micro_corpus, micro_scored, tmp_path / "logs-2", "teacher.window=48",
                      "overwrite=true", "plan=true", "plan_measure=false")  # the run would rescore every shard
    assert rescored.returncode == 0, rescored.stderr[-2000:]
    assert "4 of up to 40 documents; 0 already done" in flat(rescored.stdout)
    assert json.loads((micro_scored / "manifest.json").read_text())["identity"]["windows"]["window"] == 64  # untouched


def test_the_bill_measures_a_small_teacher_and_its_bytes_land_in_its_range(micro_teacher, micro_corpus, micro_scored,
                                                                           tmp_path):
    """plan_measure unset: the micro teacher is small, so it is loaded and timed here; the bytes on
    disk (its own losses, shards of data.rows_per_shard) land near a real scoring's (4 shards of the
    same corpus; the rehearsal's losses alone priced them 25% high: this weak teacher's compress better)."""
    res = stage1(micro_teacher, micro_corpus, tmp_path / "scored", tmp_path / "logs", "teacher.window=64",
                 "teacher.stride=32", "ray.num_cpus=2", "pool.num_cpus=1", "plan=true")
    assert res.returncode == 0, res.stderr[-2000:]
    out = flat(res.stdout)
    assert "GPU-hours" not in out and "actor-hours" in out
    # timed as the run runs: ray.num_cpus=2 over 1 CPU each is 2 actors at once, each timed while the other scores
    found = re.search(r"at ([\d,]+) teacher tokens/s per actor \(1 CPU\) \(measured here: 2 actors running together, "
                      r"as the run runs them, ([\d,]+) positions in ([\d.]+) s on cpu \(transformers, \w+, 1 torch "
                      r"thread\(s\) each\)", out)
    assert found, out[-3000:]
    assert float(found.group(3)) > 0 and int(found.group(2).replace(",", "")) > 0  # timed: all 76 short documents, or 5 s
    assert re.search(r"the machine's load average was [\d.]+ on \d+ CPU\(s\) meanwhile", out), out[-3000:]
    assert re.search(r"wall time\W+about [\d.,]+ (s|min|h) with the 2 actor\(s\) of this machine's local Ray cluster "
                     r"\(scoring only: Ray's start and each actor's load of the teacher \([\d.,]+ (s|min) here\) "
                     r"not included\)", out), out[-3000:]
    per_token = float(re.search(r"([\d.]+) bytes per teacher token", out).group(1))
    real = json.loads((micro_scored / "manifest.json").read_text())["totals"]
    files = sum(p.stat().st_size for p in micro_scored.glob("shard-*"))  # shards and their markers
    assert per_token == pytest.approx(files / real["tokens"], rel=0.05), (per_token, files / real["tokens"])
    assert "the losses column priced with this teacher's own losses" in out


def test_an_unmeasured_cpu_job_says_it_has_no_rate_and_the_rehearsal_basis(micro_teacher, micro_corpus, tmp_path):
    res = stage1(micro_teacher, micro_corpus, tmp_path / "scored", tmp_path / "logs", "teacher.window=64",
                 "plan=true", "plan_measure=false")
    assert res.returncode == 0, res.stderr[-2000:]
    out = flat(res.stdout)
    assert "0.0 GPU-hours" not in out and "GPU-hours" not in out
    assert "no rate: this CPU job's teacher not measured (plan_measure=false)" in out
    assert "the losses priced with the rehearsal teacher's: real teachers' losses took 0.96-1.10x" in out
