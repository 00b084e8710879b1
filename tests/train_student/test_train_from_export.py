"""``data.export``: stage 2 trains on ``make export-student``'s rows (pipeline/train_student/from_export.py).

The reference is stage 2 itself on the scored folders: the same settings must log the same steps
(samples, losses, gradient norms, selection) to the last bit, on one teacher and on two. An
export made with other settings is refused, each difference named.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from pipeline.export_student.config import DataConfig, ExportConfig, ExportJobConfig, StudentConfig
from pipeline.export_student.job import run_export
from pipeline.student_data.settings import AlignmentConfig
from pipeline.train_student.from_export import ExportMismatchError
from pipeline.train_student.config import MixtureCorpus
from pipeline.train_student.run import run_training
from pipeline.student_data.settings import StudentDataError
from stages.train_student import print_summary
from storage_schemas import file_sha256
from test_multi_teacher import rewrite
from test_train_student import CrashAt, make_job, metrics

REPO = Path(__file__).resolve().parents[2]
# Logged per step; the rest (time, throughput) depends on the machine.
COMPARED = ("step", "loss", "grad_norm", "learning_rate", "epoch", "loss_kept", "loss_all", "kept_fraction",
            "mapped_fraction", "teacher_loss_kept", "teacher_loss_dropped", "excess_loss", "sample_first",
            "sample_last", "tokens_seen")


def make_export(student: Path, folders, out: Path, loss: dict | None = None, **export) -> ExportJobConfig:
    """An export with stage 2's defaults for sequences of 32 (``export`` settings: layout, shards ...)."""
    folders = [str(f) for f in (folders if isinstance(folders, list) else [folders])]
    return ExportJobConfig(student=StudentConfig(name="t", model=str(student), seq_len=32),
                           data=DataConfig(folders=folders, cache_dir=str(out.parent / "lengths")),
                           export=ExportConfig(**{"rows_per_shard": 16, "progress": False, **export}),
                           alignment=AlignmentConfig(**(loss or {})), output_dir=str(out))


