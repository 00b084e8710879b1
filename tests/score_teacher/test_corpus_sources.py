"""Where a corpus can live: a hub dataset repository read in place, local files, and files on S3
(moto's real S3 server on 127.0.0.1). The shard plan comes from Parquet footers and each shard
reads only its rows.

The hub cannot be reached here, so the hub path runs three ways: on a local or S3 folder laid out
like the repository (``hub_root``); with huggingface_hub's real ``HfApi`` and ``HfFileSystem``
against :class:`StandInHub`, a small HTTP server on 127.0.0.1 that answers the hub's revision, tree
and resolve endpoints from such a folder; and the listing function with a stand-in ``HfApi``
object. What is not run: the real hub's responses (pagination, Xet-backed downloads, gated access).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipeline.score_teacher import corpus as corpus_mod
from pipeline.score_teacher import corpus_sources as sources_mod
from pipeline.score_teacher import shards as shards_mod
from pipeline.score_teacher.corpus import CorpusConfig, CorpusError
from pipeline.score_teacher.corpus_sources import (
    RepoFile,
    folder_listing,
    hub_listing,
    resolve_sources,
    select_repo_files,
)
from pipeline.score_teacher.shards import corpus_identity, plan_shards, read_shard
from storage_schemas import filesystem as sfs

# (name, rows, row_group_size): row groups of 25 and shards of 15 put shard boundaries inside groups
TRAIN_FILES = [("data/train-00000-of-00003-abc.parquet", 70, 25),
               ("data/train-00001-of-00003-def.parquet", 40, 40),
               ("data/train-00002-of-00003-0a1.parquet", 33, 10)]
TEST_FILE = ("data/test-00000-of-00001-fff.parquet", 12, 12)


def owm_table(tag: str, n: int) -> pa.Table:
    """Rows in OpenWebMath's schema; every text names its file and row, with unicode maths."""
    texts = [f"{tag} row {i}: ∑_k k² = n(n+1)(2n+1)/6, π≈3.14159 — 数学 {'x' * (i % 7)}" for i in range(n)]
    return pa.table({"url": [f"https://example.org/{tag}/{i}" for i in range(n)], "text": texts,
                     "date": ["2023-01-01"] * n, "metadata": [json.dumps({"i": i}) for i in range(n)]})


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory) -> Path:
    """A folder laid out like the hub repository open-web-math/open-web-math: README, attributes,
    the train split in three Parquet files of several row groups, and a test split."""
    root = tmp_path_factory.mktemp("hub") / "open-web-math"
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text("---\nlicense: odc-by\n---\n# stand-in\n")
    (root / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    for name, rows, group in [*TRAIN_FILES, TEST_FILE]:
        pq.write_table(owm_table(Path(name).stem, rows), root / name, row_group_size=group)
    return root


def hub_cfg(root, **kw) -> CorpusConfig:
    return CorpusConfig(name="owm", source="hub", hub_id="open-web-math/open-web-math", hub_root=str(root),
                        rows_per_shard=kw.pop("rows_per_shard", 15), **kw)


def all_texts(paths) -> list[tuple[str, str]]:
    """(doc id, text) of every row, by reading whole files (the brute-force reference)."""
    return [(f"{Path(p).name}:{i}", t) for p in paths for i, t in enumerate(pq.read_table(p).column("text").to_pylist())]


def read_plan(shards) -> list[tuple[str, str]]:
    return [(d.doc_id, d.text) for s in shards for d in read_shard(s)]


# ---------------------------------------------------------------------------------------------
# A hub repository laid out in a folder


def test_plan_comes_from_footers_and_each_shard_equals_a_brute_force_slice(hub_repo):
    sources = resolve_sources(hub_cfg(hub_repo))
    assert [s.path for s in sources] == [str(hub_repo / n) for n, _, _ in TRAIN_FILES]  # the test split left out
    assert [s.rows for s in sources] == [70, 40, 33]
    assert [s.row_groups for s in sources] == [(25, 25, 20), (40,), (10, 10, 10, 3)]
    shards = plan_shards(sources, 15)
    assert [(s.label, s.start, s.stop) for s in shards][:6] == [
        ("train-00000-of-00003-abc.parquet", 0, 15), ("train-00000-of-00003-abc.parquet", 15, 30),
        ("train-00000-of-00003-abc.parquet", 30, 45), ("train-00000-of-00003-abc.parquet", 45, 60),
        ("train-00000-of-00003-abc.parquet", 60, 70), ("train-00001-of-00003-def.parquet", 0, 15)]
    for shard in shards:
        expected = pq.read_table(shard.path).column("text").to_pylist()[shard.start:shard.stop]
        docs = read_shard(shard)
        assert [d.text for d in docs] == expected, shard.describe()
        assert [d.doc_id for d in docs] == [f"{shard.label}:{r}" for r in range(shard.start, shard.stop)]
    assert read_plan(shards) == all_texts([hub_repo / n for n, _, _ in TRAIN_FILES])


def test_planning_reads_footers_only_and_a_damaged_row_group_fails_its_shard_by_name(hub_repo, tmp_path):
    """The text pages of the second row group are overwritten; the footer is intact. Planning
    succeeds from the footer; the shards over the damaged group fail naming file and rows; the
    others read."""
    repo = tmp_path / "repo"
    shutil.copytree(hub_repo, repo)
    victim = repo / TRAIN_FILES[0][0]
    meta = pq.ParquetFile(victim).metadata
    text = meta.row_group(1).column(1)
    assert text.path_in_schema == "text"
    start = text.dictionary_page_offset or text.data_page_offset
    raw = bytearray(victim.read_bytes())
    raw[start:start + text.total_compressed_size] = b"\xa5" * text.total_compressed_size
    victim.write_bytes(bytes(raw))

    shards = plan_shards(resolve_sources(hub_cfg(repo)), 15)
    assert sum(s.stop - s.start for s in shards) == 143
    first = [s for s in shards if s.label == victim.name]
    assert read_shard(first[0])[0].text == pq.read_table(hub_repo / TRAIN_FILES[0][0]).column("text")[0].as_py()
    with pytest.raises(CorpusError, match=f"{victim.name}: cannot read rows 15-30") as err:
        read_shard(first[1])  # rows 15-30 span row groups 0 and 1
    assert "\n" not in str(err.value)


class CountingFile:
    """A local file that counts the bytes read through it (test instrumentation, no mock of data)."""

    def __init__(self, path, counter):
        self._f, self._counter = open(path, "rb"), counter

    def read(self, n=-1):
        data = self._f.read(n)
        self._counter["bytes"] += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self._f, name)


