"""Dataset and run identity by content, not location: reruns in a fresh or moved project folder
resume, a changed teacher, corpus or student is still refused, and manifests written before the
content identity are adopted with one command."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.writer import DatasetMismatchError
from storage_schemas import META_IDENTITY, file_sha256, read_manifest, read_shard_metadata

REPO = Path(__file__).resolve().parents[2]

# The embedded default, made small: 40 documents in 4 shards, a tiny teacher trained for 2 steps.
SMALL_STAGE1 = ["data.build.n_docs=40", "data.rows_per_shard=10", "teacher.build.corpus_docs=40",
                "teacher.build.steps=2", "teacher.build.vocab_size=400", "ray.num_cpus=1", "teacher.num_cpus=1",
                "progress=false"]
DATASET = Path("outputs/scored/owm-sample/tiny/v1")  # the default output folder, relative to the project


def score_teacher(project: Path, run: str, *overrides: str, cache: Path) -> subprocess.CompletedProcess:
    """``make score-teacher`` as a user runs it: from the project folder, default relative paths."""
    env = {**os.environ, "VOCAGNO_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "stages.score_teacher", *SMALL_STAGE1, *overrides,
                           f"hydra.run.dir=logs/{run}"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600)


def summary_of(project: Path, run: str) -> dict:
    return json.loads((project / "logs" / run / "summary.json").read_text())


def shard_state(folder: Path) -> dict[str, tuple[int, str]]:
    return {p.name: (p.stat().st_mtime_ns, file_sha256(p)) for p in sorted(folder.glob("shard-*.parquet"))}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A fresh project folder after its first ``make score-teacher``."""
    root = tmp_path_factory.mktemp("clone")
    res = score_teacher(root, "first", cache=root.parent / "digest-cache")
    assert res.returncode == 0, res.stderr[-3000:]
    first = summary_of(root, "first")
    assert first["shards_scored"] == first["shards_planned"] == 4 and first["complete"]
    return root


def test_second_run_in_a_fresh_folder_skips_every_shard(project, tmp_path):
    before = shard_state(project / DATASET)
    res = score_teacher(project, "second", cache=tmp_path / "cache")
    assert res.returncode == 0, res.stderr[-3000:]
    second = summary_of(project, "second")
    assert second["shards_scored"] == 0 and second["shards_done_before"] == 4 and second["complete"]
    assert shard_state(project / DATASET) == before, "no shard was rewritten"


def test_moved_project_reruns_without_rescoring(project, tmp_path):
    old = tmp_path / "old-place"
    shutil.copytree(project, old, symlinks=True)
    identity = read_manifest(old / DATASET)["identity"]
    new = tmp_path / "elsewhere" / "new-place"
    new.parent.mkdir()
    shutil.move(old, new)  # the scored folder, the corpus and the teacher move together
    before = shard_state(new / DATASET)
    res = score_teacher(new, "moved", cache=tmp_path / "cache")
    assert res.returncode == 0, res.stderr[-3000:]
    moved = summary_of(new, "moved")
    assert moved["shards_scored"] == 0 and moved["shards_done_before"] == 4
    manifest = read_manifest(new / DATASET)
    assert manifest["identity"] == identity and shard_state(new / DATASET) == before
    texts = [json.dumps(identity)] + [json.dumps(read_shard_metadata(p)[META_IDENTITY])
                                      for p in (new / DATASET).glob("shard-*.parquet")]
    assert len(texts) == 5 and not any(str(project) in t or "artifacts" in t for t in texts), "no path in the identity"
    assert manifest["location"]["teacher_model"] == str(new / "artifacts" / "tiny-teacher-n40-s0")


