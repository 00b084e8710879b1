"""Scored shards damaged without changing their size (docs/RELIABILITY.md, "Stage 2"): a loss
overwritten in place (same bytes, same footer, same row count; only the sha256 differs from the
manifest's), through the real commands. Stage 2's default (``data.verify=size``) refuses a loss no
teacher gives when it decodes the row; the export checks every shard's sha256, so it also refuses
a changed byte that leaves a plausible loss.

The damage is made by hand: the dataset is first written again uncompressed and without
dictionaries (its manifest entries and markers updated, so it is a consistent dataset), which
leaves every loss in the file as its four float32 bytes."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from storage_schemas import file_sha256, marker_of, read_manifest
from storage_schemas.reader import BadShardError, ShardReader, open_scored_dataset

from test_train_student import metrics

REPO = Path(__file__).resolve().parents[2]
TOKEN = 5  # the damaged loss of a document


def plain_copy(src: Path, dst: Path, row_group_size: int | None = None) -> Path:
    shutil.copytree(src, dst)
    manifest = read_manifest(dst)
    for entry in manifest["shards"]:
        path = dst / entry["file"]
        pq.write_table(pq.read_table(path), path, compression="none", use_dictionary=False,
                       row_group_size=row_group_size)
        entry["bytes"], entry["sha256"] = path.stat().st_size, file_sha256(path)
        (dst / marker_of(entry["file"])).write_text(json.dumps(entry))
    (dst / "manifest.json").write_text(json.dumps(manifest))
    open_scored_dataset([dst], verify="sha256")  # a consistent dataset before the damage
    return dst


def first_shard_read(folder: Path) -> str:
    """The shard stage 2 reads first with data.seed=0 (METHOD §2.4: shards permuted by default_rng([seed, epoch]))."""
    shards = read_manifest(folder)["shards"]
    return shards[int(np.random.default_rng([0, 0]).permutation(len(shards))[0])]["file"]


def damage(folder: Path, file: str, row: int, change) -> tuple[str, float]:
    """Loss ``TOKEN`` of row ``row`` rewritten in place as ``change(its four bytes)``; returns the
    document's id and the loss it now reads as."""
    path = folder / file
    table = pq.read_table(path)
    losses = np.asarray(table.column("losses")[row].as_py(), np.float32)
    data = bytearray(path.read_bytes())
    pattern = losses.astype("<f4").tobytes()  # the document's losses, one after the other
    start = data.find(pattern)
    assert len(losses) > 2 * TOKEN and start >= 0 and data.find(pattern, start + 1) < 0
    at = start + 4 * TOKEN
    size = len(data)
    data[at:at + 4] = change(bytes(data[at:at + 4]))
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size and pq.read_table(path).num_rows == table.num_rows  # footer intact
    return table.column("doc_id")[row].as_py(), struct.unpack("<f", bytes(data[at:at + 4]))[0]


def run(stage: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"stages.{stage}", f"hydra.run.dir={tmp_path / 'logs'}",
                           f"artifacts_dir={tmp_path / 'artifacts'}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"})


