import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.score_teacher.writer import documents_table, write_shard
from pipeline.score_teacher.teacher import ScoredDocument, ShardResult
from storage_schemas import (
    ROW_SCHEMA,
    SCHEMA_VERSION,
    ContractError,
    check_rows,
    file_sha256,
    read_manifest,
    read_shard_metadata,
)


def _doc(doc_id, text, spans, losses):
    ids = np.arange(len(spans), dtype=np.int32)
    starts = np.array([s for s, _ in spans], dtype=np.int32)
    ends = np.array([e for _, e in spans], dtype=np.int32)
    return ScoredDocument(doc_id, text, ids, starts, ends, np.array(losses, dtype=np.float32))


def test_shard_round_trip_keeps_schema_metadata_and_values(tmp_path):
    docs = [_doc("a:0", "ab cd", [(0, 2), (2, 5)], [np.nan, 1.5]), _doc("a:1", "", [], [])]
    result = ShardResult(documents=docs, reasons={"empty_text": 1})
    entry = write_shard(tmp_path, 3, result, {"teacher": {"name": "t"}}, {"file": "x.parquet", "start": 0, "stop": 2}, "0.1")
    path = tmp_path / "shard-000003.parquet"
    assert entry["file"] == path.name and entry["rows"] == 2 and entry["tokens"] == 2
    assert entry["sha256"] == file_sha256(path)
    assert json.loads((tmp_path / "shard-000003.done.json").read_text()) == entry
    meta = read_shard_metadata(path)
    assert meta["vocagno.schema_version"] == SCHEMA_VERSION
    assert meta["vocagno.identity"] == {"teacher": {"name": "t"}}
    assert meta["vocagno.shard"]["index"] == 3
    table = pq.read_table(path)
    assert table.schema.remove_metadata().equals(ROW_SCHEMA)
    losses = table.column("losses").to_pylist()
    assert np.isnan(losses[0][0]) and losses[0][1] == 1.5 and losses[1] == []
    assert check_rows(table, "x") == []
    assert not list(tmp_path.glob(".*tmp*")), "no temporary file may remain"


def test_check_rows_reports_each_broken_invariant():
    bad = documents_table([
        _doc("d:0", "abc", [(0, 2), (1, 4)], [1.0, 2.0]),  # span past the text
        _doc("d:1", "abc", [(2, 3), (0, 1)], [1.0, 2.0]),  # starts decrease
        _doc("d:2", "abc", [(0, 1)], [float("inf")]),  # infinite loss
    ])
    problems = check_rows(bad, "f.parquet")
    assert len(problems) == 3
    assert "d:0" in problems[0] and "outside the text" in problems[0]
    assert "d:1" in problems[1] and "decrease" in problems[1]
    assert "d:2" in problems[2] and "infinite" in problems[2]


def test_unequal_list_lengths_are_reported():
    table = pa.table({
        "doc_id": ["d"], "text": ["ab"], "token_ids": [[1, 2]], "starts": [[0, 1]], "ends": [[1]], "losses": [[0.5, 0.5]],
    })
    assert "list lengths differ" in check_rows(table, "f")[0]


def test_shard_metadata_missing_or_from_another_version_is_refused(tmp_path):
    plain = tmp_path / "plain.parquet"
    pq.write_table(documents_table([]), plain)
    with pytest.raises(ContractError, match="missing shard metadata"):
        read_shard_metadata(plain)
    other = tmp_path / "other.parquet"
    meta = {k: json.dumps(v) for k, v in {"vocagno.schema_version": 99, "vocagno.identity": {}, "vocagno.shard": {},
                                          "vocagno.code_version": "x"}.items()}
    pq.write_table(documents_table([]).replace_schema_metadata(meta), other)
    with pytest.raises(ContractError, match="schema version 99"):
        read_shard_metadata(other)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(ContractError, match="garbage.parquet"):
        read_shard_metadata(garbage)


def test_manifest_paths_cannot_leave_the_dataset_folder(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"schema_version": SCHEMA_VERSION, "shards": [{"file": "../../etc/passwd"}]}))
    with pytest.raises(ContractError, match="not a shard file name"):
        read_manifest(tmp_path)


