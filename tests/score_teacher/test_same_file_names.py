"""Corpus files of one name in different folders (``a/train.jsonl``, ``b/train.jsonl``): each is
named in the document ids by as many trailing path parts as tell them apart, the same for a local
copy and a bucket of the same layout; a file whose name no other file has keeps its name, so the
ids and identity of every corpus scored before stay as they were."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.shards import corpus_identity, plan_shards, read_shard
from pipeline.score_teacher.corpus_sources import resolve_sources
from storage_schemas import filesystem as sfs

REPO = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, n: int, tag: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{tag} page {i}: 2 + {i} = {2 + i}, and {i} squared is {i * i}."})
                            + "\n" for i in range(n)))
    return path


def ids(cfg: CorpusConfig) -> list[str]:
    sources = resolve_sources(cfg)
    return [d.doc_id for s in plan_shards(sources, cfg.rows_per_shard, cfg.limit_docs) for d in read_shard(s)]


def test_files_of_one_name_are_told_apart_by_their_folders_and_other_files_keep_their_names(tmp_path, s3_server,
                                                                                            monkeypatch):
    monkeypatch.setenv("VOCAGNO_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "corpus"
    for rel, n in (("a/train.jsonl", 3), ("b/train.jsonl", 2), ("c/other.jsonl", 2), ("x/deep/t.jsonl", 1),
                   ("y/deep/t.jsonl", 1)):
        write_jsonl(root / rel, n, rel)
    local = CorpusConfig(name="c", files=[str(root / "*" / "*.jsonl"), str(root / "*" / "deep" / "*.jsonl")],
                         rows_per_shard=2)
    expected = ["a/train.jsonl:0", "a/train.jsonl:1", "a/train.jsonl:2", "b/train.jsonl:0", "b/train.jsonl:1",
                "other.jsonl:0", "other.jsonl:1", "x/deep/t.jsonl:0", "y/deep/t.jsonl:0"]
    assert ids(local) == expected
    assert ids(local) == expected, "the same ids on a rerun"
    assert ids(replace(local, limit_docs=2)) == expected[:2], "reading part of the corpus changes no id"

    bucket = s3_server()
    for p in sorted(root.rglob("*.jsonl")):
        sfs.write_bytes(f"{bucket}/mirror/{p.relative_to(root).as_posix()}", p.read_bytes())
    remote = replace(local, files=[f"{bucket}/mirror/*/*.jsonl", f"{bucket}/mirror/*/deep/*.jsonl"])
    assert ids(remote) == expected, "a bucket of the same layout gives the same ids"
    identities = [corpus_identity(cfg, s, plan_shards(s, 2)) for cfg in (local, remote) for s in [resolve_sources(cfg)]]
    assert identities[0] == identities[1]


def test_a_corpus_of_distinct_file_names_keeps_its_ids_and_identity(tmp_path):
    """The ids are ``<file name>:<row>`` and the identity's ``files_sha256`` hashes each file's name,
    rows, bytes and content sha256, as for every dataset scored before names could repeat."""
    first, second = write_jsonl(tmp_path / "a" / "one.jsonl", 2, "one"), write_jsonl(tmp_path / "b" / "two.jsonl", 1, "two")
    cfg = CorpusConfig(name="c", files=[str(first), str(second)], rows_per_shard=5)
    assert ids(cfg) == ["one.jsonl:0", "one.jsonl:1", "two.jsonl:0"]
    listing = [[p.name, rows, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()]
               for p, rows in ((first, 2), (second, 1))]
    sources = resolve_sources(cfg)
    assert corpus_identity(cfg, sources, plan_shards(sources, 5))["files_sha256"] == \
        hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VOCAGNO_TRACEBACK": ""})


@pytest.mark.long
def test_stage1_on_two_files_of_one_name_gives_unique_ids_and_validates(micro_teacher, tmp_path):
    a = write_jsonl(tmp_path / "corpus" / "a" / "train.jsonl", 5, "a")
    b = write_jsonl(tmp_path / "corpus" / "b" / "train.jsonl", 4, "b")
    scored = run("stages.score_teacher", "data=open-web-math", "data.name=twins", "data.source=files",
                 f"data.files=[{a},{b}]", "data.rows_per_shard=3", "teacher=tiny", "teacher.embedded=false",
                 "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.window=32", "ray.num_cpus=1",
                 "progress=false", f"output_root={tmp_path / 'scored'}", f"artifacts_dir={tmp_path / 'artifacts'}",
                 f"hydra.run.dir={tmp_path / 'logs'}")
    assert scored.returncode == 0, scored.stderr[-3000:]
    folder = tmp_path / "scored" / "twins" / "micro" / "v1"
    validated = run("stages.inspect", "command=validate", f"path={folder}", f"out_dir={tmp_path / 'inspect'}",
                    f"hydra.run.dir={tmp_path / 'logs-validate'}")
    assert validated.returncode == 0, validated.stdout[-3000:] + validated.stderr[-3000:]
    doc_ids = [d for p in sorted(folder.glob("shard-*.parquet")) for d in pq.read_table(p).column("doc_id").to_pylist()]
    assert doc_ids == [f"a/train.jsonl:{i}" for i in range(5)] + [f"b/train.jsonl:{i}" for i in range(4)]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [e["source"]["file"] for e in manifest["shards"]] == ["a/train.jsonl", "a/train.jsonl", "b/train.jsonl",
                                                                 "b/train.jsonl"]