class CountingHandler(pafs.FSSpecHandler):
    def __init__(self, counter):
        import fsspec

        super().__init__(fsspec.filesystem("file"))
        self.counter = counter

    def open_input_file(self, path):
        return pa.PythonFile(CountingFile(path, self.counter), mode="r")


def test_a_shard_reads_the_footer_and_its_row_groups_text_column_only(tmp_path, monkeypatch):
    """Four row groups of 60 rows; the url/metadata columns are incompressible and larger than the
    text. A shard inside group 1 may read the footer (Arrow reads the last 64 KiB at once) and the
    text chunk of group 1, nothing more: reading every group or every column goes over."""
    import random

    rng = random.Random(0)
    n, group = 240, 60
    path = tmp_path / "train-00000-of-00001-big.parquet"
    noise = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(3000)) for _ in range(n)]
    texts = [f"document {i} " + "".join(rng.choice("ab ") for _ in range(400)) for i in range(n)]
    pq.write_table(pa.table({"url": noise, "text": texts, "metadata": noise[::-1]}), path, row_group_size=group,
                   compression="zstd")
    meta = pq.ParquetFile(path).metadata
    text_chunk = [meta.row_group(g).column(1).total_compressed_size for g in range(4)]
    assert meta.row_group(1).column(0).total_compressed_size > 8 * text_chunk[1]  # far apart on disk
    footer_window = min(64 * 1024, path.stat().st_size)

    counter = {"bytes": 0}
    counting = pafs.PyFileSystem(CountingHandler(counter))
    for module in (sources_mod, shards_mod):  # the footer, then the shard's rows
        monkeypatch.setattr(module, "open_location", lambda location: (counting, str(location)))
    spec = plan_shards([sources_mod.describe_file(str(path), "text")], 30)[2]  # rows 60-90: group 1
    counter["bytes"] = 0
    docs = read_shard(spec)
    assert [d.text for d in docs] == texts[60:90]
    assert 0 < counter["bytes"] <= footer_window + text_chunk[1] + 4096, (counter, text_chunk, footer_window)
    assert counter["bytes"] < path.stat().st_size / 4


