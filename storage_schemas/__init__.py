"""The Parquet contract between the stages. Depends on pyarrow and the standard library only."""

from storage_schemas.scored import (  # noqa: F401
    LIST_COLUMNS,
    MANIFEST_NAME,
    META_CODE_VERSION,
    META_IDENTITY,
    META_KEYS,
    META_SCHEMA_VERSION,
    META_SHARD,
    ROW_SCHEMA,
    SCHEMA_VERSION,
    ContractError,
    check_rows,
    check_schema,
    complete_shard_files,
    file_sha256,
    marker_name,
    read_manifest,
    read_shard_metadata,
    schema_with_metadata,
    shard_name,
    write_json_atomic,
)
