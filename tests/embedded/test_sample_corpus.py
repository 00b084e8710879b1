"""The embedded sample corpus: determinism, Parquet layout, cache, and the content it promises."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from fractions import Fraction

import pyarrow.parquet as pq
import pytest

from pipeline.embedded.sample_corpus import (
    CORPUS_SCHEMA,
    build_sample_corpus,
    clean_texts,
    generate_documents,
)

N_DOCS = 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A 400-document corpus, built once and read back from Parquet."""
    out_dir = tmp_path_factory.mktemp("corpus")
    paths = build_sample_corpus(out_dir, n_docs=N_DOCS, n_files=3, seed=0)
    rows = [row for path in paths for row in pq.read_table(path).to_pylist()]
    for row in rows:
        row["meta"] = json.loads(row["metadata"])
    return out_dir, paths, rows


def _texts(rows, kind=None):
    return [r["text"] for r in rows if r["text"] and (kind is None or r["meta"]["kind"] == kind)]


def _any(rows, pattern: str) -> bool:
    regex = re.compile(pattern)
    return any(regex.search(text) for text in _texts(rows))


# ---------------------------------------------------------------- determinism


def test_generate_documents_is_deterministic_per_seed():
    first = generate_documents(150, seed=7)
    assert first == generate_documents(150, seed=7)
    assert first != generate_documents(150, seed=8)
    assert all(set(doc) == {"url", "text", "date", "metadata"} for doc in first)


def test_generate_documents_does_not_depend_on_hash_randomisation():
    code = (
        "import hashlib, json; from pipeline.embedded.sample_corpus import generate_documents; "
        "print(hashlib.sha256(json.dumps(generate_documents(60, seed=3)).encode()).hexdigest())"
    )
    expected = hashlib.sha256(json.dumps(generate_documents(60, seed=3)).encode()).hexdigest()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == expected


def test_two_builds_are_byte_identical(tmp_path):
    first = build_sample_corpus(tmp_path / "a", n_docs=120, n_files=2, seed=5)
    second = build_sample_corpus(tmp_path / "b", n_docs=120, n_files=2, seed=5)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    assert (tmp_path / "a" / "_BUILD.json").read_bytes() == (tmp_path / "b" / "_BUILD.json").read_bytes()


def test_negative_counts_are_refused(tmp_path):
    with pytest.raises(ValueError):
        generate_documents(-1)
    with pytest.raises(ValueError):
        build_sample_corpus(tmp_path, n_docs=10, n_files=0)


# ---------------------------------------------------------------- Parquet layout


def test_schema_and_columns(corpus):
    _, paths, _ = corpus
    for path in paths:
        schema = pq.read_schema(path)
        assert schema.equals(CORPUS_SCHEMA)
        assert schema.names == ["url", "text", "date", "metadata"]
        assert not schema.metadata or b"pandas" not in schema.metadata
        assert pq.ParquetFile(path).metadata.row_group(0).column(1).compression == "ZSTD"


def test_file_names_and_contiguous_split(corpus):
    out_dir, paths, rows = corpus
    assert [p.name for p in paths] == [f"train-{i:05d}-of-00003.parquet" for i in range(3)]
    assert all(p.parent == out_dir for p in paths)
    assert [pq.ParquetFile(p).metadata.num_rows for p in paths] == [134, 133, 133]
    expected = generate_documents(N_DOCS, seed=0)
    assert [r["url"] for r in rows] == [d["url"] for d in expected]
    assert [r["text"] for r in rows] == [d["text"] for d in expected]
    assert sorted(os.listdir(out_dir)) == sorted([p.name for p in paths] + ["_BUILD.json"])


def test_stamp_records_parameters_and_checksums(corpus):
    out_dir, paths, _ = corpus
    stamp = json.loads((out_dir / "_BUILD.json").read_text())
    assert stamp["params"]["n_docs"] == N_DOCS
    assert stamp["params"]["n_files"] == 3
    assert stamp["params"]["seed"] == 0
    assert stamp["files"] == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


# ---------------------------------------------------------------- cache


def _mtimes(paths):
    return [p.stat().st_mtime_ns for p in paths]


def test_cache_hit_does_not_rewrite(tmp_path):
    paths = build_sample_corpus(tmp_path, n_docs=60, n_files=2)
    before = _mtimes(paths + [tmp_path / "_BUILD.json"])
    time.sleep(0.01)
    again = build_sample_corpus(tmp_path, n_docs=60, n_files=2)
    assert again == paths
    assert _mtimes(again + [tmp_path / "_BUILD.json"]) == before


def test_changed_parameter_rebuilds(tmp_path):
    paths = build_sample_corpus(tmp_path, n_docs=60, n_files=2, seed=0)
    old_bytes = [p.read_bytes() for p in paths]
    reseeded = build_sample_corpus(tmp_path, n_docs=60, n_files=2, seed=1)
    assert [p.read_bytes() for p in reseeded] != old_bytes

    fewer = build_sample_corpus(tmp_path, n_docs=60, n_files=1, seed=1)
    assert [p.name for p in fewer] == ["train-00000-of-00001.parquet"]
    leftovers = sorted(p.name for p in tmp_path.glob("train-*.parquet"))
    assert leftovers == ["train-00000-of-00001.parquet"]  # the old shards are gone


def test_damaged_file_is_rebuilt(tmp_path):
    paths = build_sample_corpus(tmp_path, n_docs=60, n_files=2)
    good = paths[1].read_bytes()
    paths[1].write_bytes(b"not parquet")
    rebuilt = build_sample_corpus(tmp_path, n_docs=60, n_files=2)
    assert rebuilt[1].read_bytes() == good


# ---------------------------------------------------------------- content