def test_doc_ids_rows_and_identity_equal_the_files_source_for_the_same_files(hub_repo):
    hub = hub_cfg(hub_repo)
    files = CorpusConfig(name="owm", source="files", files=[str(hub_repo / "data" / "train-*.parquet")],
                         rows_per_shard=15)
    hub_sources, file_sources = resolve_sources(hub), resolve_sources(files)
    hub_plan, file_plan = plan_shards(hub_sources, 15), plan_shards(file_sources, 15)
    assert [(s.label, s.start, s.stop) for s in hub_plan] == [(s.label, s.start, s.stop) for s in file_plan]
    assert read_plan(hub_plan) == read_plan(file_plan)
    digests = [hashlib.sha256((hub_repo / n).read_bytes()).hexdigest() for n, _, _ in TRAIN_FILES]
    listing = [[Path(n).name, rows, (hub_repo / n).stat().st_size, d] for (n, rows, _), d in zip(TRAIN_FILES, digests)]
    expected = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    assert corpus_identity(hub, hub_sources, hub_plan)["files_sha256"] == expected
    assert corpus_identity(files, file_sources, file_plan)["files_sha256"] == expected


def test_split_config_patterns_and_limit_docs_choose_the_files(hub_repo, tmp_path):
    listing = folder_listing(str(hub_repo))
    assert [f.path for f in listing] == ["README.md", *sorted(n for n, _, _ in [*TRAIN_FILES, TEST_FILE])]
    assert [f.path for f in select_repo_files(listing, "test", None)] == [TEST_FILE[0]]
    picked = select_repo_files(listing, "train", None, ["data/train-0000[02]-*.parquet"])
    assert [f.path for f in picked] == [TRAIN_FILES[0][0], TRAIN_FILES[2][0]]
    converted = [RepoFile("default/train/0000.parquet", 1), RepoFile("default/test/0000.parquet", 1),
                 RepoFile("other/train/0000.parquet", 1), RepoFile("default/train/notes.txt", 1)]
    assert [f.path for f in select_repo_files(converted, "train", "default")] == ["default/train/0000.parquet"]
    assert [f.path for f in select_repo_files(converted, "train", None)] == ["default/train/0000.parquet",
                                                                             "other/train/0000.parquet"]
    with pytest.raises(CorpusError, match="no Parquet file in .* for split 'validation'.*README.md"):
        resolve_sources(hub_cfg(hub_repo, split="validation"))

    # limit_docs: the files after the first 80 rows are neither opened nor hashed
    repo = tmp_path / "repo"
    shutil.copytree(hub_repo, repo)
    (repo / TRAIN_FILES[2][0]).write_bytes(b"PAR1 not parquet at all")
    sources = resolve_sources(hub_cfg(repo, limit_docs=80))
    assert [s.rows for s in sources] == [70, 40]
    assert sum(s.stop - s.start for s in plan_shards(sources, 15, 80)) == 80
    with pytest.raises(CorpusError, match=f"{TRAIN_FILES[2][0]}: not a readable Parquet file"):
        resolve_sources(hub_cfg(repo))


class StandInHubApi:
    """Answers like ``huggingface_hub.HfApi`` for one dataset (no network here): the commit a
    revision points at, and the tree as huggingface_hub parses the hub's JSON. Records the calls."""

    def __init__(self, root: Path, commit: str):
        from huggingface_hub.hf_api import RepoFile as HubRepoFile, RepoFolder

        self.commit, self.calls, self.entries = commit, [], [RepoFolder(path="data", oid="f" * 40)]
        for path in sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()):
            data = (root / path).read_bytes()
            lfs = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            self.entries.append(HubRepoFile(path=path, size=len(data), oid="0" * 40,
                                            **({"lfs": lfs} if path.endswith(".parquet") else {})))

    def dataset_info(self, repo_id, revision=None):
        self.calls.append(("dataset_info", repo_id, revision))
        return type("Info", (), {"sha": self.commit})()

    def list_repo_tree(self, repo_id, repo_type=None, revision=None, recursive=False):
        self.calls.append(("list_repo_tree", repo_id, repo_type, revision, recursive))
        return iter(self.entries)


