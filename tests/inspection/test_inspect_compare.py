"""``make inspect ARGS="command=compare path=A other=B"``: two scored folders of one corpus compared
against hand-worked values and closed forms: equal folders, perturbed losses, flipped selections,
other token ids, and tokens scored with another left context (two window plans) counted apart."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.inspection.parity import compare_folders, context_starts, flat_student_selection
from pipeline.score_teacher.teacher import ShardResult
from pipeline.score_teacher.writer import StorageConfig, write_manifest, write_shard
from storage_schemas.reader import ScoredDataset, ScoredDocument

REPO = Path(__file__).resolve().parents[2]


def folder(path: Path, docs: list[ScoredDocument], window: int = 8, stride: int = 4, bos: bool = True) -> Path:
    identity = {"teacher": {"name": "t", "bos_id": 1 if bos else None}, "corpus": {"name": "c"},
                "windows": {"window": window, "stride": stride, "min_left_context": window - stride}}
    path.mkdir(parents=True)
    exact = StorageConfig(loss_precision="float32")  # the losses as given: differences are the test's own
    done = {0: write_shard(path, 0, ShardResult(documents=docs[:2]), identity, {"index": 0}, "t", storage=exact),
            1: write_shard(path, 1, ShardResult(documents=docs[2:]), identity, {"index": 1}, "t", storage=exact)}
    write_manifest(path, identity, done, 2, "t")
    return path


def documents(seed: int = 0, n_docs: int = 4, length: int = 30) -> list[ScoredDocument]:
    rng = np.random.default_rng(seed)
    out = []
    for d in range(n_docs):
        ids = rng.integers(0, 100, length).astype(np.int32)
        starts = np.arange(length, dtype=np.int32)
        losses = rng.gamma(2.0, 1.0, length).astype(np.float32)
        losses[0] = np.nan
        out.append(ScoredDocument(f"d{d}", "x" * length, ids, starts, starts + 1, losses))
    return out


def test_flat_student_selection_by_hand():
    losses = np.array([3.0, 1.0, np.nan, 2.0, 5.0], dtype=np.float32)
    # 4 finite tokens, k = ceil(0.4 * 4) = 2: the two lowest, 1.0 (token 1) and 2.0 (token 3)
    assert flat_student_selection(losses, 0.4).tolist() == [False, True, False, True, False]
    assert flat_student_selection(np.full(3, np.nan, np.float32), 0.4).tolist() == [False] * 3


@pytest.mark.parametrize("window,stride,bos", [(8, 4, True), (8, 3, False), (5, 1, True), (64, 32, True)])
def test_context_starts_equal_the_closed_form(window, stride, bos):
    """Model-input position p is scored by the first window whose end passes it:
    k = max(0, floor((p - window) / stride) + 1), whose context starts at k * stride."""
    n_tokens = 57
    got = context_starts(n_tokens, {"window": window, "stride": stride, "bos": bos})
    offset = 1 if bos else 0
    want = [max(0, (p - window) // stride + 1) * stride for p in range(offset, n_tokens + offset)]
    if not bos:
        want[0] = 0  # the first token of a document without BOS is scored by nothing: window 0
    assert got.tolist() == want


def test_equal_folders_and_perturbed_losses(tmp_path):
    docs = documents()
    a = folder(tmp_path / "a", docs)
    same = compare_folders(ScoredDataset.open(a), ScoredDataset.open(folder(tmp_path / "b", docs)))
    assert same.n_mismatched == 0 and same.documents == 4
    assert same.same_context.max_abs == 0.0 and same.same_context.flips == 0
    assert same.same_context.tokens == 4 * 30 and same.context_differs.tokens == 0

    changed = [ScoredDocument(d.doc_id, d.text, d.ids, d.starts, d.ends, d.losses.copy()) for d in docs]
    changed[2].losses[5] += np.float32(0.75)  # one token's loss moves by 0.75 nats
    changed[3].losses[7] = np.nan  # one token has no loss in the second folder
    p = compare_folders(ScoredDataset.open(a), ScoredDataset.open(folder(tmp_path / "c", changed)))
    assert p.n_mismatched == 0
    assert p.same_context.max_abs == pytest.approx(0.75, abs=1e-6)
    assert p.same_context.nan_mismatch == 1
    assert p.same_context.compared == 4 * 29 - 1  # the first token of each document is NaN in both
    flips = 0  # brute force: sorted lists of (loss, position) per document
    for x, y in zip(docs, changed):
        def chosen(losses):
            finite = sorted((float(v), i) for i, v in enumerate(losses) if not math.isnan(v))
            return {i for _, i in finite[: max(1, math.ceil(0.4 * len(finite) - 1e-6))]}
        flips += len(chosen(x.losses) ^ chosen(y.losses))
    assert p.same_context.flips == flips


def test_other_token_ids_are_named_and_the_cli_exits_1(tmp_path):
    docs = documents()
    other = [ScoredDocument(d.doc_id, d.text, d.ids.copy(), d.starts, d.ends, d.losses) for d in docs]
    other[1].ids[9] += 1
    a, b = folder(tmp_path / "a", docs), folder(tmp_path / "b", other)
    run = subprocess.run([sys.executable, "-m", "stages.inspect", "command=compare", f"path={a}", f"other={b}",
                          f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'logs'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "d1: token ids differ (first at token 9)" in run.stdout
    (path,) = (tmp_path / "out" / "compare").iterdir()
    saved = json.loads(path.read_text())
    assert saved["mismatched_documents"] == 1 and saved["documents"] == 3 and saved["b"] == str(b)


def test_tolerances_decide_the_exit_status(tmp_path):
    docs = documents()
    changed = [ScoredDocument(d.doc_id, d.text, d.ids, d.starts, d.ends, d.losses + np.float32(0.01)) for d in docs]
    a, b = folder(tmp_path / "a", docs), folder(tmp_path / "b", changed)
    args = [sys.executable, "-m", "stages.inspect", "command=compare", f"path={a}", f"other={b}",
            f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'logs'}"]
    loose = subprocess.run([*args, "compare.max_abs=0.02"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert loose.returncode == 0 and "within tolerance" in loose.stdout, loose.stdout + loose.stderr
    tight = subprocess.run([*args, "compare.max_abs=0.005"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert tight.returncode == 1 and "compare.max_abs=0.005" in tight.stdout


def test_tokens_scored_with_another_context_are_counted_apart(tmp_path):
    """The same losses under two window plans: the tokens whose window start differs (closed form)
    are the context-differs group; all others are the same-context group."""
    docs = documents(length=40)
    a = folder(tmp_path / "a", docs, window=8, stride=4)
    b = folder(tmp_path / "b", docs, window=8, stride=6)
    p = compare_folders(ScoredDataset.open(a), ScoredDataset.open(b))

    def start(pos, window, stride):
        return max(0, (pos - window) // stride + 1) * stride

    differ = sum(start(p_ + 1, 8, 4) != start(p_ + 1, 8, 6) for p_ in range(40)) * len(docs)
    assert p.context_differs.tokens == differ > 0
    assert p.same_context.tokens == 4 * 40 - differ


def scored_shards(path: Path, docs: list[ScoredDocument], held: list[int], per_shard: int = 2) -> Path:
    """A folder of ``docs`` in shards of ``per_shard`` documents, holding only the shards ``held``."""
    identity = {"teacher": {"name": "t", "bos_id": 1}, "corpus": {"name": "c", "rows_per_shard": per_shard},
                "windows": {"window": 8, "stride": 4, "min_left_context": 4}}
    path.mkdir(parents=True)
    exact = StorageConfig(loss_precision="float32")
    done = {i: write_shard(path, i, ShardResult(documents=docs[i * per_shard:(i + 1) * per_shard]), identity,
                           {"index": i}, "t", storage=exact) for i in held}
    write_manifest(path, identity, done, len(docs) // per_shard, "t")
    return path


def test_the_shards_both_folders_hold_are_compared_and_each_other_folder_has_its_own_result(tmp_path):
    """A complete folder against one scored in part (its shard 1 missing) and against another that
    lacks shard 0: each comparison pairs the shards both hold, names the rest, and passes; every
    folder ends in v1, yet each comparison's result is a file of its own."""
    docs = documents(n_docs=6)
    a = scored_shards(tmp_path / "x" / "c" / "t" / "v1", docs, [0, 1, 2])
    b = scored_shards(tmp_path / "y" / "c" / "t" / "v1", docs, [0, 2])
    c = scored_shards(tmp_path / "z" / "c" / "t" / "v1", docs, [1, 2])
    out = tmp_path / "out"
    for other, shared, only in ((b, 2, "shard-000001.parquet"), (c, 2, "shard-000000.parquet")):
        run = subprocess.run([sys.executable, "-m", "stages.inspect", "command=compare", f"path={a}", f"other={other}",
                              f"out_dir={out}", f"hydra.run.dir={tmp_path / 'logs'}", "compare.max_abs=0"], cwd=REPO,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"})
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"{shared} held by both, compared; 1 in the first only ({only})" in run.stdout, run.stdout
        assert "within tolerance" in run.stdout
    results = {json.loads(p.read_text())["b"]: json.loads(p.read_text()) for p in (out / "compare").iterdir()}
    assert sorted(results) == sorted([str(b), str(c)]), "one result per folder compared"
    for other, only in ((b, ["shard-000001.parquet"]), (c, ["shard-000000.parquet"])):
        saved = results[str(other)]
        assert saved["documents"] == 2 * 2 and saved["shards"] == 2 and saved["mismatched_documents"] == 0
        assert saved["shards_only_in_a"] == only and saved["shards_only_in_b"] == []
        assert saved["same_context"]["tokens"] == 4 * 30 and saved["same_context"]["max_abs"] == 0.0