def test_changed_teacher_is_still_refused(project, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(project, copy, symlinks=True)
    before = shard_state(copy / DATASET)
    flip_last_byte(copy / "artifacts" / "tiny-teacher-n40-s0" / "model.safetensors")  # same place, size, header
    res = score_teacher(copy, "changed", cache=tmp_path / "cache")
    assert res.returncode == 2
    assert "was scored with a different setup" in res.stderr and "teacher.weights_sha256" in res.stderr
    assert "teacher.config_sha256" not in res.stderr and "teacher.tokenizer_sha256" not in res.stderr
    assert shard_state(copy / DATASET) == before


# ---- library level: the same rules, cheaper cases -------------------------------------------


def test_digest_cache_is_keyed_on_the_files_state(tmp_path, monkeypatch):
    from pipeline.folders import provenance as identity

    monkeypatch.setenv("VOCAGNO_CACHE", str(tmp_path / "cache"))
    entries = tmp_path / "cache" / "file-sha256"
    f = tmp_path / "weights.bin"
    f.write_bytes(b"a" * 4096)
    assert identity.file_sha256_cached(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert not entries.exists(), "a file changed in the last two seconds is not cached"
    monkeypatch.setattr(identity, "RACY_SECONDS", 0.05)
    time.sleep(0.1)
    assert identity.file_sha256_cached(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert len(list(entries.iterdir())) == 1
    monkeypatch.setattr(identity, "file_sha256", lambda p: pytest.fail("a cached file was read again"))
    assert identity.file_sha256_cached(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    monkeypatch.setattr(identity, "file_sha256", file_sha256)
    st = f.stat()
    f.write_bytes(b"b" * 4096)  # same size; the modification time is then set back
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert identity.file_sha256_cached(f) == hashlib.sha256(b"b" * 4096).hexdigest(), "the change time tells"


def flip_last_byte(path: Path) -> None:
    """Change the file's content, not its size (the last byte is tensor data in a safetensors file)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def micro_job(teacher: Path, corpus: list[Path], out: Path, **kw) -> ScoreJobConfig:
    """The setup ``micro_scored`` (conftest) was scored with."""
    return ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(teacher), stride=kw.pop("stride", None)),
        corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in corpus], rows_per_shard=40),
        scorer=ScorerConfig(max_batch_tokens=2048), output_dir=str(out),
        pool=PoolConfig(num_actors=1, num_cpus=1), progress=False, **kw)


@pytest.fixture
def moved_micro(micro_scored, micro_teacher, micro_corpus, tmp_path):
    """``micro_scored`` with its teacher and corpus copied to another place."""
    teacher = shutil.copytree(micro_teacher, tmp_path / "teacher")
    corpus = [Path(shutil.copy2(f, tmp_path / f.name)) for f in micro_corpus]
    out = shutil.copytree(micro_scored, tmp_path / "scored")
    return teacher, corpus, out


def test_same_size_changes_to_weights_or_corpus_are_refused(moved_micro, ray_local):
    teacher, corpus, out = moved_micro
    assert run_score_job(micro_job(teacher, corpus, out)).shards_scored == 0, "the copied setup is the same"
    flip_last_byte(teacher / "model.safetensors")
    with pytest.raises(DatasetMismatchError, match=r"teacher\.weights_sha256"):
        run_score_job(micro_job(teacher, corpus, out))
    flip_last_byte(teacher / "model.safetensors")  # back to the scored weights
    size = corpus[0].stat().st_size
    data = corpus[0].read_bytes()
    at = len(data) // 2  # inside the data pages: the bytes change, the size and the footer do not
    corpus[0].write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
    assert corpus[0].stat().st_size == size
    with pytest.raises(DatasetMismatchError, match=r"corpus\.files_sha256"):
        run_score_job(micro_job(teacher, corpus, out))


def test_a_folder_of_another_identity_format_is_refused_and_kept(moved_micro, ray_local):
    """A manifest whose identity has no or another ``format`` is another setup: refused with the
    difference named, nothing rescored or deleted."""
    teacher, corpus, out = moved_micro
    manifest = read_manifest(out)
    del manifest["identity"]["format"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = shard_state(out)
    with pytest.raises(DatasetMismatchError, match=r"format: None != 2"):
        run_score_job(micro_job(teacher, corpus, out))
    assert shard_state(out) == before, "nothing rescored, nothing deleted"


# ---- stage 2 ---------------------------------------------------------------------------------


def test_training_resumes_after_the_project_folder_moves(micro_scored, micro_teacher, micro_corpus, ray_local, tmp_path):
    from pipeline.embedded.sample_corpus import clean_texts
    from pipeline.embedded.tiny_student import TinyStudentSpec, build_tiny_student
    from pipeline.train_student.checkpoints import RunMismatchError
    from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig
    from pipeline.train_student.run import run_training

    def job(place: Path, steps: int = 2) -> TrainJobConfig:
        train = TrainConfig(micro_batch_size=4, gradient_accumulation_steps=1, max_steps=steps, warmup_steps=1,
                            logging_steps=1, save_steps=2, report_to=[], progress=False, use_cpu=True, cpu_threads=1)
        return TrainJobConfig(student=StudentConfig(name="t", model=str(place / "student"), seq_len=32),
                              data=DataConfig(folders=[str(place / "scored")], num_workers=0), train=train,
                              output_dir=str(place / "run"))

    old = tmp_path / "old-place"
    shutil.copytree(micro_scored, old / "scored")
    shutil.copytree(micro_teacher, old / "teacher")
    shutil.copytree(micro_corpus[0].parent, old / "corpus")
    spec = TinyStudentSpec(vocab_size=640, limit_alphabet=100, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=2, num_kv_heads=1, context=64, seed=3)
    build_tiny_student(clean_texts(micro_corpus), old / "student", spec)
    assert run_training(job(old)).steps == 2
    new = tmp_path / "new-place"
    shutil.move(old, new)
    manifest_before = file_sha256(new / "scored" / "manifest.json")
    corpus = [new / "corpus" / f.name for f in micro_corpus]
    rescored = run_score_job(micro_job(new / "teacher", corpus, new / "scored"))
    assert rescored.shards_scored == 0
    assert file_sha256(new / "scored" / "manifest.json") != manifest_before, "the manifest records the new location"
    resumed = run_training(job(new))
    assert resumed.resumed_from == str(new / "run" / "checkpoint-2") and resumed.steps == 2
    flip_last_byte(new / "student" / "model.safetensors")  # another student, at the same place
    with pytest.raises(RunMismatchError, match=r"student weights_sha256"):
        run_training(job(new))


def test_describe_teacher_names_hub_and_local_teachers():
    from storage_schemas import describe_teacher

    hub = {"name": "qwen", "source": "hub", "model": "Qwen/Qwen2.5-Math-7B-Instruct", "revision": None,
           "dtype": "bfloat16", "bos_id": None}
    assert describe_teacher(hub) == "qwen (Qwen/Qwen2.5-Math-7B-Instruct @ main; bfloat16, no BOS)"
    local = {"name": "tiny", "source": "local", "model": None, "weights_sha256": "0123456789abcdef" * 4,
             "dtype": "float32", "bos_id": 1}
    assert describe_teacher(local) == "tiny (local model, weights sha256 0123456789ab; float32, BOS id 1)"