def student_args(student: Path, folder: Path, tmp_path: Path) -> list[str]:
    return ["student.embedded=false", "student.name=t", f"student.model={student}", "student.seq_len=32",
            f"data.folders=[{folder}]", f"data.cache_dir={tmp_path / 'lengths'}"]


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def test_stage2_refuses_an_impossible_loss_naming_the_shard_and_the_document(micro_scored, tiny_student, tmp_path):
    folder = plain_copy(micro_scored, tmp_path / "scored")
    file = first_shard_read(folder)
    doc, value = damage(folder, file, row=7, change=lambda _: struct.pack("<f", 2.5e38))
    assert value == np.float32(2.5e38)
    out = tmp_path / "run"
    line = one_line(run("train_student", tmp_path, *student_args(tiny_student, folder, tmp_path),
                        "data.held_out_shards=0", "train.eval_every=null", "train.max_steps=4",
                        "train.micro_batch_size=2", "train.gradient_accumulation_steps=1", "train.save_steps=2",
                        "train.use_cpu=true", "train.report_to=[]", "train.cpu_threads=1", "train.progress=false",
                        f"output_dir={out}"))
    assert line.startswith(f"error: {folder / file}: document {doc!r} (row 7) has teacher loss 2.5e+38 at token "
                           f"{TOKEN}, which no teacher gives"), line
    assert f"delete {marker_of(file)} beside it and run make score-teacher" in line, line
    assert "Training stopped at step 0 of 4: no checkpoint of this run yet: the same command starts it again" in line
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists() and not (out / ".final.tmp").exists()

    # each kind of impossible loss, in the reader every stage-2 path reads rows with (its own worker's)
    for bad, shown in ((float("inf"), "inf"), (-0.5, "-0.5"), (1.5e4, "1.5e+04")):
        other = plain_copy(micro_scored, tmp_path / f"scored-{shown}")
        doc, _ = damage(other, file, row=3, change=lambda _: struct.pack("<f", bad))
        [shard] = [s for s in open_scored_dataset([other]).shards if s.path.name == file]
        with pytest.raises(BadShardError) as err:
            ShardReader([shard]).row(0, 0)
        assert f"document {doc!r} (row 3) has teacher loss {shown} at token {TOKEN}" in str(err.value)
    # NaN is a loss the contract allows (nothing predicted the token), and a loss of 1e4 nats is read
    other = plain_copy(micro_scored, tmp_path / "scored-nan")
    damage(other, file, row=3, change=lambda _: struct.pack("<f", float("nan")))
    damage(other, file, row=4, change=lambda _: struct.pack("<f", 1e4))
    [shard] = [s for s in open_scored_dataset([other]).shards if s.path.name == file]
    assert np.isnan(ShardReader([shard]).row(0, 3).losses[TOKEN]) and ShardReader([shard]).row(0, 4).losses[TOKEN] == 1e4


def test_the_export_checks_every_shards_sha256_and_refuses_a_flipped_byte(micro_scored, tiny_student, tmp_path):
    """The lowest byte of a loss flipped: a plausible loss (it differs in its last bits), so only the
    sha256 tells; the export refuses it by default, in one line, before its folder or the length
    cache exists."""
    folder = plain_copy(micro_scored, tmp_path / "scored")
    file = read_manifest(folder)["shards"][2]["file"]
    loss = np.float32(pq.read_table(folder / file).column("losses")[3].as_py()[TOKEN])
    _, value = damage(folder, file, row=3, change=lambda b: bytes([b[0] ^ 0x01]) + b[1:])
    assert value != loss and abs(value - loss) < 1e-5 * max(loss, 1)  # still a loss a teacher could give
    out = tmp_path / "export"
    line = one_line(run("export_student", tmp_path, *student_args(tiny_student, folder, tmp_path),
                        "export.progress=false", f"output_dir={out}"))
    assert f"{folder / file}: checksum mismatch: sha256 {file_sha256(folder / file)[:16]}..." in line, line
    assert f"delete its marker first, {marker_of(file)}" in line, line
    assert not out.exists() and not (tmp_path / "lengths").exists()


STEP_SAMPLES = 4  # micro-batches of 2, accumulated twice


def training_args(student: Path, folder: Path, tmp_path: Path, run: str, steps: int) -> list[str]:
    return [*student_args(student, folder, tmp_path), "data.held_out_shards=0", "train.eval_every=null",
            f"train.max_steps={steps}", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
            "train.save_steps=1000", "train.logging_steps=1", "train.warmup_steps=2", "train.use_cpu=true",
            "train.report_to=[]", "train.cpu_threads=1", "train.progress=false", f"output_dir={tmp_path / run}"]


