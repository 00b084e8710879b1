"""Bytes on disk per teacher token, all columns and the Parquet footer included.

The rows of a real scored dataset (stage-1 output the bench makes itself: the embedded tiny
teacher's scoring of sample documents with float32 losses, which come from a trained model and so
have a realistic spread) are written again, shard by shard, with each storage setting:

* the settings the pipeline offers, through :func:`pipeline.score_teacher.writer.write_shard` itself
  (``StorageConfig``: ``default``, ``compact`` encodings, ``bfloat16``/``float16`` loss rounding,
  zstd levels); the encodings actually found in each file are recorded, since pyarrow silently
  ignores an encoding addressed to a name that is not a leaf column;
* for information, files holding only ``doc_id``, ``text`` and ``losses``: the token ids and
  offsets can be recomputed from the text with the teacher's tokenizer (its sha256 is in the
  manifest). That changes the data contract, so it is measured, not proposed as a default.

Per column, the compressed bytes come from the Parquet metadata; ``footer`` is the rest of the
file (schema, key-value metadata with the dataset identity, page indexes).

The object-store path's cost: the same shards written through ``write_shard`` (with their markers
and the manifest) and read back through the one reader (footers, then every row group), once into
a local folder and once into ``s3://`` on moto's S3 server on 127.0.0.1, alternately in one run;
reported as the ratio of the times. Moto on loopback measures the protocol's overhead (HTTP
requests, encoding into memory before the PUT, a file system per request), not a real store's
latency or bandwidth.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.results import figure
from pipeline.runtime.config import check_at_least
from storage_schemas import filesystem as sfs

ZSTD_LEVELS = range(1, 23)


@dataclass(frozen=True)
class StorageBenchConfig:
    max_shards: int = 4
    levels: list[int] = field(default_factory=lambda: [3, 19])  # extra zstd levels tried with compact + bfloat16 (besides the default)
    target: float = 3.0
    object_store_repeats: int = 3  # write+read rounds on each side for the object-store ratio (median)

    def problems(self) -> list[str]:
        problems: list[str] = []
        check_at_least(problems, "max_shards", self.max_shards, 1)
        check_at_least(problems, "object_store_repeats", self.object_store_repeats, 1)
        problems += [f"levels: {level} is not a zstd level (1-22)" for level in self.levels if level not in ZSTD_LEVELS]
        return problems


def run(cfg: StorageBenchConfig, work_dir: str | os.PathLike, dataset: str | os.PathLike) -> dict:
    """``dataset``: a complete stage-1 output folder (local or an object-store URI)."""
    import pyarrow.parquet as pq

    from pipeline.score_teacher.writer import StorageConfig
    from storage_schemas import read_manifest

    folder = sfs.location(dataset)
    manifest = read_manifest(folder)
    entries = manifest["shards"][: cfg.max_shards]
    if not entries:
        raise ValueError(f"{folder}: the manifest lists no finished shard")
    shards = [(e, _documents(pq.read_table(str(sfs.child(folder, e["file"]))))) for e in entries]
    tokens = sum(int(sum(len(d.ids) for d in docs)) for _, docs in shards)
    out_root = Path(work_dir) / "storage"
    shutil.rmtree(out_root, ignore_errors=True)

    settings: list[dict] = []
    current = [
        ("plain float32", StorageConfig(encodings="default", loss_precision="float32")),
        ("plain + bfloat16 losses", StorageConfig(encodings="default", loss_precision="bfloat16")),
        ("compact", StorageConfig(encodings="compact", loss_precision="float32")),
        ("compact + bfloat16 losses", StorageConfig(encodings="compact", loss_precision="bfloat16")),
        ("compact + float16 losses", StorageConfig(encodings="compact", loss_precision="float16")),
    ]
    current += [(f"compact + bfloat16 losses, zstd level {level}",
                 StorageConfig(encodings="compact", loss_precision="bfloat16", compression_level=level))
                for level in cfg.levels]
    for name, storage in current:
        settings.append(_write_current(name, storage, shards, manifest, out_root, tokens))
    for losses in ("float16", "bfloat16"):
        settings.append(_write_without_recomputable(losses, shards, out_root, tokens))
    shutil.rmtree(out_root, ignore_errors=True)

    by_name = {s["name"]: s for s in settings}
    # The figure: the best compact setting at the pipeline's own compression level (the level sweep
    # is listed beside it, with its write time).
    compact = [s for s in settings
               if s["kind"] == "current" and s["name"].startswith("compact") and s["level"] is None]
    best = min(compact, key=lambda s: s["bytes_per_token"])
    result = {
        "dataset": str(folder), "teacher": manifest["identity"]["teacher"].get("name"),
        "loss_precision_of_source": manifest["identity"].get("loss_precision", "float32"),
        "shards": len(shards), "documents": sum(len(d) for _, d in shards), "tokens": tokens,
        "settings": settings,
    }
    default = by_name["plain float32"]
    others = "; ".join(f"{s['name']}: {s['bytes_per_token']:.2f} (write {s['write_s']:.1f} s)"
                       for s in settings if s is not best and s is not default)
    result["object_store"] = object_store_cost(shards, manifest, out_root, cfg.object_store_repeats)
    shutil.rmtree(out_root, ignore_errors=True)
    result["figures"] = [
        figure("storage_default", "storage, plain float32 (bytes/teacher token)", default["bytes_per_token"], unit="B",
               note=_columns_note(default, tokens, result) + f"; write {default['write_s']:.1f} s"),
        figure("storage_compact", "storage, compact (best compact setting, default zstd level)", best["bytes_per_token"],
               cfg.target, "<=", unit="B",
               note=f"{best['name']}: " + _columns_note(best, tokens, result) + "; encodings in the file: "
               + ", ".join(f"{k} {v}" for k, v in best["encodings"].items()) + f"; write {best['write_s']:.1f} s. "
               + f"Other settings: {others}"),
        *_object_store_figures(result["object_store"]),
    ]
    return result


def _columns_note(s: dict, tokens: int, r: dict) -> str:
    cols = ", ".join(f"{k} {v:.2f}" for k, v in s["columns_bytes_per_token"].items())
    return f"{r['documents']} docs / {tokens:,} tokens of {r['teacher']} teacher output; per column: {cols}"


def _documents(table) -> list:
    """The rows of a shard as :class:`pipeline.score_teacher.teacher.ScoredDocument` (NumPy slices, no copies)."""
    from pipeline.score_teacher.teacher import ScoredDocument
    from storage_schemas.reader import list_column_values

    table = table.combine_chunks()
    views = {c: list_column_values(table, c) for c in ("token_ids", "starts", "ends", "losses")}
    offsets = views["starts"][1]
    doc_ids, texts = table.column("doc_id").to_pylist(), table.column("text").to_pylist()
    return [
        ScoredDocument(doc_id, text, *(views[c][0][offsets[k] : offsets[k + 1]]
                                       for c in ("token_ids", "starts", "ends", "losses")))
        for k, (doc_id, text) in enumerate(zip(doc_ids, texts))
    ]


def _column_sizes(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    sizes: dict[str, int] = {}
    encodings: dict[str, str] = {}
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            chunk = meta.row_group(g).column(c)
            name = chunk.path_in_schema.split(".")[0]
            sizes[name] = sizes.get(name, 0) + chunk.total_compressed_size
            encodings[name] = "/".join(e for e in chunk.encodings if e not in ("RLE", "BIT_PACKED"))
    return sizes, encodings


def _record(name: str, kind: str, paths: list[Path], tokens: int, seconds: float, level=None) -> dict:
    total = sum(p.stat().st_size for p in paths)
    columns: dict[str, int] = {}
    encodings: dict[str, str] = {}
    for p in paths:
        sizes, enc = _column_sizes(p)
        for k, v in sizes.items():
            columns[k] = columns.get(k, 0) + v
        encodings.update(enc)
    columns["footer"] = total - sum(columns.values())
    return {"name": name, "kind": kind, "level": level, "bytes": total, "bytes_per_token": total / tokens,
            "columns_bytes_per_token": {k: v / tokens for k, v in columns.items()}, "encodings": encodings,
            "write_s": seconds}


def _write_current(name, storage, shards, manifest, out_root: Path, tokens: int) -> dict:
    from pipeline.folders.provenance import code_version
    from pipeline.score_teacher.teacher import ShardResult
    from pipeline.score_teacher.writer import write_shard

    folder = out_root / name.replace(" ", "_").replace("+", "")
    folder.mkdir(parents=True)
    identity = {**manifest["identity"], "loss_precision": storage.loss_precision}
    t0 = time.perf_counter()
    paths = []
    for entry, docs in shards:
        written = write_shard(folder, entry["index"], ShardResult(documents=docs), identity, entry.get("source", {}),
                              code_version(), storage=storage)
        paths.append(folder / written["file"])
    return _record(name, "current", paths, tokens, time.perf_counter() - t0, storage.compression_level)


def _write_without_recomputable(losses: str, shards, out_root: Path, tokens: int) -> dict:
    """``doc_id``, ``text``, ``losses`` only: ids and offsets recomputed from text when read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.score_teacher.writer import round_losses

    folder = out_root / f"text-losses-{losses}"
    folder.mkdir(parents=True)
    paths, seconds = [], 0.0
    for entry, docs in shards:
        lengths = np.fromiter((len(d.losses) for d in docs), dtype=np.int64, count=len(docs))
        offsets = np.zeros(len(docs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate([d.losses for d in docs]) if docs else np.zeros(0, np.float32)
        if losses == "float16":
            array = pa.array(values.astype(np.float16), pa.float16())
            options = dict(use_dictionary=["doc_id"])
        else:
            array = pa.array(round_losses(values, "bfloat16"), pa.float32())
            options = dict(use_dictionary=["doc_id"], column_encoding={"losses.list.element": "BYTE_STREAM_SPLIT"})
        table = pa.table({"doc_id": [d.doc_id for d in docs], "text": [d.text for d in docs],
                          "losses": pa.ListArray.from_arrays(pa.array(offsets), array)})
        path = folder / entry["file"]
        t0 = time.perf_counter()
        pq.write_table(table, path, compression="zstd", row_group_size=1024, **options)
        seconds += time.perf_counter() - t0
        paths.append(path)
    label = "float16 stored as float16" if losses == "float16" else "bfloat16-rounded float32, byte-stream-split"
    return _record(f"doc_id + text + losses only ({label}; schema change)", "schema change", paths, tokens, seconds)


def object_store_cost(shards, manifest: dict, out_root: Path, repeats: int) -> dict:
    """Seconds to write the shard set (shards, markers, manifest) and to read it back (open with
    the reader, decode every row group), locally and on moto's S3 server, alternating the sides so
    the machine's load falls on both; medians over ``repeats`` rounds."""
    try:
        import moto.server  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"moto is not installed ({exc}); pip install 'moto[server]'"}
    import statistics

    from local_s3 import local_s3_server

    with local_s3_server("bench") as make_bucket:
        bucket = make_bucket("bench")
        times: dict[str, dict[str, list[float]]] = {"local": {"write": [], "read": []}, "s3": {"write": [], "read": []}}
        for r in range(max(1, repeats)):
            for side in ("local", "s3"):
                folder = f"{bucket}/round-{r}" if side == "s3" else out_root / "object-store" / f"round-{r}"
                write_s, read_s, rows = _write_and_read(folder, shards, manifest)
                times[side]["write"].append(write_s)
                times[side]["read"].append(read_s)
    median = {side: {op: statistics.median(v) for op, v in ops.items()} for side, ops in times.items()}
    return {"rounds": max(1, repeats), "rows": rows, "seconds": times, "median_s": median,
            "write_ratio": median["s3"]["write"] / median["local"]["write"],
            "read_ratio": median["s3"]["read"] / median["local"]["read"]}


def _write_and_read(folder, shards, manifest: dict) -> tuple[float, float, int]:
    from pipeline.folders.provenance import code_version
    from pipeline.score_teacher.teacher import ShardResult
    from pipeline.score_teacher.writer import write_manifest, write_shard
    from storage_schemas.reader import open_scored_dataset, read_row_group

    if isinstance(folder, Path):
        folder.mkdir(parents=True)
    identity = {**manifest["identity"], "corpus": {**manifest["identity"]["corpus"], "n_shards": len(shards)}}
    version = code_version()
    t0 = time.perf_counter()
    done = {}
    for entry, docs in shards:
        done[entry["index"]] = write_shard(folder, entry["index"], ShardResult(documents=docs), identity,
                                           entry.get("source", {}), version)
    write_manifest(folder, identity, done, n_planned=len(done))
    t1 = time.perf_counter()
    dataset = open_scored_dataset([folder], allow_partial=True)
    rows = sum(read_row_group(s, g).num_rows for s in dataset.shards for g in range(len(s.row_group_rows)))
    return t1 - t0, time.perf_counter() - t1, rows


def _object_store_figures(cost: dict) -> list[dict]:
    if "skipped" in cost:
        return [figure("object_store_write", "object store vs local disk, write (time ratio)", None, note=cost["skipped"])]
    m = cost["median_s"]
    note = (f"moto's S3 server on 127.0.0.1 vs the local disk, same {cost['rows']} rows, median of {cost['rounds']} "
            "alternating rounds; {op}: s3 {s3:.3f} s, local {local:.3f} s. Loopback moto measures the protocol's "
            "overhead, not a real store's latency")
    return [figure(f"object_store_{op}", f"object store vs local disk, {op} (time ratio)", cost[f"{op}_ratio"], unit="x",
                   note=note.format(op=op, s3=m["s3"][op], local=m["local"][op])) for op in ("write", "read")]


def describe_settings(result: dict) -> str:
    return json.dumps([{k: s[k] for k in ("name", "bytes_per_token")} for s in result["settings"]], indent=1)
