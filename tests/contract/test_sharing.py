"""Sharing a scored dataset: the card stage 1 writes (README.md), and the folder read by
``datasets.load_dataset`` and Ray Data through the files the card names. Every reference here is
independent of the card code: the manifest read as JSON, the shards read with pyarrow, the corpus
classified by hand, statistics from numpy, hand-worked values."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml

from hydra import compose, initialize_config_dir
from rich.console import Console

from pipeline.method.loss_histogram import DEFAULT_BIN_WIDTH
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.folders.dataset_card import CARD_NAME, card_text, column_docs, loss_statistics, write_card
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.job import run_score_job
from stages.inspect import run as inspect_run
from storage_schemas import ContractError

INSPECT_CONF = Path(__file__).resolve().parents[2] / "conf" / "inspect"

DECIMALS = 5e-5  # the card prints losses with four decimals


def front_matter(card: str) -> dict:
    assert card.startswith("---\n"), "the card must open with YAML front matter"
    return yaml.safe_load(card.split("---\n", 2)[1])


def card_files(folder: Path) -> list[str]:
    """The data files the card's ``configs`` name, as the hub and ``load_dataset(<folder>)`` read them."""
    (config,) = front_matter((folder / CARD_NAME).read_text())["configs"]
    assert config["config_name"] == "default"
    (split,) = config["data_files"]
    assert split["split"] == "train"
    return split["path"]


def manifest_files(folder: Path) -> list[str]:
    return [e["file"] for e in json.loads((folder / "manifest.json").read_text())["shards"]]


def inspect_config(*overrides: str):
    """``make inspect``'s config composed with ``overrides``."""
    with initialize_config_dir(config_dir=str(INSPECT_CONF), version_base="1.3"):
        return compose("inspect", overrides=["progress=false", *overrides])


def card_value(card: str, label: str) -> str:
    """The value of a two-column row ``| label | value |`` of the card."""
    found = re.findall(rf"^\| {re.escape(label)} \| ([^|]+) \|$", card, re.M)
    assert len(found) == 1, f"expected one row {label!r} in the card, found {found}"
    return found[0].strip()


def card_int(card: str, label: str) -> int:
    return int(card_value(card, label).split()[0].replace(",", ""))


def shard_table(folder: Path, files: list[str]) -> pa.Table:
    return pa.concat_tables([pq.read_table(folder / f, columns=["doc_id", "token_ids", "losses"]) for f in files])


def all_losses(table: pa.Table) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float32) for x in table.column("losses").to_pylist()] or [np.zeros(0)])


# ---------------------------------------------------------------------------------------------
# The card of a complete run


def test_card_front_matter_names_exactly_the_manifest_files(micro_scored):
    meta = front_matter((micro_scored / CARD_NAME).read_text())
    assert card_files(micro_scored) == manifest_files(micro_scored) == [f"shard-{i:06d}.parquet" for i in range(4)]
    assert meta["task_categories"] == ["text-generation"] and "teacher-losses" in meta["tags"]
    assert meta["size_categories"] == ["n<1K"]  # 158 documents
    assert "license" not in meta  # a local corpus: its terms are unknown, left for the publisher


def test_load_dataset_parquet_yields_the_shard_rows(micro_scored, tmp_path):
    from datasets import load_dataset

    files = [str(micro_scored / f) for f in card_files(micro_scored)]
    ds = load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    want = shard_table(micro_scored, manifest_files(micro_scored))
    assert ds.num_rows == want.num_rows
    assert ds["doc_id"] == want.column("doc_id").to_pylist()
    got_losses = ds["losses"]
    assert [len(x) for x in got_losses] == [len(x) for x in want.column("losses").to_pylist()]
    np.testing.assert_array_equal(np.concatenate([np.asarray(x, np.float32) for x in got_losses]), all_losses(want))


