"""The real-text corpus split (repro/realtext.py) against what it promises, on files made here with
the real collection's columns: no document in both files, evaluation-only ids never trained on, the
budgets kept, a document's place independent of file order and budgets, and corpus.json's counts and
licenses equal to a count of the written files."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.runtime.config import ConfigError
from repro.realtext import RealCorpusConfig, build_real_corpus


def write_source(path, prefix: str, n: int, license_of, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = [{"id": f"{prefix}-{i}", "text": f"{prefix} {i}: " + "x" * rng.randint(10, 400), "source": f"repo@c:{prefix}",
             "license": license_of(i), "url": None} for i in range(n)]
    rows.append({"id": f"{prefix}-blank", "text": "   ", "source": "s", "license": "L", "url": None})
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture
def sources(tmp_path):
    write_source(tmp_path / "forum.parquet", "forum", 300, lambda i: "CC-BY-SA" if i % 3 else "CC-BY")
    write_source(tmp_path / "gsm8k.parquet", "gsm8k-train", 200, lambda i: "MIT")
    table = pq.read_table(tmp_path / "gsm8k.parquet").to_pylist()
    table += [{"id": f"gsm8k-test-{i}", "text": f"test question {i}?", "source": "s", "license": "MIT", "url": None}
              for i in range(50)]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "gsm8k.parquet")
    return [str(tmp_path / "forum.parquet"), str(tmp_path / "gsm8k.parquet")]


def read(folder, name) -> list[dict]:
    return pq.read_table(folder / f"{name}.parquet").to_pylist()


def test_the_split_keeps_its_promises(sources, tmp_path):
    cfg = RealCorpusConfig(files=sources, train_chars={"forum": 20_000, "gsm8k": 10_000}, held_out_chars=5_000,
                           held_out_share=0.2, seed=3)
    record = build_real_corpus(cfg, tmp_path / "out")
    train, held = read(tmp_path / "out", "train"), read(tmp_path / "out", "held_out")
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert not [r for r in train if r["id"].startswith("gsm8k-test-")]
    assert {r["id"] for r in held if r["id"].startswith("gsm8k-test-")}  # evaluation ids are where they belong
    assert not [r for r in train + held if not r["text"].strip()]  # blank documents go nowhere
    for source, budget in cfg.train_chars.items():
        assert 0.9 * budget < sum(len(r["text"]) for r in train if r["origin"] == source) <= budget
        assert sum(len(r["text"]) for r in held if r["origin"] == source) <= cfg.held_out_chars
    assert {r["origin"] for r in train[:40]} == {"forum", "gsm8k"}  # shards mix the sources
    for split, rows in (("train", train), ("held_out", held)):
        for source in ("forum", "gsm8k"):
            mine = [r for r in rows if r["origin"] == source]
            licenses = {}
            for r in mine:
                licenses[r["license"]] = licenses.get(r["license"], 0) + 1
            assert record[split][source] == {"documents": len(mine), "characters": sum(len(r["text"]) for r in mine),
                                             "licenses": licenses}
    assert json.loads((tmp_path / "out" / "corpus.json").read_text()) == json.loads(json.dumps(record))


def test_a_documents_place_depends_on_its_id_only(sources, tmp_path):
    """Files in another order and larger budgets: the same documents are held out, and none trained
    on in one is held out in the other."""
    small = RealCorpusConfig(files=sources, train_chars={"forum": 10_000, "gsm8k": 5_000}, held_out_share=0.2)
    large = RealCorpusConfig(files=sources[::-1], train_chars={"forum": 30_000, "gsm8k": 15_000}, held_out_share=0.2)
    build_real_corpus(small, tmp_path / "a")
    build_real_corpus(large, tmp_path / "b")
    train_a, train_b = ({r["id"] for r in read(tmp_path / d, "train")} for d in ("a", "b"))
    held_a, held_b = ({r["id"] for r in read(tmp_path / d, "held_out")} for d in ("a", "b"))
    assert held_a == held_b and not (train_a | train_b) & held_a and len(train_b) > len(train_a)
    again = build_real_corpus(small, tmp_path / "a")  # the same inputs and settings: kept as written
    assert again["train_ids_sha256"] == json.loads((tmp_path / "a" / "corpus.json").read_text())["train_ids_sha256"]


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ConfigError, match="absent.parquet: no such file"):
        build_real_corpus(RealCorpusConfig(files=[str(tmp_path / "absent.parquet")]), tmp_path / "out")
    pq.write_table(pa.table({"id": ["a", "a"], "text": ["x", "y"]}), tmp_path / "twice.parquet")
    with pytest.raises(ConfigError, match="twice: document ids repeat"):
        build_real_corpus(RealCorpusConfig(files=[str(tmp_path / "twice.parquet")]), tmp_path / "out")
    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(ConfigError, match="other: no text column"):
        build_real_corpus(RealCorpusConfig(files=[str(tmp_path / "other.parquet")]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_four_splits_keep_questions_together_and_evaluation_sets_apart(tmp_path):
    """Forum posts whose answers share a question (url), GSM8K's train and test questions: no url in two
    splits, GSM8K's held-out text is its test questions only, the warm-up text never overlaps the
    training text, and a larger warm-up budget changes neither the training nor the held-out text."""
    rng = random.Random(5)
    forum = [{"id": f"forum-{i}", "text": f"answer {i} " + "y" * rng.randint(20, 300), "source": "s", "license": "L",
              "url": f"https://q/{i // 3}"} for i in range(400)]  # three answers per question
    pq.write_table(pa.Table.from_pylist(forum), tmp_path / "forum.parquet")
    gsm = [{"id": f"gsm8k-{'test' if i % 4 == 0 else 'train'}-{i}", "text": f"q {i}?\n\nanswer {i}", "source": "s",
            "license": "MIT", "url": None} for i in range(400)]
    pq.write_table(pa.Table.from_pylist(gsm), tmp_path / "gsm8k.parquet")
    files = [str(tmp_path / "forum.parquet"), str(tmp_path / "gsm8k.parquet")]

    def build(warmup: int, out: str) -> dict[str, list[dict]]:
        cfg = RealCorpusConfig(files=files, group_by="url", held_out_evaluation_only=["gsm8k"],
                               train_chars={"forum": 15_000, "gsm8k": 1_500}, held_out_chars=4_000, held_out_share=0.1,
                               tune_share=0.1, tune_chars=2_000, warmup_chars={"forum": warmup, "gsm8k": warmup // 10})
        build_real_corpus(cfg, tmp_path / out)
        return {s: read(tmp_path / out, s) for s in ("train", "held_out", "tune", "warmup")}

    small, large = build(10_000, "a"), build(30_000, "b")
    for splits in (small, large):
        urls = {s: {r["url"] for r in rows if r["url"]} for s, rows in splits.items()}
        ids = {s: {r["id"] for r in rows} for s, rows in splits.items()}
        for a in splits:
            for b in splits:
                if a < b:
                    assert not urls[a] & urls[b], (a, b)
                    assert not ids[a] & ids[b], (a, b)
        held_gsm = [r["id"] for r in splits["held_out"] if r["origin"] == "gsm8k"]
        assert held_gsm and all(i.startswith("gsm8k-test-") for i in held_gsm)
        assert not [r for s in ("train", "tune", "warmup") for r in splits[s] if r["id"].startswith("gsm8k-test-")]
        assert splits["tune"] and splits["warmup"]
    assert small["train"] == large["train"] and small["held_out"] == large["held_out"]
    assert len(large["warmup"]) > len(small["warmup"])
