"""A corpus with no usable text is refused before any work, the same way for JSONL and Parquet:
the file, the fields it has and ``data.text_column`` named; a corpus with a few null texts is not."""

from __future__ import annotations

import hashlib
import os
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.score_teacher.corpus_sources import TEXT_SAMPLE_LINES, resolve_sources
from pipeline.score_teacher.corpus import CorpusConfig, CorpusError

REPO = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path = path.with_suffix(".jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    path = path.with_suffix(".parquet")
    names = list(dict.fromkeys(k for r in records for k in r))
    pq.write_table(pa.table({k: pa.array([r.get(k) for r in records], pa.string()) for k in names}), path)
    return path


WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet}


def corpus(*files: Path) -> CorpusConfig:
    return CorpusConfig(name="mine", source="files", files=[str(f) for f in files])


def pages(n: int, field: str = "content") -> list[dict]:
    return [{"url": f"https://example.org/{i}", field: f"page {i}: the sum of 2 and {i} is {2 + i}. " * 3}
            for i in range(n)]


@pytest.mark.parametrize("kind", WRITERS)
def test_a_file_without_the_text_field_names_it_the_fields_and_the_setting(kind, tmp_path):
    path = WRITERS[kind](tmp_path / "spacey", pages(120))
    with pytest.raises(CorpusError) as err:
        resolve_sources(corpus(path))
    message = str(err.value)
    assert message.startswith(f"{path}: no {'field' if kind == 'jsonl' else 'column'} 'text'")
    assert "fields found: url, content" in message or "columns found: url, content" in message
    assert message.endswith("set data.text_column=content if that field holds the text")  # the longer text field
    assert len(resolve_sources(CorpusConfig(name="mine", files=[str(path)], text_column="content"))) == 1


@pytest.mark.parametrize("kind", WRITERS)
def test_a_text_field_that_is_null_everywhere_is_refused(kind, tmp_path):
    records = [{"text": None, "body": f"document {i} " * 4} for i in range(30)]
    path = WRITERS[kind](tmp_path / "nulls", records)
    with pytest.raises(CorpusError, match=r"'text' holds no text .*set data.text_column=body"):
        resolve_sources(corpus(path))


@pytest.mark.parametrize("kind", WRITERS)
def test_a_few_null_texts_are_not_refused(kind, tmp_path):
    """Rows 1-8 of docs/RELIABILITY.md: some documents without text are recorded one by one."""
    records = pages(100, field="text")
    for i in (0, 1, 50):
        records[i]["text"] = None
    path = WRITERS[kind](tmp_path / "some-nulls", records)
    (source,) = resolve_sources(corpus(path))
    assert source.rows == 100


@pytest.mark.parametrize("kind", WRITERS)
def test_an_empty_corpus_is_refused(kind, tmp_path):
    empty = tmp_path / f"empty.{kind}"
    if kind == "jsonl":
        empty.write_text("")
    else:
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    with pytest.raises(CorpusError, match=f"corpus 'mine': no document to score: {empty} is empty"):
        resolve_sources(corpus(empty))
    other = WRITERS[kind](tmp_path / "other", pages(3, field="text"))
    assert [s.rows for s in resolve_sources(corpus(empty, other))] == [0, 3]  # one empty file of several: no loss


def test_the_jsonl_rule_looks_at_the_first_lines(tmp_path):
    """A JSONL file is judged by its first TEXT_SAMPLE_LINES lines: text in the last of them is
    enough; text only after them is not (documented); lines that are not JSON objects are named."""
    late = pages(TEXT_SAMPLE_LINES - 1) + pages(1, field="text")
    assert resolve_sources(corpus(write_jsonl(tmp_path / "late", late)))[0].rows == TEXT_SAMPLE_LINES
    too_late = pages(TEXT_SAMPLE_LINES) + pages(1, field="text")
    with pytest.raises(CorpusError, match=f"no field 'text' in its first {TEXT_SAMPLE_LINES} lines"):
        resolve_sources(corpus(write_jsonl(tmp_path / "too-late", too_late)))
    csv = tmp_path / "table.jsonl"
    csv.write_text("url,text\nhttps://example.org,some text\n")
    with pytest.raises(CorpusError, match="none of its first 2 lines is a JSON object"):
        resolve_sources(corpus(csv))


def numbers_as_text(path: Path) -> Path:
    """A Parquet file whose ``text`` column holds int64 numbers; the text is in ``body``."""
    path = path.with_suffix(".parquet")
    pq.write_table(pa.table({"url": [f"https://example.org/{i}" for i in range(50)], "text": list(range(50)),
                             "body": [f"page {i}: the sum of 2 and {i} is {2 + i}. " * 3 for i in range(50)]}), path)
    return path


def test_a_text_column_of_another_type_is_refused_and_one_of_bytes_is_not(tmp_path):
    path = numbers_as_text(tmp_path / "numbers")
    with pytest.raises(CorpusError) as err:
        resolve_sources(corpus(path))
    assert str(err.value) == (f"{path}: column 'text' has type int64; the text must be a string column (columns found: "
                              "url, text, body); set data.text_column=body if that field holds the text")
    raw = tmp_path / "bytes.parquet"  # UTF-8 bytes are read as text, decoded per row
    pq.write_table(pa.table({"text": pa.array([b"2 + 2 = 4", "π ≈ 3.14".encode()], pa.binary())}), raw)
    assert [s.rows for s in resolve_sources(corpus(raw))] == [2]


def stage1(tmp_path: Path, files: list[Path]) -> subprocess.CompletedProcess:
    """``make score-teacher`` with the user's corpus, as the README writes it."""
    args = ["data=open-web-math", "data.name=spacey", "data.source=files", f"data.files=[{','.join(map(str, files))}]",
            f"output_root={tmp_path / 'scored'}", f"artifacts_dir={tmp_path / 'artifacts'}",
            f"hydra.run.dir={tmp_path / 'logs'}"]
    return subprocess.run([sys.executable, "-m", "stages.score_teacher", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "VOCAGNO_TRACEBACK": ""})


@pytest.mark.parametrize("case", ["jsonl-content", "parquet-content", "empty-jsonl", "parquet-int64"])
def test_the_stage_refuses_a_corpus_without_text_in_one_line_before_any_work(case, tmp_path):
    if case == "empty-jsonl":
        path = tmp_path / "corpus" / "empty.jsonl"
        path.parent.mkdir()
        path.write_text("")
        expected = f"error: data.files: corpus 'spacey': no document to score: {path} is empty"
    elif case == "parquet-int64":
        (tmp_path / "corpus").mkdir()
        path = numbers_as_text(tmp_path / "corpus" / "numbers")
        expected = (f"error: data.files: {path}: column 'text' has type int64; the text must be a string column "
                    "(columns found: url, text, body); set data.text_column=body if that field holds the text")
    else:
        (tmp_path / "corpus").mkdir()
        path = WRITERS[case.split("-")[0]](tmp_path / "corpus" / "pages", pages(120))
        what = "field 'text' in its first 64 lines (fields" if path.suffix == ".jsonl" else "column 'text' (columns"
        expected = (f"error: data.files: {path}: no {what} found: url, content); "
                    "set data.text_column=content if that field holds the text")
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    res = stage1(tmp_path, [path])
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [expected]
    assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "scored").exists() and not (tmp_path / "artifacts").exists(), "nothing built or written"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before, "the corpus is left as it was"