def test_documents_are_plausible_web_records(corpus):
    _, _, rows = corpus
    urls = [r["url"] for r in rows]
    assert len(set(urls)) == len(urls)
    assert all(re.fullmatch(r"https://[a-z.]+\.example\.(org|com|net)/\S+", u) for u in urls)
    for r in rows:
        datetime.strptime(r["date"], "%Y-%m-%dT%H:%M:%SZ")
        assert r["meta"]["kind"] in {"clean", "noise", "empty"}
        assert isinstance(r["meta"]["extraction_info"]["found_math"], bool)
        assert r["meta"]["topic"]


def test_bad_rows(corpus):
    _, _, rows = corpus
    bad = [r for r in rows if r["meta"]["kind"] == "empty"]
    texts = [r["text"] for r in bad]
    assert texts.count("") == 2
    assert texts.count(None) == 2
    assert sum(1 for t in texts if t and not t.strip()) == 2
    assert "\r\n\r\n" in texts
    positions = [i for i, r in enumerate(rows) if r["meta"]["kind"] == "empty"]
    assert min(b - a for a, b in zip(positions, positions[1:])) >= N_DOCS // 10
    # nothing else is empty
    assert all(r["text"] and r["text"].strip() for r in rows if r["meta"]["kind"] != "empty")


def test_noise_documents(corpus):
    _, _, rows = corpus
    noise = [r for r in rows if r["meta"]["kind"] == "noise"]
    assert 0.08 * N_DOCS <= len(noise) <= 0.25 * N_DOCS
    assert {r["meta"]["topic"] for r in noise} == {
        "boilerplate", "random-strings", "broken-html", "shuffled-words"}
    assert not any(r["meta"]["extraction_info"]["found_math"] for r in noise)
    texts = " ".join(_texts(rows, "noise"))
    assert "cookies" in texts and "<div" in texts


@pytest.mark.parametrize(
    "pattern",
    [
        r"\$\\frac\{\d+\}\{\d+\}",
        r"\\\[ \\int_0\^1 x\^2\\,dx = \\frac13 \\\]",
        r"\\sum_\{k=1\}\^n k = \\frac\{n\(n\+1\)\}\{2\}",
        r"\\begin\{align\}[\s\S]*?&=[\s\S]*?\\end\{align\}",
        r"\$\\binom\{\d+\}\{\d+\}",
    ],
)
def test_latex(corpus, pattern):
    assert _any(corpus[2], pattern)


@pytest.mark.parametrize("symbol", list("∑∫√≤≥≠πθ∞∈ℝ→²₁"))
def test_unicode_maths(corpus, symbol):
    assert any(symbol in t for t in _texts(corpus[2], "clean"))


def test_emoji_including_multi_codepoint(corpus):
    rows = corpus[2]
    assert _any(rows, "[🙂👍🤔😅🎉✅😀🙏]")
    assert _any(rows, "\U0001F468\u200d\U0001F469\u200d\U0001F467|\U0001F469\u200d\U0001F4BB|\U0001F9D1\u200d\U0001F3EB")
    assert _any(rows, "[\U0001F1E6-\U0001F1FF]{2}")  # a flag


def test_cjk_whitespace_and_newlines(corpus):
    rows = corpus[2]
    assert _any(rows, "[\u4e00-\u9fff]")  # Chinese
    assert _any(rows, "[\u3040-\u30ff]")  # Japanese kana
    assert _any(rows, "\r\n")
    assert _any(rows, "\t")
    assert _any(rows, "\\S {3,}\\S")


def test_long_pages(corpus):
    rows = corpus[2]
    long_pages = [t for t in _texts(rows, "clean") if len(t) >= 20_000]
    assert 2 <= len(long_pages) <= 0.02 * N_DOCS
    assert all(len(t) <= 65_000 for t in long_pages)


def test_special_token_strings_stay_text(corpus):
    rows = corpus[2]
    for token in ("<|endoftext|>", "</s>", "<s>", "<|im_start|>"):
        assert any(token in t for t in _texts(rows, "clean")), token


def test_average_document_length(corpus):
    lengths = [len(t) for t in _texts(corpus[2]) if len(t) < 20_000]
    assert 800 <= sum(lengths) / len(lengths) <= 2000


# ---------------------------------------------------------------- arithmetic is right

_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "×": lambda a, b: a * b,
    "*": lambda a, b: a * b,
    "÷": Fraction,
    "/": Fraction,
}


def test_solved_arithmetic_is_correct(corpus):
    pattern = re.compile(r"(?:Solution|Answer|A): (\d+) ([-+×*÷/]) (\d+) = (\d+)\b")
    checked = 0
    for text in _texts(corpus[2], "clean"):
        for a, op, b, c in pattern.findall(text):
            assert _OPS[op](int(a), int(b)) == int(c), f"{a} {op} {b} = {c}"
            checked += 1
    assert checked >= 100


def test_solved_linear_equations_are_correct(corpus):
    pattern = re.compile(
        r"Solve \$(\d+)x \+ (\d+) = (-?\d+)\$ for \$x\$\.\s+(?:Solution|Answer|A): .*?\$x = (-?\d+)\$",
        re.S,
    )
    checked = 0
    for text in _texts(corpus[2], "clean"):
        for a, b, c, x in pattern.findall(text):
            assert int(a) * int(x) + int(b) == int(c)
            checked += 1
    assert checked >= 20


# ---------------------------------------------------------------- clean_texts and speed


def test_clean_texts_returns_only_clean_documents(corpus):
    out_dir, paths, rows = corpus
    expected = _texts(rows, "clean")
    assert clean_texts(paths) == expected
    assert clean_texts(out_dir) == expected
    noise = set(_texts(rows, "noise"))
    assert noise and not noise & set(expected)
