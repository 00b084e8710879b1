"""``data.held_out_shards``: stage 2 never trains on the last N planned shards of its first scored
folder and records them in the run's data identity (``shards_held_out``); ``make eval-student``
with ``bits_per_byte.scored`` then measures exactly those shards, and refuses shards the run
trained on. A default run's identity and recipe are as they were before the setting existed.
Several teachers hold the same shards out of each; an export holds them out as stage 2 does, so a
run from it evaluates on the text of a run from the folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.runtime.config import ConfigError
from pipeline.evaluation.held_out import RUN_DATA_IDENTITY, text_digest
from pipeline.score_teacher.teacher import ShardResult
from pipeline.score_teacher.writer import write_manifest, write_shard
from pipeline.method.tokenization import encode_batch, load_tokenizer
from pipeline.train_student.checkpoints import DATA_IDENTITY_NAME, RunMismatchError
from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig
from pipeline.train_student.run import run_training
from storage_schemas.reader import ScoredDocument

REPO = Path(__file__).resolve().parents[2]
SHARDS, PER_SHARD = 4, 8
# The data identity of a run before data.held_out_shards existed: these keys, no others.
DEFAULT_IDENTITY_KEYS = {"folders", "teacher", "shards_used", "shards_skipped", "n_documents",
                         "student_tokenizer_sha256", "alignment", "packing"}


def scored_folder(folder: Path, tokenizer, texts: list[str], name: str = "t", shards: int = SHARDS,
                  per_shard: int = PER_SHARD) -> Path:
    """``texts`` scored with random losses in ``shards`` shards by the stage-1 writer (no Ray)."""
    rng = np.random.default_rng(0)
    encodings = encode_batch(tokenizer, texts)
    docs = [ScoredDocument(f"c.parquet:{i}", t, e.ids, e.starts, e.ends, rng.gamma(2.0, 1.0, len(e)).astype(np.float32))
            for i, (t, e) in enumerate(zip(texts, encodings))]
    identity = {"teacher": {"name": name}, "corpus": {"name": "c", "n_shards": shards, "rows_per_shard": per_shard}}
    folder.mkdir(parents=True)
    done = {i: write_shard(folder, i, ShardResult(documents=docs[i * per_shard:(i + 1) * per_shard]), identity,
                           {"index": i}, "t") for i in range(shards)}
    write_manifest(folder, identity, done, shards, "t")
    return folder


@pytest.fixture(scope="module")
def scored(micro_corpus, tiny_student, tmp_path_factory) -> Path:
    from pipeline.embedded.sample_corpus import clean_texts

    texts = clean_texts(micro_corpus)[: SHARDS * PER_SHARD]
    return scored_folder(tmp_path_factory.mktemp("held-out") / "scored", load_tokenizer(str(tiny_student)), texts)


def job(student: Path, folders: list[Path], out: Path, held_out: int) -> TrainJobConfig:
    return TrainJobConfig(
        student=StudentConfig(name="t", model=str(student), seq_len=32),
        data=DataConfig(folders=[str(f) for f in folders], num_workers=0, held_out_shards=held_out),
        train=TrainConfig(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=2, save_steps=2, report_to=[],
                          progress=False, use_cpu=True, cpu_threads=1),
        output_dir=str(out))


@pytest.fixture(scope="module")
def runs(tiny_student, scored, tmp_path_factory) -> dict[int, Path]:
    """Two finished runs on the same folder: nothing held out, and the last shard held out."""
    root = tmp_path_factory.mktemp("held-out-runs")
    for n in (0, 1):
        run_training(job(tiny_student, [scored], root / f"held{n}", n))
    return {n: root / f"held{n}" for n in (0, 1)}


def identity(run: Path, where: str = "final") -> dict:
    return json.loads((run / where / DATA_IDENTITY_NAME).read_text())


def shard_texts(scored: Path, file: str) -> list[str]:
    return pq.read_table(scored / file, columns=["text"]).column("text").to_pylist()


def eval_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.eval_student", "tasks=[]", "generation.cpu_threads=1", *args,
                           f"hydra.run.dir={tmp_path / 'logs'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_eval_reads_the_name_stage_2_writes():
    assert RUN_DATA_IDENTITY == DATA_IDENTITY_NAME


def test_a_default_run_records_the_identity_and_recipe_it_always_did(runs, scored):
    ident = identity(runs[0])
    assert set(ident) == DEFAULT_IDENTITY_KEYS
    assert [s["file"] for s in ident["shards_used"]] == [f"shard-{i:06d}.parquet" for i in range(SHARDS)]
    assert ident["n_documents"] == SHARDS * PER_SHARD
    recipe = json.loads((runs[0] / "run.json").read_text())["recipe"]
    assert "held_out_shards" not in recipe["data"]  # a run recorded before the setting resumes (same recipe)


def test_held_out_shards_are_never_trained_on_and_are_recorded(runs, scored):
    manifest = json.loads((scored / "manifest.json").read_text())
    last = manifest["shards"][-1]
    for where in ("final", "checkpoint-2"):
        ident = identity(runs[1], where)
        assert [s["file"] for s in ident["shards_used"]] == [f"shard-{i:06d}.parquet" for i in range(SHARDS - 1)]
        assert ident["shards_held_out"] == [{"file": last["file"], "folder": 0, "sha256": last["sha256"],
                                             "rows": PER_SHARD}]
        assert ident["n_documents"] == (SHARDS - 1) * PER_SHARD
    recipe = json.loads((runs[1] / "run.json").read_text())["recipe"]
    assert recipe == json.loads((runs[0] / "run.json").read_text())["recipe"]  # the data identity says it


def test_another_held_out_count_is_another_run_and_too_many_is_refused(tiny_student, scored, runs, tmp_path):
    with pytest.raises(RunMismatchError, match="data shards_held_out"):
        run_training(job(tiny_student, [scored], runs[1], 2))
    with pytest.raises(ConfigError, match=f"data.held_out_shards: {SHARDS} of the {SHARDS} planned shards .* leaves none"):
        run_training(job(tiny_student, [scored], tmp_path / "all", SHARDS))
    assert "held_out_shards: -1 must be >= 0" in DataConfig(folders=["x"], held_out_shards=-1).problems()


def stage(name: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m stages.<name>`` with the conf's defaults but for ``args``."""
    return subprocess.run([sys.executable, "-m", f"stages.{name}", f"hydra.run.dir={tmp_path / 'logs'}",
                           f"artifacts_dir={tmp_path / 'artifacts'}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"})


