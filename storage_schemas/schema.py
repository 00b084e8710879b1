"""The row schema of a scored shard and the key-value metadata every shard carries
(docs/METHOD.md §1.4).

One row per document:

============  ===============  ==============================================================
column        type             meaning
============  ===============  ==============================================================
doc_id        string           stable id of the document (source file + row), unique
text          string           exactly the text that was scored
token_ids     list<int32>      teacher token ids (no BOS/EOS: only tokens of ``text``)
starts        list<int32>      character (Python ``str``) offset where each token starts
ends          list<int32>      character offset where each token ends (exclusive)
losses        list<float32>    -log p_teacher(token | left context); NaN where no prediction
============  ===============  ==============================================================

:data:`ROW_SCHEMA` is the one statement of it; :func:`polars_schema` derives the Polars view of it
for readers that query with Polars (imported lazily: the contract itself needs pyarrow only).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import pyarrow as pa

from storage_schemas import filesystem

SCHEMA_VERSION = 1

ROW_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("starts", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("ends", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("losses", pa.list_(pa.field("item", pa.float32(), nullable=False)), nullable=False),
    ]
)
LIST_COLUMNS = ("token_ids", "starts", "ends", "losses")

# Parquet key-value metadata keys (values are JSON).
META_SCHEMA_VERSION = "vocagno.schema_version"
META_IDENTITY = "vocagno.identity"  # teacher, tokenizer, dtype, window/stride, corpus, shard plan
META_SHARD = "vocagno.shard"  # this shard's index and source range
META_CODE_VERSION = "vocagno.code_version"
META_KEYS = (META_SCHEMA_VERSION, META_IDENTITY, META_SHARD, META_CODE_VERSION)

# Why a document is left out or remarked on, counted per shard in the manifest (``reasons``): the
# SKIP_REASONS are not stored (their ids are listed), the ZERO_TOKEN_REASONS are stored with zero
# tokens, the NOTE_REASONS are stored and scored as they are.
SKIP_REASONS = ("null_text", "invalid_utf8", "invalid_json", "invalid_text", "lone_surrogate", "tokenizer_error")
ZERO_TOKEN_REASONS = ("empty_text", "whitespace_only")
NOTE_REASONS = ("contains_nul",)


class ContractError(ValueError):
    """A file or folder that breaks the scored-dataset contract."""


def polars_schema():
    """:data:`ROW_SCHEMA` as a ``polars.Schema`` (for an empty frame of the right columns)."""
    import polars as pl  # the contract needs pyarrow only; Polars where a frame is asked for

    return pl.DataFrame(ROW_SCHEMA.empty_table()).schema


def schema_with_metadata(identity: Mapping[str, Any], shard: Mapping[str, Any], code_version: str) -> pa.Schema:
    meta = {
        META_SCHEMA_VERSION: json.dumps(SCHEMA_VERSION),
        META_IDENTITY: json.dumps(identity, sort_keys=True),
        META_SHARD: json.dumps(shard, sort_keys=True),
        META_CODE_VERSION: json.dumps(code_version),
    }
    return ROW_SCHEMA.with_metadata(meta)


def read_shard_metadata(path: str | os.PathLike, schema: pa.Schema | None = None) -> dict[str, Any]:
    """The decoded key-value metadata of one shard (from ``schema`` when its footer was read
    already); raises :class:`ContractError` if absent."""
    try:
        schema = schema if schema is not None else filesystem.parquet_schema(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        if filesystem.unavailable(exc):
            raise  # the store did not answer: nothing is known of the file
        raise ContractError(f"{path}: not a readable Parquet file ({exc})") from exc
    raw = schema.metadata or {}
    missing = [k for k in META_KEYS if k.encode() not in raw]
    if missing:
        raise ContractError(f"{path}: missing shard metadata keys {missing}")
    meta = {k: json.loads(raw[k.encode()]) for k in META_KEYS}
    if meta[META_SCHEMA_VERSION] != SCHEMA_VERSION:
        raise ContractError(
            f"{path}: schema version {meta[META_SCHEMA_VERSION]}, this code reads version {SCHEMA_VERSION}"
        )
    check_schema(schema, where=str(path))
    return meta


def check_schema(schema: pa.Schema, where: str) -> None:
    got = pa.schema([schema.field(n) for n in schema.names]).remove_metadata()
    want = ROW_SCHEMA
    if [f.name for f in got] != [f.name for f in want]:
        raise ContractError(f"{where}: columns {got.names}, expected {want.names}")
    for g, w in zip(got, want):
        if not g.type.equals(w.type):
            raise ContractError(f"{where}: column {g.name!r} has type {g.type}, expected {w.type}")
