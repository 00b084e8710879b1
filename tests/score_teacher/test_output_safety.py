"""Stage 1 never loses a scored dataset, and never writes where it should not: a folder of another
kind or one holding its inputs is refused whatever ``overwrite`` says; ``overwrite=true`` sets the
old shards aside until the new scoring has finished one, and gives them back if it fails before;
your own corpus never lands in the sample's folder; a failed start leaves nothing behind; a full
or read-only disk is one line. The reference is always the folder as it was, read byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.folders.output_folder import set_aside
from pipeline.score_teacher.job import run_score_job
from pipeline.score_teacher.pool import ShardFailedError
from pipeline.score_teacher.writer import SCORED, DatasetMismatchError
from pipeline.folders.shard_folder import output_entries
from storage_schemas import read_manifest
from test_faults_stage1 import tiny_filesystem  # noqa: F401  (a fixture: a small tmpfs)
from test_score_job import job

REPO = Path(__file__).resolve().parents[2]


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def stage1(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.score_teacher", f"hydra.run.dir={tmp_path / 'logs'}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"})


def one_line(result, *words: str) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), result.stderr[-3000:]
    assert all(w in lines[-1] for w in words), (words, lines[-1])
    return lines[-1]


def test_your_own_files_with_the_sample_preset_are_refused_before_anything_is_built(tmp_path):
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text(json.dumps({"text": "1 + 1 = 2"}) + "\n")
    result = stage1(tmp_path, f"data.files=[{corpus}]", f"artifacts_dir={tmp_path / 'artifacts'}",
                    f"output_root={tmp_path / 'scored'}")
    line = one_line(result, "data.files: your own corpus, while data.name is 'owm-sample'",
                    "data.name=<a name for your corpus> data.embedded=false")
    assert "overwrite" not in line
    assert not (tmp_path / "scored").exists() and not (tmp_path / "artifacts").exists(), "nothing built or written"


def test_your_own_files_with_a_name_of_their_own_ask_only_for_data_embedded_false(tmp_path):
    """A name given, data.embedded=false forgotten: the one line asks for what is missing, never for the
    name just given."""
    assert yaml.safe_load((REPO / "conf" / "data" / "sample.yaml").read_text())["name"] == "owm-sample"  # stages.score_teacher.SAMPLE_NAME
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text(json.dumps({"text": "1 + 1 = 2"}) + "\n")
    result = stage1(tmp_path, "data.name=my-corpus", "data.source=files", f"data.files=[{corpus}]",
                    f"artifacts_dir={tmp_path / 'artifacts'}", f"output_root={tmp_path / 'scored'}")
    assert one_line(result) == ("error: data.files: your own corpus 'my-corpus' still has the embedded sample's "
                                "settings (data=sample, the default): add data.embedded=false to score it as your own")
    assert not (tmp_path / "scored").exists() and not (tmp_path / "artifacts").exists(), "nothing built or written"


def student_run_folder(folder: Path) -> dict[str, str]:
    for name, data in {"run.json": b"{}", "metrics.jsonl": b'{"step": 2}\n', "final/config.json": b"{}",
                       "checkpoint-2/model.safetensors": b"weights"}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return tree(folder)


def test_a_folder_of_another_kind_is_refused_whatever_overwrite_says(micro_teacher, micro_corpus, tmp_path):
    run = tmp_path / "students" / "run"
    before = student_run_folder(run)
    result = stage1(tmp_path, "teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.stride=null",
                    "data.embedded=false", "data.name=micro", f"data.files=[{micro_corpus[0]}]", f"output_dir={run}",
                    "overwrite=true")
    one_line(result, f"error: {run}: is not empty and holds no scored dataset (checkpoint-2, final, metrics.jsonl",
             "whatever overwrite says", "choose another output_dir")
    assert tree(run) == before


def test_an_output_folder_holding_the_teacher_or_the_corpus_is_refused(micro_teacher, micro_corpus, tmp_path):
    teacher = shutil.copytree(micro_teacher, tmp_path / "models" / "micro")
    before = tree(tmp_path / "models")
    with pytest.raises(DatasetMismatchError, match=r"output_dir .*models holds teacher.model .*whatever overwrite says"):
        run_score_job(job(teacher, micro_corpus[:1], tmp_path / "models", overwrite=True))
    assert tree(tmp_path / "models") == before
    corpus = shutil.copy(micro_corpus[0], tmp_path / "shard-000000.parquet")  # a corpus file named like a shard
    with pytest.raises(DatasetMismatchError, match=r"holds the corpus file"):
        run_score_job(job(micro_teacher, [corpus], tmp_path, overwrite=True))
    assert Path(corpus).is_file()


@pytest.mark.long
def test_overwrite_sets_the_old_dataset_aside_and_gives_it_back_when_the_new_scoring_fails_or_is_killed(
        micro_teacher, micro_corpus, ray_local, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    run_score_job(job(micro_teacher, micro_corpus[:1], out, rows=200))  # one shard
    before = tree(out)

    other = job(micro_teacher, micro_corpus[1:], out, rows=200)  # another corpus, no data.name of its own
    with pytest.raises(DatasetMismatchError) as refused:
        run_score_job(other)
    for words in ("holds another corpus ('micro')", "data.name=<a name for your corpus>",
                  "overwrite=true to rescore it: it deletes its 1 shard(s) (shard-000000) and manifest.json, README.md, "
                  "once the new run has finished its first shard"):
        assert words in str(refused.value), str(refused.value)

    faults = {"counter_dir": str(tmp_path / "tries"), "shards": {"0": {"error": "bug", "times": 1}}}
    monkeypatch.setenv("VOCAGNO_INJECT_FAULTS", json.dumps(faults))
    with pytest.raises(ShardFailedError, match="injected fault"):
        run_score_job(job(micro_teacher, micro_corpus[1:], out, rows=200, overwrite=True))
    assert tree(out) == before, "the failed overwrite gave the old dataset back whole"
    monkeypatch.delenv("VOCAGNO_INJECT_FAULTS")

    done = run_score_job(job(micro_teacher, micro_corpus[1:], out, rows=200, overwrite=True))
    assert done.complete and done.shards_scored == 1
    assert read_manifest(out)["identity"]["corpus"]["name"] == "micro" and len(read_manifest(out)["shards"]) == 1
    assert not [p for p in out.iterdir() if p.name.startswith((".replac", ".restoring", ".deleting"))]
    assert tree(out)["shard-000000.parquet"] != before["shard-000000.parquet"], "the new corpus's shard"

    # Killed after an overwrite set the shards aside and started its manifest: the same command
    # again puts them back and finds every shard done.
    after = tree(out)
    set_aside(out, output_entries(SCORED))
    (out / "manifest.json").write_text('{"schema_version": 1}')
    again = run_score_job(job(micro_teacher, micro_corpus[1:], out, rows=200))
    assert again.shards_scored == 0 and again.shards_done_before == 1, "the old shards were found again"
    assert tree(out) == after


def test_a_failed_start_leaves_no_folder_and_no_manifest(micro_teacher, micro_corpus, ray_local, tmp_path):
    broken = shutil.copytree(micro_teacher, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # the actors cannot load it
    out = tmp_path / "new" / "micro" / "v1"
    with pytest.raises(Exception, match="(?i)safetensors|header|load"):
        run_score_job(job(broken, micro_corpus[:1], out, rows=200))
    assert not (tmp_path / "new").exists(), "no manifest, no lock, no folder left"


def test_a_read_only_output_folder_is_one_line(micro_teacher, micro_corpus, tmp_path, tiny_filesystem):
    out = tiny_filesystem(64, read_only=True) / "ds"
    result = stage1(tmp_path, "teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.stride=null",
                    "data.embedded=false", "data.name=micro", f"data.files=[{micro_corpus[0]}]", f"output_dir={out}")
    assert one_line(result) == f"error: output_dir {out}: cannot be made (Read-only file system: {out}); choose another output_dir"


@pytest.mark.slow
def test_a_full_disk_is_one_line_through_the_command_line(micro_teacher, micro_corpus, tmp_path, tiny_filesystem):
    out = tiny_filesystem(300) / "ds"
    result = stage1(tmp_path, "teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.stride=null",
                    "data.embedded=false", "data.name=micro", f"data.files=[{','.join(map(str, micro_corpus))}]",
                    f"output_dir={out}", "data.rows_per_shard=10", "ray.num_cpus=2", "progress=false")  # ~420 kB
    line = one_line(result, "could not be written: No space left on device", "free space there")
    assert "on_bad_shard" not in result.stderr, line
    markers = {p.name.split(".")[0] for p in out.glob("shard-*.done.json")}
    assert markers == {p.name.split(".")[0] for p in out.glob("shard-*.parquet")}, "nothing half-written is taken for done"
