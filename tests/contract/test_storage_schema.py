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
        _doc("d:3", "abc", [(2, 1)], [1.0]),  # end before start
        _doc("d:4", "abc", [(0, 1)], [float("-inf")]),  # infinite loss, the other sign
    ])
    problems = check_rows(bad, "f.parquet")
    assert len(problems) == 5
    assert "d:0" in problems[0] and "outside the text" in problems[0]
    assert "d:1" in problems[1] and "decrease" in problems[1]
    assert "d:2" in problems[2] and "infinite" in problems[2]
    assert "d:3" in problems[3] and "(2,1)" in problems[3]
    assert "d:4" in problems[4] and "infinite" in problems[4]


def test_check_rows_accepts_what_real_tokenizers_give():
    """Byte-fallback pieces repeat their character's span (equal starts), byte-level pieces of a
    split character overlap, empty texts have no tokens, special tokens have empty spans, and the
    first token's loss is NaN: none of these is a problem."""
    good = documents_table([
        _doc("d:0", "a🙂b", [(0, 1), (1, 2), (1, 2), (1, 2), (1, 2), (2, 3)], [np.nan, 1, 2, 3, 4, 5]),
        _doc("d:1", "x ∑ y", [(0, 1), (1, 3), (2, 3), (3, 5)], [np.nan, 0.5, 0.25, 7.0]),
        _doc("d:2", "", [], []),
        _doc("d:3", "ab", [(0, 0), (0, 2)], [np.nan, 3.0]),
    ])
    assert check_rows(good, "f.parquet") == []


def _items(value_type: pa.DataType) -> pa.DataType:
    """A list type that differs from the contract's only in its value type."""
    return pa.list_(pa.field("item", value_type, nullable=False))


@pytest.mark.parametrize("column,wrong", [
    ("token_ids", _items(pa.int64())),
    ("starts", _items(pa.int64())),
    ("ends", _items(pa.uint32())),
    ("losses", _items(pa.float64())),
    ("losses", _items(pa.float16())),
    ("text", pa.large_string()),
    ("doc_id", pa.int64()),
])
def test_a_column_of_another_type_is_refused_naming_it(tmp_path, column, wrong):
    """The contract fixes every column's type; a shard whose column has another type (the names
    and the metadata all right) is refused by the reader, naming the file and the column."""
    good = documents_table([_doc("d:0", "ab cd", [(0, 2), (2, 5)], [np.nan, 1.5])])
    meta = good.schema.metadata or {}
    good = good.replace_schema_metadata({**meta, **{k: json.dumps(v) for k, v in {
        "vocagno.schema_version": SCHEMA_VERSION, "vocagno.identity": {}, "vocagno.shard": {},
        "vocagno.code_version": "x"}.items()}})
    pq.write_table(good, tmp_path / "good.parquet")
    read_shard_metadata(tmp_path / "good.parquet")  # the unchanged shard is accepted
    types = {**{f.name: f.type for f in ROW_SCHEMA}, column: wrong}
    values = {"doc_id": [7] if column == "doc_id" else ["d:0"], "text": ["ab cd"], "token_ids": [[0, 1]],
              "starts": [[0, 2]], "ends": [[2, 5]], "losses": [[np.nan, 1.5]]}
    if column == "losses" and wrong.value_type == pa.float16():
        values["losses"] = [np.array([np.nan, 1.5], np.float16)]
    bad = pa.table({name: pa.array(values[name], types[name]) for name in ROW_SCHEMA.names}).replace_schema_metadata(
        good.schema.metadata)
    path = tmp_path / "bad.parquet"
    pq.write_table(bad, path)
    with pytest.raises(ContractError, match=f"bad.parquet: column '{column}' has type"):
        read_shard_metadata(path)


def test_columns_in_another_order_are_refused(tmp_path):
    """Swapped ``starts`` and ``ends`` have the same type: only the column order tells them apart."""
    good = documents_table([_doc("d:0", "ab cd", [(0, 2), (2, 5)], [np.nan, 1.5])])
    names = ["doc_id", "text", "token_ids", "ends", "starts", "losses"]
    meta = {k: json.dumps(v) for k, v in {"vocagno.schema_version": SCHEMA_VERSION, "vocagno.identity": {},
                                          "vocagno.shard": {}, "vocagno.code_version": "x"}.items()}
    swapped = good.select(names).replace_schema_metadata(meta)
    pq.write_table(swapped, tmp_path / "swapped.parquet")
    with pytest.raises(ContractError, match="swapped.parquet: columns"):
        read_shard_metadata(tmp_path / "swapped.parquet")


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
    for name, storage in {"default": StorageConfig(encodings="default", loss_precision="float32"),
                          "compact": StorageConfig(encodings="compact", loss_precision="float32", compression_level=9)}.items():
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


def test_bfloat16_rounding_equals_torch_round_to_nearest_even():
    """torch's float32 -> bfloat16 conversion (round to nearest, ties to even) is the reference,
    on random values and on exact ties between two bfloat16 neighbours."""
    import torch

    from pipeline.score_teacher.writer import round_losses

    rng = np.random.default_rng(0)
    x = rng.gamma(2.0, 2.0, 5000).astype(np.float32)
    # exact ties: the 16 dropped bits are 0x8000, above an even and above an odd bfloat16
    ties = np.array([0x3F808000, 0x3F818000, 0x40208000, 0x40218000, 0x41008000], dtype=np.uint32).view(np.float32)
    x = np.r_[x, ties, np.float32(0.0), np.float32(1e-30)]
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(round_losses(x, "bfloat16"), want)
    np.testing.assert_array_equal(round_losses(ties, "bfloat16"), [1.0, 1.015625, 2.5, 2.53125, 8.0])
    np.testing.assert_array_equal(round_losses(x, "float16"), torch.from_numpy(x).half().float().numpy())


def test_rounded_losses_are_what_the_shard_stores(tmp_path):
    from pipeline.score_teacher.writer import StorageConfig, round_losses

    losses = np.array([np.nan, 0.1, 1.2345678, 9.87654], dtype=np.float32)
    doc = _doc("d:0", "abcd", [(0, 1), (1, 2), (2, 3), (3, 4)], losses)
    write_shard(tmp_path, 0, ShardResult(documents=[doc]), {}, {}, "v", storage=StorageConfig(loss_precision="bfloat16"))
    stored = np.asarray(pq.read_table(tmp_path / "shard-000000.parquet").column("losses").to_pylist()[0], np.float32)
    import torch

    np.testing.assert_array_equal(stored, torch.from_numpy(losses).to(torch.bfloat16).float().numpy())
    assert not np.array_equal(stored[1:], losses[1:]), "the stored values really are rounded"
    np.testing.assert_array_equal(round_losses(losses, "float32"), losses)


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