def test_load_dataset_folder_reads_only_the_files_the_card_names(micro_scored, tmp_path):
    """The hub's way: ``load_dataset(<folder>)`` follows the card's configs. The copy also holds what
    a glob would wrongly take: an orphaned shard attempt, markers, the lock, inspection outputs."""
    from datasets import load_dataset

    folder = Path(shutil.copytree(micro_scored, tmp_path / "ds"))
    shutil.copy(folder / "shard-000001.parquet", folder / "shard-000001.attempt-2.parquet")
    (folder / "inspect").mkdir(exist_ok=True)
    pq.write_table(pq.read_table(folder / "shard-000002.parquet"), folder / "inspect" / "aligned.parquet")
    ds = load_dataset(str(folder), split="train", cache_dir=str(tmp_path / "hf"))
    want = shard_table(folder, manifest_files(folder))
    assert ds["doc_id"] == want.column("doc_id").to_pylist()
    assert ds.num_rows == json.loads((folder / "manifest.json").read_text())["totals"]["documents"]


def test_ray_data_reads_the_files_the_card_names(micro_scored, ray_local):
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    files = [str(micro_scored / f) for f in card_files(micro_scored)]
    rows = ray.data.read_parquet(files, columns=["doc_id"])
    want = shard_table(micro_scored, manifest_files(micro_scored)).column("doc_id").to_pylist()
    assert rows.count() == len(want)
    assert sorted(r["doc_id"] for r in rows.take_all()) == sorted(want)


def test_card_counts_equal_an_independent_count(micro_scored, micro_corpus):
    card = (micro_scored / CARD_NAME).read_text()
    table = shard_table(micro_scored, manifest_files(micro_scored))
    assert card_int(card, "documents") == table.num_rows == 158
    assert card_int(card, "teacher tokens") == sum(len(x) for x in table.column("token_ids").to_pylist())
    assert card_value(card, "shards") == "4 of 4 planned"
    assert "Partial dataset" not in card
    # Reasons: the corpus classified by hand (null, empty, whitespace-only texts).
    texts = [t for f in micro_corpus for t in pq.read_table(f, columns=["text"]).column("text").to_pylist()]
    by_hand = {"null_text": sum(t is None for t in texts), "empty_text": sum(t == "" for t in texts),
               "whitespace_only": sum(t is not None and t != "" and not t.strip() for t in texts)}
    assert all(by_hand.values())  # the fixture has each kind
    for reason, n in by_hand.items():
        row = re.search(rf"^\| `{reason}` \| ([\d,]+) \| ([^|]+) \|$", card, re.M)
        assert row and int(row.group(1)) == n, reason
    assert "not stored" in re.search(r"^\| `null_text` .*$", card, re.M).group(0)
    assert 160 - by_hand["null_text"] == table.num_rows  # skipped documents are the only ones not stored


def test_card_statistics_equal_numpy_over_all_losses(micro_scored):
    losses = all_losses(shard_table(micro_scored, manifest_files(micro_scored))).astype(np.float64)
    finite = losses[np.isfinite(losses)]
    want = {"mean": finite.mean(), "p10": np.quantile(finite, 0.1), "median": np.median(finite),
            "p90": np.quantile(finite, 0.9), "min": finite.min(), "max": finite.max()}
    card = (micro_scored / CARD_NAME).read_text()
    for name, value in want.items():
        tolerance = DECIMALS + (DEFAULT_BIN_WIDTH if name in ("p10", "median", "p90") else 0)
        assert abs(float(card_value(card, name)) - value) <= tolerance, name
    assert f"over all 4 shards ({losses.size:,} tokens)" in card
    assert f"(loss NaN): {int(np.isnan(losses).sum()):,} " in card
    stats = loss_statistics(str(micro_scored), json.loads((micro_scored / "manifest.json").read_text())["shards"])
    assert stats.mean == pytest.approx(want["mean"], rel=1e-12)
    assert (stats.minimum, stats.maximum) == (want["min"], want["max"])
    assert (stats.tokens_read, stats.nan, stats.inf) == (losses.size, int(np.isnan(losses).sum()), 0)


