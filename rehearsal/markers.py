"""A scored folder of as many shards as all of OpenWebMath makes (25,000 by default), each a real
one-document shard with its real marker, for the code whose cost grows with the number of shards
rather than with the tokens: resume planning, the manifest, the markers' validation, opening the
folder for training. A rehearsal fraction has too few shards to show it.

``python -m rehearsal.markers <operation> <json>`` runs one operation in its own process, measured
from the runner (:func:`run_markers`); ``build`` makes the folder (cached by its size).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq



def identity(n: int) -> dict:
    """A stage-1 identity as the rehearsal teacher writes one, for ``n`` planned shards."""
    return {"format": 2, "teacher": {"name": "rehearsal-qwen2.5", "source": "rehearsal", "model": None, "revision": None,
                                     "rehearsal": {"version": 1, "seed": 0, "knots": 65}, "tokenizer_sha256": "0" * 64,
                                     "vocab_size": 151_646, "bos_id": None, "dtype": "float32", "backend": "rehearsal"},
            "windows": {"window": 4096, "stride": 2048, "min_left_context": 2048}, "loss_precision": "bfloat16",
            "corpus": {"name": f"markers-{n}", "source": "files", "hub_id": None, "hub_config": None, "split": "train",
                       "revision": None, "text_column": "text", "files_sha256": "0" * 64, "n_files": 114,
                       "rows_per_shard": 250, "limit_docs": None, "n_shards": n, "n_docs": n}}


def build(folder: Path, n: int) -> None:
    """``n`` one-document shards, each with the marker ``write_shard`` would write (as the job's
    actors do: node, try, engine, seconds), and the manifest the job writes at its end; without the
    per-file fsyncs (this is set-up, not measured). The folder's stamp lies beside it."""
    from pipeline.score_teacher.teacher import ScoredDocument
    from pipeline.score_teacher.writer import StorageConfig, _parquet_options, documents_table, finished_shards, write_manifest
    from storage_schemas import marker_of, schema_with_metadata, shard_name

    stamp = folder.with_name(folder.name + ".json")
    manifest = folder / "manifest.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("n") == n and manifest.is_file() and len(
            json.loads(manifest.read_text())["shards"]) == n:
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    ident = identity(n)
    text = "The sum 1 + 2 + 3 = 6."
    losses = np.full(8, 1.5, np.float32)
    losses[0] = np.nan  # no BOS: nothing predicts the first token
    options = _parquet_options(StorageConfig())
    for i in range(n):
        source = {"file": f"train-{i // 222:05d}-of-00114.parquet", "kind": "parquet", "start": (i % 222) * 250,
                  "stop": (i % 222) * 250 + 1, "first_doc_id": f"train-{i // 222:05d}-of-00114.parquet:{(i % 222) * 250}"}
        doc = ScoredDocument(source["first_doc_id"], text, np.arange(8, dtype=np.int32), np.arange(8, dtype=np.int32),
                             np.arange(1, 9, dtype=np.int32), losses)
        table = documents_table([doc], schema_with_metadata(ident, {"index": i, **source}, "0.1.0"))
        name = shard_name(i)
        pq.write_table(table, folder / name, **options)
        data = (folder / name).read_bytes()
        entry = {"file": name, "index": i, "rows": 1, "tokens": 8, "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest(), "source": source, "reasons": {}, "skipped": [],
                 "scored_by": {"node_id": "f" * 56, "node_ip": "10.0.0.1", "hostname": "gpu-node-017", "attempt": 1,
                               "engine": {"name": "vllm", "version": "0.33.0", "device": "cuda"}},
                 "seconds": 1.7}
        (folder / marker_of(name)).write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
    write_manifest(folder, ident, finished_shards(folder), n, "0.1.0", location={"corpus_files": []}, failed=[])
    stamp.write_text(json.dumps({"n": n}))