def first_reads(folder: Path, student: Path, file: str) -> dict[int, int]:
    """Row group of ``file`` -> the first packed sample that takes a document from it, from the
    packing plan an independent build of the same data gives (the run decodes a row group, and
    checks its losses, when a sample first needs one of its documents)."""
    from pipeline.method.tokenization import load_tokenizer
    from pipeline.student_data.build import build_student_data
    from pipeline.student_data.settings import AlignmentConfig, PackingConfig

    data = build_student_data(open_scored_dataset([folder]), load_tokenizer(str(student)), PackingConfig(seq_len=32),
                              AlignmentConfig())
    plan, shards, first = data.plan, data.scored.shards, {}
    for k in range(plan.n_samples):
        for d, _, _ in plan.documents_of(k):
            shard = shards[int(plan.doc_shard[d])]
            if shard.path.name == file:
                first.setdefault(shard.row_group_of(int(plan.doc_row[d]))[0], k)
        if len(first) == len(shards[0].row_group_rows) or k > 200:
            return first
    return first


@pytest.mark.long
def test_a_damaged_shard_met_mid_training_stops_with_a_checkpoint_and_the_rerun_resumes_exactly(
        micro_scored, tiny_student, tmp_path):
    """The damaged loss sits in a row group the run first needs at step N+1 (row groups of 4 rows):
    the run stops there in one line naming the shard, how to score it again and checkpoint-N, saved
    at the step reached (train.save_steps is past the run's end), and why data.on_bad_shard=skip
    cannot resume it. The shard's bytes put back (what scoring it again writes: stage 1 is
    deterministic) and the same command run again, it resumes from checkpoint-N and ends with an
    uninterrupted run's per-step figures and final weights, bit for bit."""
    from test_faults_stage2 import assert_same_training, complete_steps

    steps = 12
    folder = plain_copy(micro_scored, tmp_path / "scored", row_group_size=4)
    file = first_shard_read(folder)
    group, k = next((g, k) for g, k in sorted(first_reads(folder, tiny_student, file).items(), key=lambda x: x[1])
                    if 3 * STEP_SAMPLES <= k < (steps - 2) * STEP_SAMPLES)
    stopped_at = k // STEP_SAMPLES  # the steps done before the one that needs the row group
    reference = tmp_path / "reference"
    assert run("train_student", tmp_path, *training_args(tiny_student, folder, tmp_path, "reference", steps)).returncode == 0

    original = (folder / file).read_bytes()
    rows = pq.ParquetFile(folder / file).metadata.row_group(0).num_rows
    doc = None
    for row in range(group * rows, (group + 1) * rows):
        try:
            doc, _ = damage(folder, file, row, change=lambda _: struct.pack("<f", float("inf")))
            break
        except AssertionError:
            continue  # a row too short, or whose losses repeat elsewhere in the file
    assert doc is not None
    command = training_args(tiny_student, folder, tmp_path, "run", steps)
    line = one_line(run("train_student", tmp_path, *command))
    run_dir = tmp_path / "run"
    checkpoint = run_dir / f"checkpoint-{stopped_at}"
    assert line.startswith(f"error: {folder / file}: document {doc!r} (row "), line
    assert f"delete {marker_of(file)} beside it and run make score-teacher" in line, line
    assert line.endswith(
        f"Training stopped at step {stopped_at} of {steps}: the same command resumes from checkpoint-{stopped_at} "
        f"({checkpoint}) once the shard is scored again. data.on_bad_shard=skip cannot resume this run (leaving the "
        "shard out changes the samples of every later step); it trains a new run without the shard: the same command "
        "with data.on_bad_shard=skip and run_name=<a new name> (or overwrite=true)"), line
    assert complete_steps(run_dir) == [stopped_at] and max(r["step"] for r in metrics(run_dir)) == stopped_at
    assert not (run_dir / "final").exists()

    (folder / file).write_bytes(original)  # scored again
    rerun = run("train_student", tmp_path, *command)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert_same_training(run_dir, reference, steps)
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == str(checkpoint)