def test_card_schema_lists_every_column_with_its_type_and_meaning(micro_scored):
    expected_types = {"doc_id": "string", "text": "string", "token_ids": "list<int32>", "starts": "list<int32>",
                      "ends": "list<int32>", "losses": "list<float32>"}
    docs = column_docs()
    assert {name: kind for name, kind, _ in docs} == expected_types
    assert all(meaning for _, _, meaning in docs)
    card = (micro_scored / CARD_NAME).read_text()
    for name, kind in expected_types.items():
        assert re.search(rf"^\| `{name}` \| `{re.escape(kind)}` \| \S.+ \|$", card, re.M), name
    assert "-log p_teacher(token \\| left context)" in card  # the pipe escaped inside a table cell


# ---------------------------------------------------------------------------------------------
# Statistics by hand


def write_losses(path: Path, docs: list[list[float]]) -> dict:
    pq.write_table(pa.table({"losses": pa.array(docs, pa.list_(pa.float32()))}), path)
    return {"file": path.name, "tokens": sum(map(len, docs))}


def test_statistics_hand_worked(tmp_path):
    """0.000, 0.001, ..., 9.999 over two files, with NaN and an infinity beside them: mean 4.9995,
    p10 at rank 999.9 = 0.9999, median 4.9995, p90 8.9991 (rank 8999.1); NaN and inf left out."""
    values = [k / 1000 for k in range(10_000)]
    entries = [write_losses(tmp_path / "a.parquet", [values[:3000], [float("nan")] + values[3000:5000]]),
               write_losses(tmp_path / "b.parquet", [values[5000:], [float("inf"), float("nan")]])]
    stats = loss_statistics(str(tmp_path), entries)
    assert (stats.finite, stats.nan, stats.inf, stats.tokens_read) == (10_000, 2, 1, 10_003)
    assert stats.mean == pytest.approx(4.9995, abs=1e-6)  # float32 storage of k/1000
    assert (stats.minimum, stats.maximum) == (0.0, pytest.approx(9.999, abs=1e-6))
    for name, by_hand in (("p10", 0.9999), ("median", 4.9995), ("p90", 8.9991)):
        assert abs(stats.quantiles[name] - by_hand) <= DEFAULT_BIN_WIDTH, name
    assert not stats.sampled


def test_statistics_of_a_large_dataset_read_evenly_spaced_shards(tmp_path):
    """Shards of 100, 100, 100 and 250 tokens, a budget of 150: ceil(4 * 150 / 550) = 2 shards, evenly
    spaced = the first (100 losses of 1.0) and the last (100 of 1.0, 150 of 4.0). Over those 350:
    mean 800 / 350, median 1.0 (rank 174.5 of 200 ones), p90 4.0 (rank 314.1)."""
    docs = [[[1.0] * 60, [1.0] * 40], [[2.0] * 100], [[3.0] * 100], [[1.0] * 100, [4.0] * 150]]
    entries = [write_losses(tmp_path / f"s{i}.parquet", d) for i, d in enumerate(docs)]
    stats = loss_statistics(str(tmp_path), entries, token_budget=150)
    assert stats.sampled and stats.shards_read == ["s0.parquet", "s3.parquet"]
    assert (stats.tokens_read, stats.minimum, stats.maximum) == (350, 1.0, 4.0)
    assert stats.mean == pytest.approx(800 / 350, rel=1e-12)
    assert abs(stats.quantiles["median"] - 1.0) <= DEFAULT_BIN_WIDTH and abs(stats.quantiles["p90"] - 4.0) <= DEFAULT_BIN_WIDTH
    card = card_text({"shards": entries}, stats)
    assert "over a sample of 2 of the 4 shards, evenly spaced in corpus order (350 tokens): `s0.parquet`, `s3.parquet`" in card
    assert loss_statistics(str(tmp_path), entries, token_budget=550).shards_read == [e["file"] for e in entries]