def compared(run: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    return [{k: r[k] for k in (*COMPARED, *extra)} for r in metrics(run)]


def from_export(job, export: Path, folders: list | None = None):
    return replace(job, data=replace(job.data, export=str(export),
                                     folders=job.data.folders if folders is None else folders))


@pytest.fixture(scope="module")
def exported(tiny_student, micro_scored, tmp_path_factory) -> Path:
    """The micro scored dataset exported for the tiny student as stage 2's defaults pack it
    (sequences of 32, several shards of 16 rows)."""
    out = tmp_path_factory.mktemp("export") / "tiny-packed"
    run_export(make_export(tiny_student, micro_scored, out))
    return out


def test_training_from_the_export_logs_the_steps_of_training_from_the_folders(tiny_student, micro_scored, exported,
                                                                             tmp_path):
    """Same samples in the same order, same losses and selection at every step; a run from the
    export killed after step 5 resumes to the same steps; the data identity records the export."""
    folders = make_job(tiny_student, micro_scored, tmp_path / "folders", steps=6, workers=1)
    run_training(folders)
    export_job = from_export(replace(folders, output_dir=str(tmp_path / "export-run")), exported)
    with pytest.raises(KeyboardInterrupt):
        run_training(export_job, callbacks=[CrashAt(5)])
    summary = run_training(export_job)
    assert summary.resumed_from.endswith("checkpoint-4")
    assert compared(tmp_path / "export-run") == compared(tmp_path / "folders")
    assert summary.data["export"] == str(exported) and summary.data["n_samples"] > 48
    console = Console(width=300, record=True)
    print_summary(summary, console)
    assert f"{exported} (its rows as exported: nothing tokenized or aligned)" in console.export_text()
    identity = json.loads((tmp_path / "export-run" / "final" / "data_identity.json").read_text())
    assert identity["export"]["student"]["tokenizer_sha256"] and identity["export"]["packing"]["seq_len"] == 32


def test_two_teachers_from_the_export_log_what_the_folders_give(tiny_student, micro_scored, tmp_path):
    def change(doc):
        return replace(doc, losses=(doc.losses[::-1].copy() + np.float32(0.25)).astype(np.float32))

    other = rewrite(micro_scored, tmp_path / "b", "micro-b", change)
    job = make_job(tiny_student, micro_scored, tmp_path / "folders", steps=3)
    job = replace(job, data=replace(job.data, folders=[str(micro_scored), str(other)]),
                  alignment=AlignmentConfig(combine="weighted", teacher_weights=[2.0, 1.0]))
    run_training(job)
    run_export(make_export(tiny_student, [micro_scored, other], tmp_path / "export",
                           loss={"combine": "weighted", "teacher_weights": [2.0, 1.0]}))
    run_training(from_export(replace(job, output_dir=str(tmp_path / "export-run")), tmp_path / "export"))
    extra = ("decided_t0", "decided_t1", "mapped_fraction_t0", "mapped_fraction_t1", "selection_jaccard_t0_t1")
    assert compared(tmp_path / "export-run", extra) == compared(tmp_path / "folders", extra)


def test_an_export_made_with_other_settings_is_refused_naming_each(tiny_student, micro_scored, exported, tmp_path):
    job = from_export(make_job(tiny_student, micro_scored, tmp_path / "run", steps=2), exported)
    job = replace(job, student=replace(job.student, seq_len=16), data=replace(job.data, seed=3),
                  alignment=replace(job.alignment, aggregate="mean"))
    with pytest.raises(ExportMismatchError) as refused:
        run_training(job)
    lines = str(refused.value).splitlines()
    assert lines[0] == f"data.export: {exported} was exported with other settings than this run's:"
    assert sorted(line.strip() for line in lines[1:-1]) == sorted([
        "student.seq_len: the export has 32, this run 16", "data.seed: the export has 0, this run 3",
        "loss.aggregate: the export has 'max', this run 'mean'"])
    assert not (tmp_path / "run").exists(), "refused before anything is written"

    other_teacher = rewrite(micro_scored, tmp_path / "other", "micro-other")
    with pytest.raises(ExportMismatchError, match="teacher: the export was made from the scored data of micro, "
                                                  "data.folders hold micro-other"):
        run_training(from_export(make_job(tiny_student, micro_scored, tmp_path / "run", steps=2), exported,
                                 folders=[str(other_teacher)]))


def test_exports_that_cannot_be_trained_on_are_refused(tiny_student, micro_scored, exported, tmp_path):
    job = make_job(tiny_student, micro_scored, tmp_path / "run", steps=2)

    def refused(folder) -> str:
        with pytest.raises((ExportMismatchError, StudentDataError)) as err:
            run_training(from_export(job, folder))
        assert not (tmp_path / "run").exists()
        return str(err.value)

    partial = tmp_path / "partial"
    run_export(make_export(tiny_student, micro_scored, partial, limit_shards=1))
    assert "is incomplete (1 of" in refused(partial) and "run the same make export-student command again" in refused(partial)
    documents = tmp_path / "documents"
    run_export(make_export(tiny_student, micro_scored, documents, layout="documents"))
    assert "export.layout=packed" in refused(documents)
    assert "is not an export's" in refused(micro_scored)
    damaged = tmp_path / "damaged"
    shutil.copytree(exported, damaged)
    with open(damaged / "shard-000001.parquet", "ab") as f:
        f.write(b"x")
    assert f"{damaged / 'shard-000001.parquet'}: " in refused(damaged)

    # rows that are not where the manifest places them (a shard rewritten by hand, manifest updated)
    moved = tmp_path / "moved"
    shutil.copytree(exported, moved)
    shard = moved / "shard-000000.parquet"
    pq.write_table(pq.read_table(shard).take(list(range(15, -1, -1))), shard)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=shard.stat().st_size, sha256=file_sha256(shard))
    (moved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StudentDataError, match=f"{shard} row 0: holds sample 15, the manifest places sample 0 there"):
        run_training(from_export(job, moved))


