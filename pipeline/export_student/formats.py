"""The files of one exported shard, in each format, each written by its own project's writer.

* ``parquet`` (always): ``shard-NNNNNN.parquet``, :mod:`pipeline.export_student.rows`' schema;
  ``datasets.load_dataset(<folder>)`` (through the card's ``configs``) and Polars read it.
* ``megatron``: Megatron-core's indexed dataset, two prefixes per shard written with
  ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``:
  ``shard-NNNNNN.input_ids`` (int32) and ``shard-NNNNNN.teacher_loss`` (float32, NaN where
  unmapped), each a ``.bin`` and an ``.idx``; one sequence (and one document) per row, so both
  prefixes have the same sequence lengths and ``IndexedDataset(prefix)[i]`` is row ``i`` of the shard.
* ``litdata``: one litdata chunk per shard, ``shard-NNNNNN.litdata.bin``, written with
  ``litdata.streaming.writer.BinaryWriter``; when the export is complete, ``index.json`` lists every
  shard's chunk in order, so ``litdata.StreamingDataset(<folder>)`` reads the export's rows as
  dicts (``sample_index``, ``input_ids``, ``teacher_loss``, ``doc_starts``, ``doc_offsets``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.export_student.rows import Row
from storage_schemas import filesystem as sfs
from storage_schemas import write_json_atomic

ROW_GROUP_ROWS = 128
LITDATA_INDEX = "index.json"  # litdata's own name for a dataset's index
LITDATA_SUFFIX = ".litdata.bin"
MEGATRON_ARRAYS = {"input_ids": np.int32, "teacher_loss": np.float32}  # prefix suffix -> dtype in the .bin


def shard_parts(formats: Sequence[str], table: pa.Table, rows: Sequence[Row], compression: str,
                record: dict) -> dict:
    """The writers of one shard's files, keyed by suffix (:func:`pipeline.folders.shard_folder.write_shard_files`),
    the Parquet file first. A writer that learns something the export needs later (litdata's chunk
    description) adds it to ``record``."""
    parts: dict = {".parquet": lambda path: pq.write_table(
        table, path, compression=None if compression == "none" else compression, row_group_size=ROW_GROUP_ROWS)}
    if "megatron" in formats:
        for name, dtype in MEGATRON_ARRAYS.items():
            parts[(f".{name}.bin", f".{name}.idx")] = _megatron_writer([getattr(r, name) for r in rows], dtype)
    if "litdata" in formats:
        parts[LITDATA_SUFFIX] = _litdata_writer(rows, record)
    return parts


def megatron_prefix(shard_file: str, name: str) -> str:
    """``shard-000003.parquet`` -> ``shard-000003.<name>``, the Megatron prefix of that shard's array."""
    return shard_file.removesuffix(".parquet") + f".{name}"


def _megatron_writer(arrays: Sequence[np.ndarray], dtype) -> Callable[[Path, Path], None]:
    def write(bin_path: Path, idx_path: Path) -> None:
        logging.getLogger("megatron").setLevel(logging.WARNING)  # its import announces FSDP and Transformer Engine
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": no model is built here
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # heavy optional package (vocagno[megatron])
        builder = IndexedDatasetBuilder(str(bin_path), dtype=dtype)  # a NumPy scalar type, as Megatron asks
        for a in arrays:
            builder.add_document(torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)), lengths=[int(a.size)])
        builder.finalize(str(idx_path))

    return write


def litdata_item(row: Row) -> dict:
    """One row as a litdata item (numeric arrays only: a PyTree's structure is fixed, a list of ids is not)."""
    return {"sample_index": int(row.index), "input_ids": row.input_ids, "teacher_loss": row.teacher_loss,
            "doc_starts": row.doc_starts, "doc_offsets": row.doc_offsets}


def _litdata_writer(rows: Sequence[Row], record: dict) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        from litdata.streaming.writer import BinaryWriter  # heavy optional package (vocagno[litdata])

        with tempfile.TemporaryDirectory(prefix="litdata-") as scratch:
            writer = BinaryWriter(scratch, chunk_bytes=1 << 40)  # one chunk per shard
            for i, row in enumerate(rows):
                writer.add_item(i, litdata_item(row))
            writer.done()
            index = json.loads((Path(scratch) / f"0.{LITDATA_INDEX}").read_text())
            (chunk,) = index["chunks"]
            shutil.move(os.path.join(scratch, chunk["filename"]), path)
        record["litdata"] = {"chunk": chunk, "config": index["config"]}

    return write


def write_litdata_index(folder: str | os.PathLike, shards: Sequence[dict]) -> None:
    """litdata's ``index.json`` over every finished shard's chunk, in order (each chunk named by the
    file its marker records): the folder is then one ``StreamingDataset``."""
    chunks = []
    for entry in shards:
        chunk = dict(entry["litdata"]["chunk"])
        chunk["filename"] = next(p["file"] for p in entry["parts"] if p["file"].endswith(LITDATA_SUFFIX))
        chunks.append(chunk)
    write_json_atomic(sfs.child(folder, LITDATA_INDEX), {"chunks": chunks, "config": shards[0]["litdata"]["config"]})
