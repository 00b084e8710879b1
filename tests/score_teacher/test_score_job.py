"""Stage 1 end to end: real local Ray, real Parquet, the micro teacher, bad inputs."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.score_teacher.corpus import CorpusConfig, CorpusError
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.prepare import prepare
from pipeline.score_teacher.job import run_score_job
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.writer import DatasetMismatchError
from pipeline.method.tokenization import load_tokenizer
from storage_schemas import check_rows, complete_shard_files, file_sha256, read_manifest, read_shard_metadata


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> list[Path]:
    """Files holding what breaks naive pipelines: invalid UTF-8, lone surrogates, NUL, bad JSON."""
    folder = tmp_path_factory.mktemp("bad")
    binary = folder / "binary-text.parquet"  # a text column stored as bytes, one row not UTF-8
    pq.write_table(pa.table({"text": pa.array([b"fine text 1+1=2", b"\xff\xfe broken \xc3", None], pa.binary())}), binary)
    jsonl = folder / "web.jsonl"
    lines = [
        json.dumps({"text": "NUL inside\x00 this page: 2+2=4"}),
        '{"text": "lone surrogate \\ud800 here"}',
        "this line is not json",
        json.dumps({"text": 12345}),
        json.dumps({"text": "special strings <|endoftext|> </s> <s> stay text"}),
        json.dumps({"url": "no text field"}),
    ]
    jsonl.write_text("\n".join(lines) + "\n")
    return [binary, jsonl]


def job(micro_teacher, files, out, **kw) -> ScoreJobConfig:
    corpus = CorpusConfig(name="micro", source="files", files=[str(f) for f in files], rows_per_shard=kw.pop("rows", 40))
    return ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(micro_teacher), stride=kw.pop("stride", None)),
        corpus=corpus,
        scorer=ScorerConfig(max_batch_tokens=2048),
        output_dir=str(out),
        pool=PoolConfig(num_actors=kw.pop("actors", 1), num_cpus=1),
        progress=False,
        **kw,
    )


@pytest.fixture(scope="module")
def scored(micro_teacher, micro_corpus, bad_inputs, ray_local, tmp_path_factory):
    out = tmp_path_factory.mktemp("scored") / "ds"
    cfg = job(micro_teacher, [*micro_corpus, *bad_inputs], out, actors=2)
    return cfg, run_score_job(cfg)


def test_dataset_is_complete_and_meets_the_contract(scored):
    cfg, summary = scored
    manifest = read_manifest(cfg.output_dir)
    assert manifest["complete"] and summary.complete
    assert summary.shards_planned == len(manifest["shards"]) == 6  # 80+80 rows by 40, 3 rows, 6 lines
    tables = [pq.read_table(p) for p in complete_shard_files(cfg.output_dir)]
    for path, table in zip(complete_shard_files(cfg.output_dir), tables):
        assert check_rows(table, path.name) == []
        meta = read_shard_metadata(path)
        assert meta["vocagno.identity"] == manifest["identity"]
        entry = manifest["shards"][meta["vocagno.shard"]["index"]]
        assert entry["sha256"] == file_sha256(path) and entry["rows"] == table.num_rows
    ids = [i for t in tables for i in t.column("doc_id").to_pylist()]
    assert len(ids) == len(set(ids)) == summary.documents
    assert manifest["totals"]["tokens"] == sum(sum(map(len, t.column("token_ids").to_pylist())) for t in tables)
    assert summary.tokens > 10_000


def test_long_documents_are_windowed_not_truncated(scored):
    cfg, _ = scored
    window = read_manifest(cfg.output_dir)["identity"]["windows"]["window"]
    assert window == 64
    longest = max((len(ids), ids, losses) for p in complete_shard_files(cfg.output_dir)
                  for ids, losses in zip(*pq.read_table(p, columns=["token_ids", "losses"]).to_pydict().values()))
    n, _, losses = longest
    assert n > 20 * window, "the sample corpus holds long pages"
    assert np.isnan(losses[0]) and np.isfinite(losses[1:]).all(), "every token after the first has a loss"


def test_bad_inputs_are_recorded_by_reason_and_nothing_is_lost(scored, micro_corpus):
    cfg, summary = scored
    manifest = read_manifest(cfg.output_dir)
    reasons = manifest["totals"]["reasons"]
    n_input = sum(pq.ParquetFile(f).metadata.num_rows for f in micro_corpus) + 3 + 6
    skipped = [s for e in manifest["shards"] for s in e["skipped"]]
    assert summary.documents + len(skipped) == n_input, "every input row is stored or listed as skipped"
    assert reasons["invalid_utf8"] == 1 and reasons["lone_surrogate"] == 1 and reasons["invalid_json"] == 1
    assert reasons["invalid_text"] == 1 and reasons["contains_nul"] == 1
    assert reasons["null_text"] == 2 + 1 + 1, "two in the sample corpus, one in parquet, one JSONL line without text"
    assert reasons["empty_text"] == 2 and reasons["whitespace_only"] == 2
    by_id = {s["doc_id"]: s["reason"] for s in skipped}
    assert by_id["binary-text.parquet:1"] == "invalid_utf8" and by_id["web.jsonl:2"] == "invalid_json"
    rows = {r["doc_id"]: r for p in complete_shard_files(cfg.output_dir) for r in pq.read_table(p).to_pylist()}
    nul = rows["web.jsonl:0"]
    assert "\x00" in nul["text"] and len(nul["token_ids"]) > 0
    empties = [r for r in rows.values() if not r["text"].strip()]
    assert len(empties) == 4 and all(r["token_ids"] == [] for r in empties)


def test_special_token_strings_are_scored_as_text(scored, micro_teacher):
    cfg, _ = scored
    tok = load_tokenizer(str(micro_teacher))
    rows = {r["doc_id"]: r for p in complete_shard_files(cfg.output_dir) for r in pq.read_table(p).to_pylist()}
    row = rows["web.jsonl:4"]
    assert tok.eos_token_id not in row["token_ids"]
    covered = "".join(row["text"][s:e] for s, e in zip(row["starts"], row["ends"]))
    assert "<|endoftext|>" in covered


def test_rerun_after_partial_run_keeps_finished_shards_and_equals_uninterrupted(
    micro_teacher, micro_corpus, scored, bad_inputs, tmp_path
):
    full_cfg, _ = scored
    out = tmp_path / "partial"
    cfg = job(micro_teacher, [*micro_corpus, *bad_inputs], out, limit_shards=2)
    first = run_score_job(cfg)
    assert first.shards_scored == 2 and not first.complete and not read_manifest(out)["complete"]
    kept = {p.name: (p.stat().st_mtime_ns, file_sha256(p)) for p in out.glob("shard-*.parquet")}
    second = run_score_job(replace(cfg, limit_shards=None))
    assert second.shards_done_before == 2 and second.shards_scored == 4 and second.complete
    for name, (mtime, sha) in kept.items():
        assert ((out / name).stat().st_mtime_ns, file_sha256(out / name)) == (mtime, sha), f"{name} was rewritten"
    assert_same_dataset(out, full_cfg.output_dir)
    third = run_score_job(cfg)
    assert third.shards_scored == 0 and third.complete


def test_unfinished_shard_without_marker_is_redone(micro_teacher, micro_corpus, tmp_path):
    out = tmp_path / "ds"
    cfg = job(micro_teacher, micro_corpus[:1], out, rows=40)
    run_score_job(cfg)
    sha = {p.name: file_sha256(p) for p in out.glob("shard-*.parquet")}
    (out / "shard-000001.done.json").unlink()  # as if killed between rename and marker
    (out / ".shard-000000.parquet.tmp-dead").write_bytes(b"half")  # as if killed mid-write
    victim = out / "shard-000000.parquet"  # marked, but the file is no longer the one the marker describes
    os.truncate(victim, victim.stat().st_size // 2)
    again = run_score_job(cfg)
    assert again.shards_scored == 2 and again.complete
    assert not list(out.glob(".*tmp*"))
    assert {p.name: file_sha256(p) for p in out.glob("shard-*.parquet")} == sha, "both shards redone, as before"


def test_rerun_with_another_setup_is_refused_unless_overwrite(micro_teacher, micro_corpus, tmp_path):
    out = tmp_path / "ds"
    run_score_job(job(micro_teacher, micro_corpus[:1], out, rows=80))
    with pytest.raises(DatasetMismatchError, match="windows.stride"):
        prepare_and_run(job(micro_teacher, micro_corpus[:1], out, rows=80, stride=16))
    with pytest.raises(DatasetMismatchError, match="corpus.rows_per_shard"):
        prepare_and_run(job(micro_teacher, micro_corpus[:1], out, rows=20))
    redone = run_score_job(job(micro_teacher, micro_corpus[:1], out, rows=80, stride=16, overwrite=True))
    assert redone.complete and read_manifest(out)["identity"]["windows"]["stride"] == 16


def assert_same_dataset(a_dir, b_dir):
    """Same shards, documents, ids, tokens, offsets; losses equal bit for bit (NaN == NaN)."""
    a_files, b_files = complete_shard_files(a_dir), complete_shard_files(b_dir)
    assert [p.name for p in a_files] == [p.name for p in b_files]
    for a, b in zip(a_files, b_files):
        ta, tb = pq.read_table(a).to_pydict(), pq.read_table(b).to_pydict()
        for col in ("doc_id", "text", "token_ids", "starts", "ends"):
            assert ta[col] == tb[col], f"{a.name}: column {col} differs"
        for la, lb in zip(ta["losses"], tb["losses"]):
            np.testing.assert_array_equal(np.asarray(la, np.float32), np.asarray(lb, np.float32))
        assert file_sha256(a) == file_sha256(b), f"{a.name}: files differ byte-wise"


def test_second_job_on_the_same_folder_is_refused(micro_teacher, micro_corpus, tmp_path):
    from pipeline.folders.folder_lock import DatasetBusyError, exclusive_writer

    out = tmp_path / "ds"
    with exclusive_writer(out):  # as if another driver were running
        with pytest.raises(DatasetBusyError, match=f"pid {os.getpid()}"):
            run_score_job(job(micro_teacher, micro_corpus[:1], out))
    assert not list(out.glob("shard-*")), "the refused job wrote nothing"


def prepare_and_run(cfg):
    return run_score_job(cfg)


def test_corrupt_or_missing_input_fails_before_ray_naming_the_file(micro_teacher, tmp_path):
    broken = tmp_path / "train-00000-of-00001.parquet"
    broken.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(CorpusError, match="train-00000-of-00001.parquet"):
        prepare(job(micro_teacher, [broken], tmp_path / "out"))
    with pytest.raises(CorpusError, match="no file matches"):
        prepare(job(micro_teacher, [tmp_path / "missing-*.parquet"], tmp_path / "out"))
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n")
    with pytest.raises(CorpusError, match="unsupported corpus file type"):
        prepare(job(micro_teacher, [other], tmp_path / "out"))
    wrong_column = tmp_path / "other-schema.parquet"
    pq.write_table(pa.table({"content": ["x"]}), wrong_column)
    with pytest.raises(CorpusError, match="no column 'text'"):
        prepare(job(micro_teacher, [wrong_column], tmp_path / "out"))
    missing_teacher = replace(job(micro_teacher, [wrong_column], tmp_path / "out"),
                              teacher=TeacherConfig(name="t", model=str(tmp_path / "no-such-teacher")))
    with pytest.raises(CorpusError, match="no column"):  # the corpus is checked first
        prepare(missing_teacher)
    assert not (tmp_path / "out").exists(), "nothing is written before the input is known to be readable"


def test_missing_local_teacher_is_named(micro_corpus, tmp_path):
    cfg = job(tmp_path / "no-such-teacher", micro_corpus[:1], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="teacher.model: no such local file or folder"):
        prepare(cfg)


def test_stage_reports_user_errors_in_one_line(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "stages.score_teacher", "teacher=llemma-7b",
                          f"teacher.model={tmp_path}/missing", f"hydra.run.dir={tmp_path}/logs"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == f"error: teacher.model: no such local file or folder: {tmp_path}/missing"