def short_run(student: Path, folders: list[Path], out: Path, *args: str) -> list[str]:
    """A short stage-2 run; ``data.held_out_shards`` and the evaluation's settings stay the conf's
    (the embedded recipe: one shard held out), but evaluating every 2 steps."""
    return ["student.embedded=false", f"student.model={student}", "student.seq_len=32",
            f"data.folders=[{','.join(map(str, folders))}]", f"data.cache_dir={out.parent / 'lengths'}",
            "train.max_steps=4", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1",
            "train.logging_steps=1", "train.save_steps=2", "train.warmup_steps=1", "train.eval_every=2",
            "train.use_cpu=true", "train.report_to=[]", "train.cpu_threads=1", "train.progress=false",
            f"output_dir={out}", *args]


def logs(run: Path) -> list[dict]:
    """Every figure of every log but those of the clock."""
    clock = ("time", "tokens_per_s", "eval_runtime", "train_runtime", "train_samples_per_second",
             "train_steps_per_second")
    return [{k: v for k, v in json.loads(line).items() if k not in clock}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_several_teachers_hold_the_same_shards_out_of_each(tiny_student, scored, micro_corpus, tmp_path):
    """Two teachers of one corpus in one shard plan: the last shard is held out of both (neither
    teacher's shards_used lists it) and evaluated on; a second teacher whose corpus was cut into
    other shards (the same documents, 2 shards of 16) is refused in one line naming the differences."""
    from pipeline.embedded.sample_corpus import clean_texts

    texts = clean_texts(micro_corpus)[: SHARDS * PER_SHARD]
    tokenizer = load_tokenizer(str(tiny_student))
    other = scored_folder(tmp_path / "second", tokenizer, texts, name="second")
    out = tmp_path / "two"
    done = stage("train_student", tmp_path, *short_run(tiny_student, [scored, other], out, "loss.combine=mean"))
    assert done.returncode == 0, done.stderr[-3000:]
    ident = identity(out)
    last = json.loads((scored / "manifest.json").read_text())["shards"][-1]
    assert ident["shards_held_out"] == [{"file": last["file"], "folder": 0, "sha256": last["sha256"], "rows": PER_SHARD}]
    kept = [f"shard-{i:06d}.parquet" for i in range(SHARDS - 1)]
    assert [[s["file"] for s in t["shards_used"]] for t in ident["teachers"]] == [kept, kept]
    assert [r["step"] for r in logs(out) if "eval_bits_per_byte" in r] == [2, 4]

    other_plan = scored_folder(tmp_path / "other-plan", tokenizer, texts, name="second", shards=2, per_shard=16)
    refused = stage("train_student", tmp_path, *short_run(tiny_student, [scored, other_plan], tmp_path / "refused"))
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr[-3000:]
    assert refused.stderr.startswith(
        "error: data.held_out_shards: 1 with several teachers holds the same shards out of each teacher's first folder, "
        f"so those must be one corpus in one shard plan; {other_plan} is not {scored}'s: corpus.n_shards: 4 != 2; "
        "corpus.rows_per_shard: 8 != 16."), refused.stderr
    assert not (tmp_path / "refused").exists()


@pytest.mark.long
def test_an_export_holds_the_same_shards_out_and_trains_and_evaluates_as_the_folders(tiny_student, scored, tmp_path):
    """make export-student and then make train-student ARGS="data.export=<export>" with the
    defaults of their confs (the embedded recipe holds one shard out): the export leaves the held-out
    shard's documents out and records it; the run from it logs every figure of the run from the
    scored folders, its held-out bits per byte included (the same text). An export that holds
    nothing out is refused for a run that holds a shard out."""
    export = tmp_path / "export"
    made = stage("export_student", tmp_path, "student.embedded=false", "student.name=t", f"student.model={tiny_student}",
                 "student.seq_len=32", f"data.folders=[{scored}]", f"data.cache_dir={tmp_path / 'lengths'}",
                 "export.progress=false", f"output_dir={export}")
    assert made.returncode == 0, made.stderr[-3000:]
    manifest = json.loads((export / "manifest.json").read_text())
    last = json.loads((scored / "manifest.json").read_text())["shards"][-1]
    assert manifest["identity"]["held_out_shards"] == 1
    assert manifest["identity"]["shards_held_out"] == [{"file": last["file"], "folder": 0, "sha256": last["sha256"],
                                                        "rows": PER_SHARD}]
    held = set(pq.read_table(scored / last["file"], columns=["doc_id"]).column("doc_id").to_pylist())
    exported = {d for e in manifest["shards"] for ids in pq.read_table(export / e["file"]).column("doc_ids").to_pylist()
                for d in ids}
    assert len(exported) == (SHARDS - 1) * PER_SHARD and not exported & held

    from_folders, from_export = tmp_path / "folders", tmp_path / "from-export"
    for out, extra in ((from_folders, ()), (from_export, (f"data.export={export}",))):
        done = stage("train_student", tmp_path, *short_run(tiny_student, [scored], out, *extra))
        assert done.returncode == 0, done.stderr[-3000:]
    assert logs(from_export) == logs(from_folders)
    assert [r["step"] for r in logs(from_export) if "eval_bits_per_byte" in r] == [2, 4]

    nothing_held = tmp_path / "export-0"
    made = stage("export_student", tmp_path, "student.embedded=false", "student.name=t", f"student.model={tiny_student}",
                 "student.seq_len=32", f"data.folders=[{scored}]", f"data.cache_dir={tmp_path / 'lengths'}",
                 "data.held_out_shards=0", "export.progress=false", f"output_dir={nothing_held}")
    assert made.returncode == 0, made.stderr[-3000:]
    refused = stage("train_student", tmp_path, *short_run(tiny_student, [scored], tmp_path / "refused",
                                                          f"data.export={nothing_held}"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "data.held_out_shards: the export has 0, this run 1" in refused.stderr
    assert not (tmp_path / "refused").exists()


def test_eval_student_measures_exactly_the_shards_the_run_held_out(runs, scored, tmp_path):
    out = tmp_path / "eval"
    done = eval_cli(tmp_path, f"checkpoint={runs[1] / 'final'}", f"bits_per_byte.scored={scored}", f"out_dir={out}")
    assert done.returncode == 0, done.stderr[-2000:]
    b = json.loads((out / "eval.json").read_text())["bits_per_byte"]
    held = identity(runs[1])["shards_held_out"][0]["file"]
    texts = [t for t in shard_texts(scored, held) if t]
    assert b["sources"] == [{"kind": "scored", "folder": str(scored), "shards": [held], "documents": len(texts),
                             "trained_on": "no: the shards the run held out (data.held_out_shards)"}]
    assert b["comparable"] == {"text_sha256": text_digest(texts), "documents": len(texts),
                               "bytes": sum(len(t.encode("utf-8")) for t in texts)}
    assert "trained on: no" in (out / "eval.md").read_text()


def test_shards_the_run_trained_on_are_refused_with_every_other_problem(runs, scored, tmp_path):
    missing = tmp_path / "missing.jsonl"
    bad = eval_cli(tmp_path, f"checkpoint={runs[1] / 'final'}", f"bits_per_byte.scored={scored}",
                   "bits_per_byte.shards=[shard-000000.parquet,shard-000003.parquet,shard-000009.parquet]",
                   f"bits_per_byte.texts=[{missing}]", f"out_dir={tmp_path / 'out'}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert bad.stderr.startswith("error: invalid configuration (3 problems):")
    assert f"bits_per_byte.texts: text file not found: {missing}" in bad.stderr
    assert "bits_per_byte.shards: shard-000009.parquet not in" in bad.stderr
    assert (f"bits_per_byte.shards: the run trained on shard-000000.parquet of {scored} (its data identity lists "
            "them in shards_used); it held out shard-000003.parquet") in bad.stderr
    nothing_held = eval_cli(tmp_path, f"checkpoint={runs[0] / 'final'}", f"bits_per_byte.scored={scored}")
    assert nothing_held.returncode == 2
    assert nothing_held.stderr.startswith(f"error: bits_per_byte.scored: the run trained on every shard of {scored}")
    assert len(nothing_held.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_checkpoint_that_is_no_run_takes_the_named_shards_and_says_it_cannot_know(tiny_student, scored, tmp_path):
    from hydra import compose, initialize_config_dir

    from pipeline.evaluation.run import run_evaluation
    from stages.eval_student import job_config

    def configured(*overrides: str):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return compose(config_name="eval_student", overrides=["tasks=[]", f"checkpoint={tiny_student}",
                                                                  f"bits_per_byte.scored={scored}", *overrides])

    with pytest.raises(ConfigError, match=r"bits_per_byte.shards: name the shards of .* is not a train-student checkpoint"):
        job_config(configured())
    ready = job_config(configured("bits_per_byte.shards=[shard-000001.parquet]", "bits_per_byte.max_documents=3",
                                  f"out_dir={tmp_path / 'out'}", "generation.cpu_threads=1", "progress=false"))
    b = run_evaluation(ready)["bits_per_byte"]
    source = b["sources"][0]
    assert source["shards"] == ["shard-000001.parquet"] and source["documents"] == b["documents"] == 3
    assert source["trained_on"].startswith("unknown: the checkpoint is not a train-student run")
    assert b["comparable"]["text_sha256"] == text_digest([t for t in shard_texts(scored, "shard-000001.parquet") if t][:3])
