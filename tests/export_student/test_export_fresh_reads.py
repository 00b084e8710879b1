"""``datasets.load_dataset(<folder>)``, the documented way to read an export and a scored dataset,
gives the rows the folder holds now, also after the folder was rewritten in place. ``datasets``
keys its cache of a folder by the folder's name and what the card says, so each test points the
cache at a fresh folder of its own (as a user's would be, holding the earlier rows) and loads the
same folder twice, around a rewrite. The reference is the Parquet shards read with pyarrow."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from export_helpers import make_export, manifest
from pipeline.export_student.job import run_export


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face datasets cache, as load_dataset finds it (environment and module)."""
    import datasets

    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def on_disk(folder: Path, column: str) -> list[list[float]]:
    """``column`` of every row of the shards the manifest lists, read with pyarrow."""
    return [row for e in manifest(folder)["shards"]
            for row in pq.read_table(folder / e["file"]).column(column).to_pylist()]


def loaded(folder: Path, column: str) -> list[list[float]]:
    from datasets import load_dataset

    return load_dataset(str(folder), split="train")[column]


def same(a: list[list[float]], b: list[list[float]]) -> bool:
    flat = [np.asarray(x, np.float32) for x in (sum(a, []), sum(b, []))]
    return [len(x) for x in a] == [len(x) for x in b] and np.array_equal(*flat, equal_nan=True)


def test_an_export_rewritten_in_place_loads_its_new_rows(tiny_student, micro_scored, fresh_cache, tmp_path):
    out = tmp_path / "export"
    job = make_export(tiny_student, micro_scored, out, rows_per_shard=64)
    run_export(job)
    first = loaded(out, "teacher_loss")
    assert same(first, on_disk(out, "teacher_loss"))
    run_export(replace(job, alignment=replace(job.alignment, aggregate="min"), overwrite=True))
    second = on_disk(out, "teacher_loss")
    assert not same(first, second), "the rewrite changed the losses"
    assert same(loaded(out, "teacher_loss"), second), "load_dataset gave the rows of the earlier export"
    assert any(fresh_cache.iterdir()), "the test's own cache was used"


def test_a_rescored_folder_loads_its_new_rows(micro_teacher, micro_corpus, ray_local, fresh_cache, tmp_path):
    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.corpus import CorpusConfig
    from pipeline.score_teacher.pool import PoolConfig
    from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
    from pipeline.score_teacher.job import run_score_job
    from pipeline.score_teacher.writer import StorageConfig

    out = tmp_path / "scored"
    cfg = ScoreJobConfig(teacher=TeacherConfig(name="micro", model=str(micro_teacher)),
                         corpus=CorpusConfig(name="c", files=[str(micro_corpus[0])], rows_per_shard=20, limit_docs=40),
                         scorer=ScorerConfig(max_batch_tokens=2048), output_dir=str(out),
                         pool=PoolConfig(num_actors=1, num_cpus=1), progress=False)
    run_score_job(cfg)
    first = loaded(out, "losses")
    assert same(first, on_disk(out, "losses"))
    run_score_job(replace(cfg, storage=StorageConfig(loss_precision="float32"), overwrite=True))
    second = on_disk(out, "losses")
    assert not same(first, second), "the rescore stored other losses (float32, not rounded to bfloat16)"
    assert same(loaded(out, "losses"), second), "load_dataset gave the rows of the earlier scoring"
