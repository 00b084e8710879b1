"""``overwrite=true`` through the real command: what its refusal says it deletes is what it deletes
(the shards, the manifest, the card and ``inspect/``'s reports of the old shards; the folder's other
files stay), and a SIGTERM while it starts up (its old shards set aside, Ray starting) ends it with
its one line and exit status 143, the old shards put back. The reference is the folder as it was,
read byte for byte."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def args(micro_teacher, micro_corpus, out: Path, logs: Path, *extra: str) -> list[str]:
    """micro_scored's job (conftest) with windows of 48: another setup than the folder's."""
    return [sys.executable, "-m", "stages.score_teacher", "teacher.embedded=false", "teacher.name=micro",
            f"teacher.model={micro_teacher}", "teacher.window=48", "teacher.stride=null", "data.embedded=false",
            "data.name=owm-micro", f"data.files=[{','.join(map(str, micro_corpus))}]", "data.rows_per_shard=40",
            "scorer.max_batch_tokens=2048", "pool.num_actors=1", "pool.num_cpus=1", "ray.num_cpus=2",
            "progress=false", f"output_dir={out}", f"hydra.run.dir={logs}", *extra]


@pytest.fixture
def scored_copy(micro_scored, tmp_path) -> Path:
    """A scored folder with make inspect's reports in it and a file of the user's own."""
    out = Path(shutil.copytree(micro_scored, tmp_path / "ds"))
    (out / "inspect").mkdir(exist_ok=True)
    (out / "inspect" / "summary.json").write_text("{}\n")
    (out / "notes.txt").write_text("mine\n")
    return out


def test_the_refusal_says_what_overwrite_deletes_and_it_deletes_that(micro_teacher, micro_corpus, scored_copy,
                                                                      tmp_path):
    before = tree(scored_copy)
    refused = subprocess.run(args(micro_teacher, micro_corpus, scored_copy, tmp_path / "logs"), cwd=REPO,
                             capture_output=True, text=True, timeout=300, env=ENV)
    assert refused.returncode == 2 and tree(scored_copy) == before, refused.stderr[-3000:]
    said = re.search(r"it deletes its (\d+) shard\(s\) \([^)]*\) and (.*?), once the new run", refused.stderr)
    assert said and said.group(1) == "4" and refused.stderr.rstrip().endswith("the folder's other files stay."), \
        refused.stderr[-2000:]
    named = said.group(2).split(", ")
    assert named == ["manifest.json", "README.md", "inspect/"]
    run = subprocess.run(args(micro_teacher, micro_corpus, scored_copy, tmp_path / "logs", "overwrite=true"),
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    after = tree(scored_copy)

    def named_by_the_refusal(path: str) -> bool:
        return path.startswith("shard-") or path in named or any(path.startswith(n) for n in named if n.endswith("/"))

    assert {p: h for p, h in before.items() if not named_by_the_refusal(p)} == \
        {p: h for p, h in after.items() if not named_by_the_refusal(p)} == {"notes.txt": before["notes.txt"]}, \
        "the folder's other files stay, byte for byte"
    assert not (scored_copy / "inspect").exists(), "inspect/ went with the shards it described"
    assert after["manifest.json"] != before["manifest.json"]


@pytest.mark.long
def test_sigterm_while_an_overwrite_starts_up_is_one_line_143_and_puts_the_old_shards_back(
        micro_teacher, micro_corpus, scored_copy, tmp_path):
    before = tree(scored_copy)
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths must fit
    proc = subprocess.Popen(args(micro_teacher, micro_corpus, scored_copy, tmp_path / "logs", "overwrite=true"),
                            cwd=REPO, env={**ENV, "RAY_TMPDIR": str(ray_tmp)}, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        # the old shards set aside, and Ray starting: its session folder made, its processes not yet all up
        while not (any(p.name.startswith(".replaced-") for p in scored_copy.iterdir())
                   and (ray_tmp / "ray" / "session_latest").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 143 and "Traceback" not in err, (proc.returncode, err[-3000:])
    assert lines[-1].startswith("interrupted (SIGTERM): "), err[-2000:]
    assert tree(scored_copy) == before, "the old shards, manifest, card and reports are back, byte for byte"
    assert not [p.name for p in scored_copy.iterdir() if p.name.startswith(".")], "no aside folder or lock left"
