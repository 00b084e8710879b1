"""``inspect summary`` on a dataset written by the real stage 1 (the micro_scored fixture), checked
against an eager numpy computation; the lazy reading helpers; the README's Polars one-liners."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from storage_schemas.reader import DocumentNotFoundError, ScoredDataset
from pipeline.inspection.summary import summarize
from pipeline.method.loss_histogram import LossHistogram
from storage_schemas import SKIP_REASONS
from storage_schemas import read_manifest


@pytest.fixture(scope="module")
def eager(micro_scored) -> list[dict]:
    """Every row of the dataset, read eagerly the plain way (small data only)."""
    rows = []
    for entry in read_manifest(micro_scored)["shards"]:
        for row in pq.read_table(micro_scored / entry["file"]).to_pylist():
            rows.append({**row, "file": entry["file"]})
    return rows


def test_summary_matches_an_eager_count(micro_scored, eager):
    s = summarize(ScoredDataset.open(micro_scored), top_k=5, min_tokens=16)
    manifest = read_manifest(micro_scored)
    losses = np.concatenate([np.asarray(r["losses"], np.float64) for r in eager])
    finite = losses[np.isfinite(losses)]
    assert s.documents == len(eager) == manifest["totals"]["documents"]
    assert s.tokens == losses.size == manifest["totals"]["tokens"]
    assert s.empty_documents == sum(not r["token_ids"] for r in eager)
    assert s.losses_nan == int(np.isnan(losses).sum()) and s.losses_inf == 0
    assert s.nan_share == pytest.approx(np.isnan(losses).mean())
    assert s.loss_mean == pytest.approx(finite.mean(), rel=1e-9)
    assert (s.loss_min, s.loss_max) == (pytest.approx(finite.min()), pytest.approx(finite.max()))
    for q, value in s.quantiles.items():
        assert abs(value - np.quantile(finite, q)) <= s.histogram.bin_width, q
    assert s.bytes_on_disk == manifest["totals"]["bytes"]
    assert s.bytes_per_token == pytest.approx(manifest["totals"]["bytes"] / losses.size)
    assert s.skipped == {k: v for k, v in manifest["totals"]["reasons"].items() if k in SKIP_REASONS} != {}
    assert s.zero_token == {k: v for k, v in manifest["totals"]["reasons"].items() if k in ("empty_text", "whitespace_only")}
    assert s.per_shard["file"].to_list() == [e["file"] for e in manifest["shards"]]
    assert s.per_shard["documents"].to_list() == [e["rows"] for e in manifest["shards"]]
    assert s.per_shard["tokens"].to_list() == [e["tokens"] for e in manifest["shards"]]


def test_extreme_documents_are_the_highest_and_lowest_mean_losses(micro_scored, eager):
    s = summarize(ScoredDataset.open(micro_scored), top_k=3, min_tokens=16)
    means = {}
    for r in eager:
        x = np.asarray(r["losses"], np.float64)
        if x.size >= 16 and np.isfinite(x).any():
            means[r["doc_id"]] = np.nanmean(x)
    ranked = sorted(means, key=means.get)
    assert s.highest["doc_id"].to_list() == ranked[::-1][:3]
    assert s.lowest["doc_id"].to_list() == ranked[:3]
    assert s.highest["mean_loss"].to_list() == pytest.approx([means[d] for d in ranked[::-1][:3]])


def test_histogram_quantiles_are_within_one_bin():
    rng = np.random.default_rng(0)
    values = rng.gamma(2.0, 1.5, 20_000)
    width = 1 / 64
    bins, counts = np.unique(np.floor(values / width).astype(np.int64), return_counts=True)
    hist = LossHistogram(width, bins, counts, float(values.min()), float(values.max()))
    for q in (0.0, 0.001, 0.1, 0.5, 0.9, 0.999, 1.0):
        assert abs(hist.quantile(q) - np.quantile(values, q)) <= width
    assert hist.dense_counts().sum() == values.size and hist.edges().size == hist.dense_counts().size + 1


def test_empty_and_missing_documents(micro_scored, eager):
    ds = ScoredDataset.open(micro_scored)
    first = ds.find_document(None, min_tokens=1)
    assert first.doc_id == next(r["doc_id"] for r in eager if r["token_ids"])
    chosen = eager[57]
    record = ds.find_document(chosen["doc_id"])
    assert (record.file, record.text) == (chosen["file"], chosen["text"])
    assert record.row == [r["doc_id"] for r in eager if r["file"] == chosen["file"]].index(chosen["doc_id"])
    np.testing.assert_array_equal(record.losses, np.asarray(chosen["losses"], np.float32))
    with pytest.raises(DocumentNotFoundError, match="no document 'nope'"):
        ds.find_document("nope")


def test_iter_documents_streams_every_row_in_order(micro_scored, eager):
    ds = ScoredDataset.open(micro_scored)
    got = list(ds.iter_documents(batch_rows=7))
    assert [d.doc_id for d in got] == [r["doc_id"] for r in eager]
    for d, r in zip(got[::13], eager[::13]):
        np.testing.assert_array_equal(d.starts, r["starts"])
        np.testing.assert_array_equal(d.losses, np.asarray(r["losses"], np.float32))
    assert len(list(ds.iter_documents(limit=5))) == 5


def readme_polars_commands() -> list[str]:
    """The ``.venv/bin/python -c "..."`` lines of docs/storage-schema.md's "With Polars directly"
    block, as written."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "storage-schema.md").read_text()
    section = page.split("With Polars directly", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.startswith(".venv/bin/python -c ")]
    assert block.splitlines()[0].startswith("D=") and len(commands) == 3, block
    return commands


@pytest.mark.parametrize("index", range(3))
def test_readme_polars_one_liners_run(micro_scored, index):
    """Each one-liner, read from the docs, run as a user would (``$D`` the dataset folder) on
    real stage-1 output; its printed table checked against the manifest."""
    command = readme_polars_commands()[index].replace("$D", str(micro_scored))
    argv = shlex.split(command)
    assert argv[:2] == [".venv/bin/python", "-c"] and len(argv) == 3
    env = {**os.environ, "POLARS_TABLE_WIDTH": "250", "POLARS_FMT_MAX_ROWS": "-1"}  # every row, one line each
    run = subprocess.run([sys.executable, "-c", argv[2]], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    manifest = read_manifest(micro_scored)
    shape = run.stdout.split("shape: ", 1)[1].split("\n", 1)[0]
    if "explode(" in command:  # one row per teacher token, the first five with a loss
        assert shape == "(5, 5)"
    elif "list.mean()" in command:  # one row per document: id, token count, mean loss
        assert shape == f"({manifest['totals']['documents']}, 3)"
    else:  # one row per listed shard: its name and its token count twice (counted, and from the manifest)
        assert shape.startswith(f"({len(manifest['shards'])}, ")
        for entry in manifest["shards"]:
            line = next(ln for ln in run.stdout.splitlines() if entry["file"] in ln)
            assert line.count(str(entry["tokens"])) == 2, line