def test_compact_encodings_keep_every_value_and_shrink_the_file(tmp_path):
    from pipeline.score_teacher.writer import StorageConfig

    rng = np.random.default_rng(0)
    docs = []
    for k in range(20):
        n = 500
        ends = np.cumsum(rng.integers(1, 6, n)).astype(np.int32)
        starts = np.r_[0, ends[:-1]].astype(np.int32)
        losses = rng.gamma(2.0, 1.5, n).astype(np.float32)
        losses[0] = np.nan
        docs.append(ScoredDocument(f"d:{k}", "x" * int(ends[-1]), rng.integers(0, 32000, n).astype(np.int32), starts, ends, losses))
    result = ShardResult(documents=docs)
    sizes = {}
    for name, storage in {"default": StorageConfig(), "compact": StorageConfig(encodings="compact", compression_level=9)}.items():
        folder = tmp_path / name
        folder.mkdir()
        sizes[name] = write_shard(folder, 0, result, {}, {}, "v", storage=storage)["bytes"]
        table = pq.read_table(folder / "shard-000000.parquet")
        row_group = pq.ParquetFile(folder / "shard-000000.parquet").metadata.row_group(0)
        encodings = {row_group.column(i).path_in_schema: row_group.column(i).encodings for i in range(row_group.num_columns)}
        if name == "compact":  # the encodings must really be in the file, not silently dropped
            assert "DELTA_BINARY_PACKED" in encodings["starts.list.element"]
            assert "BYTE_STREAM_SPLIT" in encodings["losses.list.element"]
        assert table.column("starts").to_pylist() == [d.starts.tolist() for d in docs]
        got = np.concatenate([np.asarray(x, np.float32) for x in table.column("losses").to_pylist()])
        np.testing.assert_array_equal(got, np.concatenate([d.losses for d in docs]))
    assert sizes["compact"] < 0.8 * sizes["default"], sizes


@pytest.mark.parametrize("precision,rel", [("bfloat16", 2**-8), ("float16", 2**-11)])
def test_loss_rounding_is_bounded_and_keeps_nan(precision, rel):
    from pipeline.score_teacher.writer import round_losses

    x = np.array([np.nan, 0.0, 1e-3, 0.7, 3.14159, 12.5, 30.0], dtype=np.float32)
    y = round_losses(x, precision)
    assert y.dtype == np.float32 and np.isnan(y[0])
    np.testing.assert_allclose(y[1:], x[1:], rtol=rel, atol=1e-7)
    assert (y[1:] != x[1:]).any(), "rounding must actually drop precision"


def test_dataset_dir_names_the_schema_version(tmp_path):
    from storage_schemas import dataset_dir

    assert dataset_dir(tmp_path, "open-web-math", "qwen-7b") == tmp_path / "open-web-math" / "qwen-7b" / "v1"
    assert dataset_dir("outputs/scored", "c", "t").as_posix() == "outputs/scored/c/t/v1"


def test_polars_schema_is_the_row_schema_and_polars_is_not_needed_to_import_the_contract():
    import subprocess
    import sys

    import polars as pl

    from storage_schemas import polars_schema

    assert dict(polars_schema()) == {"doc_id": pl.String, "text": pl.String, "token_ids": pl.List(pl.Int32),
                                     "starts": pl.List(pl.Int32), "ends": pl.List(pl.Int32), "losses": pl.List(pl.Float32)}
    code = "import sys, storage_schemas, storage_schemas.reader; print('polars' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_row_problems_name_row_and_document_per_rule():
    """The row checker against hand-worked expectations, one planted fault per row."""
    from storage_schemas import RowRules, table_problems

    nan = float("nan")
    table = pa.table({
        "doc_id": ["ok", "neg", "vocab", "empty", "", "late-nan"],
        "text": ["abcd", "ab", "ab", "ab", "ab", "abc"],
        "token_ids": [[1, 2], [1, 2], [7], [1, 0], [1], [1, 2]],
        "starts": [[0, 2], [0, 1], [0], [0, 1], [0], [0, 1]],
        "ends": [[2, 4], [1, 2], [1], [1, 1], [1], [1, 3]],
        "losses": [[nan, 1.0], [nan, -1.0], [nan], [nan, 2.0], [nan], [nan, nan]],
    }, schema=ROW_SCHEMA)
    special_zero = RowRules(vocab_size=5, bos=False, special_ids=frozenset({0}))
    found = [(p.row, p.doc_id, p.severity, p.message.split(" (")[0]) for p in table_problems(table, special_zero, first_row=10)]
    assert found == [
        (11, "neg", "error", "negative loss"),
        (12, "vocab", "error", "token id outside the teacher vocabulary"),
        (14, "", "error", "empty or null doc_id"),
        (15, "late-nan", "warning", "NaN loss past the first token"),
    ], found
    no_special = RowRules(vocab_size=5, bos=False, special_ids=frozenset())
    assert [(p.row, p.message.split(" (")[0]) for p in table_problems(table, no_special) if p.doc_id == "empty"] == [
        (3, "empty text slice for a non-special token")]