def test_hub_listing_pins_the_commit_and_takes_the_hubs_sha256(hub_repo):
    api = StandInHubApi(hub_repo, commit="c0ffee" * 6 + "abcd")
    commit, files = hub_listing("open-web-math/open-web-math", "v1", api)
    assert commit == api.commit
    assert api.calls == [("dataset_info", "open-web-math/open-web-math", "v1"),
                         ("list_repo_tree", "open-web-math/open-web-math", "dataset", api.commit, True)]
    chosen = select_repo_files(files, "train", None)
    assert [f.path for f in chosen] == [n for n, _, _ in TRAIN_FILES]
    assert [f.sha256 for f in chosen] == [hashlib.sha256((hub_repo / n).read_bytes()).hexdigest() for n, _, _ in TRAIN_FILES]
    locations = sources_mod._hub_locations(CorpusConfig(source="hub", hub_id="open-web-math/open-web-math",
                                                        revision="v1"), api)
    assert [loc for loc, _ in locations] == [f"hf://datasets/open-web-math/open-web-math@{api.commit}/{n}"
                                              for n, _, _ in TRAIN_FILES]


class StandInHub:
    """A stand-in for the hub's HTTP API on 127.0.0.1 (no network here), serving one dataset
    repository from a folder at one commit: the revision, tree and resolve endpoints (the last with
    Range requests) that huggingface_hub's real ``HfApi`` and ``HfFileSystem`` call. Counts the
    bytes it sends per file."""

    def __init__(self, root: Path, repo_id: str, commit: str):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from threading import Thread
        from urllib.parse import unquote, urlparse

        hub, self.root, self.repo_id, self.commit, self.sent = self, root, repo_id, commit, {}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body=b"", headers=()):
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                url = urlparse(self.path)
                api, files = f"/api/datasets/{repo_id}/", f"/datasets/{repo_id}/resolve/"
                if url.path == api.rstrip("/"):  # no revision: main
                    return self.reply(200, json.dumps({"id": repo_id, "sha": commit, "private": False}).encode())
                if url.path.startswith(api + "revision/"):
                    if unquote(url.path[len(api + "revision/"):]) not in ("main", commit):
                        return self.reply(404, b"{}", [("X-Error-Code", "RevisionNotFound")])
                    return self.reply(200, json.dumps({"id": repo_id, "sha": commit, "private": False}).encode())
                if url.path.startswith(api + "tree/"):
                    rev, _, sub = url.path[len(api + "tree/"):].partition("/")
                    assert unquote(rev) == commit, "every request after the listing names the commit"
                    return self.reply(200, json.dumps(hub.tree(unquote(sub), "recursive=true" in url.query.lower())).encode())
                if url.path.startswith(files):
                    rev, _, rel = url.path[len(files):].partition("/")
                    assert unquote(rev) == commit
                    data = (root / unquote(rel)).read_bytes()
                    first, last = 0, len(data) - 1
                    if self.headers.get("Range"):
                        first, last = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
                    body = data[first:last + 1]
                    if self.command == "GET":
                        hub.sent[unquote(rel)] = hub.sent.get(unquote(rel), 0) + len(body)
                    return self.reply(206 if self.headers.get("Range") else 200, body,
                                      [("Content-Range", f"bytes {first}-{last}/{len(data)}"), ("ETag", '"x"'),
                                       ("X-Repo-Commit", commit)])
                self.reply(404, b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        Thread(target=self.server.serve_forever, daemon=True).start()

    def tree(self, sub: str, recursive: bool) -> list[dict]:
        base = self.root / sub if sub else self.root
        entries = []
        for p in sorted(base.rglob("*") if recursive else base.iterdir()):
            rel = p.relative_to(self.root).as_posix()
            if p.is_dir():
                entries.append({"type": "directory", "path": rel, "oid": "d" * 40, "size": 0})
            else:
                data = p.read_bytes()
                entry = {"type": "file", "path": rel, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                if rel.endswith(".parquet"):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
        return entries


def test_the_real_hub_client_reads_the_plan_and_rows_over_http(hub_repo, monkeypatch):
    """huggingface_hub's HfApi and HfFileSystem against :class:`StandInHub`: the listing is pinned
    to the commit, footers and rows come over HTTP range requests, rows and identity equal the
    local copy's, and one shard's read fetches a small part of its file."""
    from huggingface_hub import HfApi, HfFileSystem, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub = StandInHub(hub_repo, "open-web-math/open-web-math", commit="5e1f" * 10)
    try:
        monkeypatch.setattr(corpus_mod, "_hf_filesystem",
                            lambda: pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem(endpoint=hub.endpoint))))
        cfg = CorpusConfig(name="owm", source="hub", hub_id="open-web-math/open-web-math", rows_per_shard=15)
        sources = resolve_sources(cfg, hub_api=HfApi(endpoint=hub.endpoint))
        assert [s.path for s in sources] == [f"hf://datasets/open-web-math/open-web-math@{hub.commit}/{n}"
                                             for n, _, _ in TRAIN_FILES]
        assert [s.row_groups for s in sources] == [(25, 25, 20), (40,), (10, 10, 10, 3)]
        plan = plan_shards(sources, 15)
        local = resolve_sources(hub_cfg(hub_repo))
        assert [(s.label, s.start, s.stop) for s in plan] == [(s.label, s.start, s.stop) for s in plan_shards(local, 15)]
        assert read_plan(plan) == all_texts([hub_repo / n for n, _, _ in TRAIN_FILES])
        assert corpus_identity(cfg, sources, plan)["files_sha256"] == corpus_identity(
            hub_cfg(hub_repo), local, plan_shards(local, 15))["files_sha256"]
    finally:
        hub.server.shutdown()