def op_resume(folder: Path, n: int) -> dict:
    """What a rerun does before Ray starts: check the folder, read every marker, write the manifest."""
    from pipeline.score_teacher.writer import prepare_output

    done, _, _ = prepare_output(folder, identity(n), overwrite=False, location={"corpus_files": []})
    pending = [i for i in range(n) if i not in done]
    return {"done": len(done), "pending": len(pending)}


def op_manifest(folder: Path, n: int) -> dict:
    """One manifest of every shard, as the job writes it as shards finish and at its end."""
    from pipeline.score_teacher.writer import finished_shards, write_manifest

    done = finished_shards(folder)
    t0 = time.perf_counter()
    write_manifest(folder, identity(n), done, n, "0.1.0", location={"corpus_files": []}, failed=[])
    return {"write_s": time.perf_counter() - t0, "manifest_bytes": (folder / "manifest.json").stat().st_size}


def op_progress(folder: Path, n: int) -> dict:
    """The driver's bookkeeping as ``n`` shards finish one by one over a 12-hour job (a simulated
    clock: 12 h / n per shard): the totals it shows and when the manifest is due. The manifest
    writes themselves are counted, not made (``manifest writing`` measures one): their total is
    estimated from the number of shards each would list."""
    from pipeline.score_teacher.writer import finished_shards
    from pipeline.folders.shard_folder import ShardProgress

    entries = finished_shards(folder)
    clock = [0.0]
    listed: list[int] = []
    progress = ShardProgress(lambda: listed.append(progress.shards), every_s=10.0, clock=lambda: clock[0])
    t0 = time.process_time()
    for i in range(n):
        clock[0] += 12 * 3600 / n
        progress.scored(entries[i])
    return {"bookkeeping_cpu_s": time.process_time() - t0, "manifest_writes": len(listed),
            "manifest_shards_written": int(sum(listed)), "tokens": progress.tokens}


def op_markers(folder: Path, n: int) -> dict:
    """The markers against the manifest and the files (:func:`pipeline.inspection.validate.validate_markers`)."""
    from pipeline.inspection.validate import validate_markers

    report = validate_markers(folder)
    return {"errors": len(report.errors), "warnings": len(report.warnings), "shards": report.shards_checked}


def op_validate(folder: Path, n: int) -> dict:
    """``make validate``: the markers, then every shard's checksum, footer and rows (one document each)."""
    from pipeline.inspection.validate import validate_dataset

    report = validate_dataset(folder, checksums=True)
    return {"errors": len(report.errors), "warnings": len(report.warnings), "shards": report.shards_checked}


def op_open(folder: Path, n: int) -> dict:
    """Opening the folder as stage 2 and the export do (every shard's size and footer)."""
    from storage_schemas.reader import open_scored_dataset

    dataset = open_scored_dataset([folder])
    return {"shards": len(dataset.shards)}


OPERATIONS = {"resume planning": op_resume, "manifest writing": op_manifest, "driver bookkeeping": op_progress,
              "marker validation": op_markers, "open for training": op_open, "full validation": op_validate}


def run_markers(ctx, n: int) -> dict:
    """Build the folder, then measure each operation in its own process (module docstring)."""
    from rehearsal.run import step, step_result_json

    folder = ctx.work / f"markers-{n}"
    t0 = time.perf_counter()
    build(folder, n)
    out = {"shards": n, "folder": str(folder), "build_s": time.perf_counter() - t0, "operations": {}}
    for name in OPERATIONS:
        r = step(ctx, f"markers: {name}", ctx.module("rehearsal.markers", name, json.dumps({"folder": str(folder), "n": n})))
        result = step_result_json(r) if r.returncode == 0 else {"error": r.stdout_tail[-2000:]}
        out["operations"][name] = {**result, "wall_s": r.wall_s, "cpu_s": r.cpu_s, "peak_rss_mib": r.peak_tree_rss_mib}
    return out


def main(argv: list[str]) -> int:
    args = json.loads(argv[1])
    result = OPERATIONS[argv[0]](Path(args["folder"]), args["n"])
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