def test_a_mixture_corpus_given_as_its_export_trains_as_its_folders(tiny_student, micro_scored, exported, tmp_path):
    twin = rewrite(micro_scored, tmp_path / "twin", "micro")  # the same teacher, a second corpus folder
    job = make_job(tiny_student, micro_scored, tmp_path / "folders", steps=3)
    mixture = [MixtureCorpus("a", 2.0, folders=[str(twin)]), MixtureCorpus("b", 1.0, folders=[str(micro_scored)])]
    run_training(replace(job, data=replace(job.data, folders=[], mixture=mixture)))
    exported_b = [mixture[0], MixtureCorpus("b", 1.0, export=str(exported))]
    run_training(replace(job, output_dir=str(tmp_path / "export-run"),
                         data=replace(job.data, folders=[], mixture=exported_b)))
    extra = ("mixture_share_a", "mixture_share_b")
    assert compared(tmp_path / "export-run", extra) == compared(tmp_path / "folders", extra)


def test_an_export_with_other_settings_through_the_entry_point(tiny_student, micro_scored, exported, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "stages.train_student", f"hydra.run.dir={tmp_path}/logs", f"output_dir={tmp_path}/run",
         "student.embedded=false", f"student.model={tiny_student}", "student.seq_len=16", f"data.folders=[{micro_scored}]",
         f"data.export={exported}", "train.max_steps=2", "data.held_out_shards=0", "train.eval_every=null"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: data.export: {exported} was exported with other settings")
    assert "student.seq_len: the export has 32, this run 16" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.long
def test_export_training_and_its_bill_count_the_same_student_tokens(tiny_student, micro_scored, tmp_path):
    """Through the commands, on every shard (none held out): make export-student, train-student from
    the export and from the scored folder, and train-student's plan=true all report as "student tokens"
    the documents' own tokens in one pass, counted here by tokenizing the scored shards' texts; the
    export's rows hold the stream (each document with BOS and EOS) in rows of 32 overlapping by one,
    and the run's summary.json names both counts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_student))
    texts = [t for f in sorted(Path(micro_scored).glob("shard-*.parquet")) for t in pq.read_table(f)["text"].to_pylist()]
    lengths = [len(ids) for ids in tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]]
    student_tokens = sum(lengths)
    stream = sum(n + 2 for n in lengths if n)  # BOS and EOS around each document with a token
    rows = (stream - 1) // 32

    common = ["student.embedded=false", f"student.model={tiny_student}", "student.seq_len=32",
              f"data.folders=[{micro_scored}]", f"data.cache_dir={tmp_path}/lengths", "data.held_out_shards=0",
              f"hydra.run.dir={tmp_path}/logs"]
    train = [*common, "train.eval_every=null", "train.max_steps=3", "train.micro_batch_size=2",
             "train.gradient_accumulation_steps=1", "train.warmup_steps=0", "data.num_workers=0", "train.use_cpu=true",
             "train.report_to=[]", "train.cpu_threads=1", "train.progress=false"]

    def stage(name: str, *args: str) -> str:
        result = subprocess.run([sys.executable, "-m", f"stages.{name}", *args], cwd=REPO, capture_output=True,
                                text=True, timeout=600, env={**os.environ, "COLUMNS": "400"})
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    export = tmp_path / "export"
    said = stage("export_student", *common, f"output_dir={export}", "export.progress=false")
    assert f"{rows:,} (packed), {student_tokens:,} student tokens ({rows * 32 + 1:,} stream tokens in the rows" in said
    assert json.loads((export / "manifest.json").read_text())["totals"]["tokens"] == rows * 32 + 1
    plan = stage("train_student", *train, f"output_dir={tmp_path}/plan", "plan=true")
    assert f"student tokens │ {student_tokens:,} " in plan and f"({stream:,} stream tokens" in plan
    for source, args in (("folders", ()), ("export", (f"data.export={export}",))):
        said = stage("train_student", *train, f"output_dir={tmp_path}/run-{source}", *args)
        assert f"{student_tokens:,} student tokens ({stream:,} stream tokens: BOS/EOS and every pass)" in said, source
        data = json.loads((tmp_path / f"run-{source}" / "summary.json").read_text())["data"]
        assert (data["student_tokens"], data["n_tokens"], data["n_samples"]) == (student_tokens, stream, rows), source