# ---------------------------------------------------------------------------------------------
# Partial runs, a card that cannot be written, object storage


def test_partial_run_card_then_a_failed_card_never_fails_the_job(micro_teacher, micro_corpus, ray_local, tmp_path,
                                                                 caplog):
    out = tmp_path / "ds"

    def job(**kw) -> ScoreJobConfig:
        return ScoreJobConfig(
            teacher=TeacherConfig(name="micro", model=str(micro_teacher)),
            corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in micro_corpus], rows_per_shard=40),
            scorer=ScorerConfig(max_batch_tokens=2048), output_dir=str(out),
            pool=PoolConfig(num_actors=1, num_cpus=1), progress=False, **kw)

    # 1. A partial run (2 of 4 shards): the card says so and names only the scored shards.
    assert not run_score_job(job(limit_shards=2)).complete
    card = (out / CARD_NAME).read_text()
    assert "Partial dataset" in card and card_value(card, "shards") == "2 of 4 planned"
    assert card_files(out) == manifest_files(out) == ["shard-000000.parquet", "shard-000001.parquet"]
    assert card_int(card, "documents") == shard_table(out, manifest_files(out)).num_rows

    # 2. A shard the card cannot read (its footer damaged, its size kept, so the job counts it as
    # done): the run completes, warns naming the folder, and removes the old card, whose file
    # list no longer describes the dataset.
    shard = out / "shard-000000.parquet"
    good = shard.read_bytes()
    shard.write_bytes(good[:-4] + b"XXXX")
    with caplog.at_level(logging.WARNING, logger="pipeline.folders.dataset_card"):
        summary = run_score_job(job())
    assert summary.complete and summary.shards_scored == 2
    warned = [r.getMessage() for r in caplog.records if r.name == "pipeline.folders.dataset_card"]
    assert any(str(out) in m and "could not write the dataset card" in m and f"{shard}: cannot read its losses" in m
               for m in warned), warned
    assert not (out / CARD_NAME).exists()

    # 3. Repaired, `make inspect command=card` writes the card again: complete, all four shards.
    shard.write_bytes(good)
    console = Console(record=True, width=200)
    assert inspect_run(inspect_config("command=card", f"path={out}"), console) == 0
    assert f"wrote {out / CARD_NAME}" in console.export_text()
    card = (out / CARD_NAME).read_text()
    assert "Partial dataset" not in card and card_value(card, "shards") == "4 of 4 planned"
    assert card_files(out) == manifest_files(out) and len(card_files(out)) == 4


def test_card_command_refuses_a_folder_that_is_not_a_dataset(tmp_path):
    with pytest.raises(ContractError, match=f"{tmp_path}: no manifest.json; not a scored dataset"):
        inspect_run(inspect_config("command=card", f"path={tmp_path}"), Console(quiet=True))
    assert not (tmp_path / CARD_NAME).exists()


def test_card_on_object_storage_equals_the_local_card(micro_scored, s3_server):
    """Stage 1 writing to S3 is tested where it is built; here a scored folder copied to a real S3
    server (moto) gets its card written there, which must equal the local one byte for byte (the
    card holds no location), with no temporary object left behind."""
    bucket = s3_server()
    remote = f"{bucket}/owm/micro/v1"
    names = ["manifest.json", *manifest_files(micro_scored)]
    fs, base = pafs.FileSystem.from_uri(remote)
    for name in names:
        with fs.open_output_stream(f"{base}/{name}") as f:
            f.write((micro_scored / name).read_bytes())
    assert write_card(remote) == f"{remote}/{CARD_NAME}"
    with fs.open_input_stream(f"{base}/{CARD_NAME}") as f:
        assert f.read().decode() == (micro_scored / CARD_NAME).read_text()
    listed = fs.get_file_info(pafs.FileSelector(base))
    assert sorted(Path(i.path).name for i in listed) == sorted([*names, CARD_NAME])