def test_hub_unreachable_gives_one_line_naming_the_dataset_and_hub_root(monkeypatch):
    """The real HfApi with the hub unreachable (HF_HUB_OFFLINE=1, as in every test here)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CorpusError) as err:
        resolve_sources(CorpusConfig(name="owm", source="hub", hub_id="open-web-math/open-web-math"))
    message = str(err.value)
    assert message.startswith("cannot list the hub dataset open-web-math/open-web-math@main (") and "\n" not in message
    assert "data.hub_root" in message


def test_config_problems_for_hub_fields():
    assert CorpusConfig(source="hub").problems() == [
        "hub_id: source=hub needs the dataset's hub id (also with hub_root, which only says where a copy is)"]
    assert "files: with source=hub these are patterns" in CorpusConfig(source="hub", hub_id="a/b",
                                                                       files=["s3://b/x.parquet"]).problems()[0]
    assert CorpusConfig(files=["x.parquet"], hub_root="/r").problems() == ["hub_root: only used with source=hub"]


def test_the_open_web_math_config_reads_a_copy_of_the_repository(hub_repo):
    """``data=open-web-math`` composed as a user writes it: hub patterns stay relative to the
    repository (local ``files`` become absolute), and a missing hub_root is a config problem."""
    from hydra import compose, initialize_config_dir

    from stages.common import ConfigError
    from stages.score_teacher import job_config

    conf = Path(__file__).resolve().parents[2] / "conf"

    def job(*overrides):
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return job_config(compose(config_name="score_teacher", overrides=["data=open-web-math", *overrides]))

    cfg = job(f"data.hub_root={hub_repo}", 'data.files=["data/train-0000[01]-*.parquet"]', "data.rows_per_shard=15")
    assert cfg.corpus.files == ["data/train-0000[01]-*.parquet"] and cfg.corpus.hub_id == "open-web-math/open-web-math"
    assert [s.path for s in resolve_sources(cfg.corpus)] == [str(hub_repo / n) for n, _, _ in TRAIN_FILES[:2]]
    local = job("data.source=files", f"data.files=[{os.path.relpath(hub_repo)}/data/train-*.parquet]")
    assert local.corpus.files == [str(hub_repo / "data" / "train-*.parquet")]
    with pytest.raises(ConfigError) as err:
        job(f"data.hub_root={hub_repo}/no-such-copy")
    assert f"data.hub_root: hub_root {hub_repo}/no-such-copy: cannot list it (" in str(err.value)


# ---------------------------------------------------------------------------------------------
# Files on S3


def upload(folder: Path, bucket: str, prefix: str) -> str:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            sfs.write_bytes(f"{bucket}/{prefix}/{p.relative_to(folder).as_posix()}", p.read_bytes())
    return f"{bucket}/{prefix}"


def test_a_corpus_on_s3_plans_reads_and_is_identified_like_its_local_copy(hub_repo, s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("VOCAGNO_CACHE", str(tmp_path / "cache"))
    remote = upload(hub_repo, s3_server(), "open-web-math")
    local_cfg = CorpusConfig(name="owm", files=[str(hub_repo / "data" / "train-*.parquet")], rows_per_shard=15)
    for cfg in (replace(local_cfg, files=[f"{remote}/data/train-*.parquet"]), hub_cfg(remote)):
        sources = resolve_sources(cfg)
        assert [s.path for s in sources] == [f"{remote}/{n}" for n, _, _ in TRAIN_FILES]
        assert [s.row_groups for s in sources] == [(25, 25, 20), (40,), (10, 10, 10, 3)]
        plan = plan_shards(sources, 15)
        local_sources = resolve_sources(local_cfg)
        local_plan = plan_shards(local_sources, 15)
        assert [(s.label, s.start, s.stop, s.kind) for s in plan] == [(s.label, s.start, s.stop, s.kind) for s in local_plan]
        assert read_plan(plan) == read_plan(local_plan) == all_texts([hub_repo / n for n, _, _ in TRAIN_FILES])
        ident = corpus_identity(cfg, sources, plan)
        assert ident["files_sha256"] == corpus_identity(local_cfg, local_sources, local_plan)["files_sha256"]


def test_remote_row_groups_much_larger_than_a_shard_are_warned_about(hub_repo, s3_server, caplog):
    """Row groups of 40 rows and shards of 15: each remote row group would be fetched by three
    shards. Local files are not warned about (a re-read comes from the page cache)."""
    remote = upload(hub_repo / "data", s3_server(), "d")

    def warnings():
        return [r.getMessage() for r in caplog.records if r.name == sources_mod.__name__]

    with caplog.at_level("WARNING", logger=sources_mod.__name__):
        resolve_sources(CorpusConfig(files=[str(hub_repo / "data" / "train-*.parquet")], rows_per_shard=15))
        assert not warnings()
        resolve_sources(CorpusConfig(files=[f"{remote}/train-*.parquet"], rows_per_shard=20))  # 40 = 2 x 20: fine
        assert not warnings()
        resolve_sources(CorpusConfig(files=[f"{remote}/train-*.parquet"], rows_per_shard=15))
    assert warnings() == [
        "Parquet row groups of up to 40 rows and shards of 15 rows: a row group is read by up to 4 shards; "
        "a rows_per_shard near the row group size reads each byte once"]


def test_s3_errors_are_one_line_naming_the_object_or_pattern(s3_server, hub_repo, tmp_path):
    bucket = s3_server()
    sfs.write_bytes(f"{bucket}/bad/train-00000-of-00001.parquet", b"PAR1 this is not parquet")
    sfs.write_bytes(f"{bucket}/good/train-00000-of-00001.parquet", (hub_repo / TRAIN_FILES[1][0]).read_bytes())
    cases = [
        ([f"{bucket}/bad/*.parquet"], f"{bucket}/bad/train-00000-of-00001.parquet: not a readable Parquet file ("),
        ([f"{bucket}/none/*.parquet"], f"corpus 'c': no file matches '{bucket}/none/*.parquet'"),
        ([f"{bucket}/good/missing.parquet"], f"corpus 'c': no file matches '{bucket}/good/missing.parquet'"),
        ([f"{bucket}/good/*.parquet", "s3://no-such-bucket-here/x/*.parquet"], "'s3://no-such-bucket-here/x/*.parquet'"),
    ]
    for files, expected in cases:
        with pytest.raises(CorpusError) as err:
            resolve_sources(CorpusConfig(name="c", files=files))
        assert expected in str(err.value) and "\n" not in str(err.value), (files, str(err.value))
    # an object replaced by a shorter one after planning: its shard fails by name, it does not come back short
    spec = plan_shards(resolve_sources(CorpusConfig(name="c", files=[f"{bucket}/good/*.parquet"])), 15)[2]
    pq.write_table(owm_table("short", 30), tmp_path / "short.parquet")
    sfs.write_bytes(spec.path, (tmp_path / "short.parquet").read_bytes())
    with pytest.raises(CorpusError, match=f"{spec.path}: rows 30-40 planned, 0 found"):
        read_shard(spec)


def test_jsonl_on_s3_reads_like_the_local_file(s3_server, tmp_path):
    lines = [json.dumps({"text": f"line {i} ∫ {'é' * i}"}) for i in range(9)]
    lines[4] = "not json"
    local = tmp_path / "web.jsonl"
    local.write_text("\n".join(lines))  # no newline after the last line
    remote = f"{s3_server()}/corpus/web.jsonl"
    sfs.write_bytes(remote, local.read_bytes())
    plans = [plan_shards(resolve_sources(CorpusConfig(files=[f], rows_per_shard=4)), 4) for f in (str(local), remote)]
    assert [(s.start, s.stop) for s in plans[0]] == [(s.start, s.stop) for s in plans[1]] == [(0, 4), (4, 8), (8, 9)]
    docs = [[(d.doc_id, d.text, d.problem) for s in plan for d in read_shard(s)] for plan in plans]
    assert docs[0] == docs[1]
    assert [d[0] for d in docs[1]] == [f"web.jsonl:{i}" for i in range(9)]
    assert docs[1][8][1] == "line 8 ∫ " + "é" * 8 and docs[1][4][2].startswith("invalid_json")


def test_s3_digest_follows_the_objects_content(s3_server, tmp_path, monkeypatch):
    """Cached by URI, size and ETag: an object rewritten with the same size gets its new digest."""
    monkeypatch.setenv("VOCAGNO_CACHE", str(tmp_path / "cache"))
    uri = f"{s3_server()}/c/train.parquet"
    for payload in (b"A" * 1000, b"B" * 1000):
        sfs.write_bytes(uri, payload)
        assert shards_mod.remote_sha256_cached(uri) == hashlib.sha256(payload).hexdigest()
        assert shards_mod.remote_sha256_cached(uri) == hashlib.sha256(payload).hexdigest()  # from the cache
    assert len(list((tmp_path / "cache").rglob("remote-*.json"))) == 2


# ---------------------------------------------------------------------------------------------
# The job end to end (real Ray), without datasets.load_dataset


@pytest.fixture
def ray_reaching_s3(s3_server, ray_local):
    """The session's Ray, with workers that see the S3 server's variables: a Ray started before
    the S3 fixture is restarted once (its workers inherited the environment of that time)."""
    import ray

    @ray.remote(num_cpus=0)
    def endpoint():
        return os.environ.get("AWS_ENDPOINT_URL")

    if ray.get(endpoint.remote()) != os.environ["AWS_ENDPOINT_URL"]:
        ray.shutdown()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return s3_server


def scored_rows(folder) -> list[tuple]:
    """(doc id, text, losses as float32 bytes: NaN compares equal to NaN) of every row, in order."""
    import numpy as np

    rows = []
    for shard in sorted(Path(folder).glob("shard-*.parquet")):
        table = pq.read_table(shard, columns=["doc_id", "text", "losses"])
        for doc_id, text, losses in zip(*(table.column(c).to_pylist() for c in ("doc_id", "text", "losses"))):
            rows.append((doc_id, text, np.asarray(losses, np.float32).tobytes()))
    return rows


def test_score_job_from_a_hub_mirror_on_s3_never_loads_the_dataset(micro_teacher, micro_corpus, micro_scored,
                                                                      ray_reaching_s3, tmp_path, monkeypatch):
    """The micro corpus as a hub repository copied to a bucket (hub_root): the job's actors read
    their rows from S3, the rows equal the files-source dataset's (same doc ids, same losses), and
    neither datasets nor the hub API is asked for anything."""
    import datasets
    from huggingface_hub import HfApi

    from pipeline.score_teacher.backends.base import ScorerConfig
    from pipeline.score_teacher.pool import PoolConfig
    from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
    from pipeline.score_teacher.job import run_score_job

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus must not go through datasets or the hub API")

    for name in ("load_dataset", "load_dataset_builder"):
        monkeypatch.setattr(datasets, name, refuse)
    for name in ("dataset_info", "list_repo_tree", "get_paths_info"):
        monkeypatch.setattr(HfApi, name, refuse)

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    for f in micro_corpus:
        shutil.copy(f, repo / "data" / f.name)
    mirror = upload(repo, ray_reaching_s3(), "open-web-math")
    out = tmp_path / "scored"
    summary = run_score_job(ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(micro_teacher)),
        corpus=CorpusConfig(name="owm-micro", source="hub", hub_id="open-web-math/open-web-math", hub_root=mirror,
                            rows_per_shard=40),
        scorer=ScorerConfig(max_batch_tokens=2048), output_dir=str(out),
        pool=PoolConfig(num_actors=2, num_cpus=1), progress=False))
    assert summary.complete and summary.shards_planned == 4
    rows, expected = scored_rows(out), scored_rows(micro_scored)
    assert [r[:2] for r in rows] == [r[:2] for r in expected]
    assert rows == expected
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["location"]["corpus_files"] == [f"{mirror}/data/{f.name}" for f in micro_corpus]
    assert manifest["identity"]["corpus"]["source"] == "hub"
