"""The scored-dataset contract between stage 1 and its readers (docs/METHOD.md §1.4, §1.5).

* :mod:`~storage_schemas.schema`: the row schema, shard metadata keys, the Polars view of the schema;
* :mod:`~storage_schemas.layout`: the folder (``dataset_dir``), shard, marker and manifest names,
  reading the manifest, checking a shard file against its entry;
* :mod:`~storage_schemas.rows`: the row invariants, checked in one place;
* :mod:`~storage_schemas.identity`: comparing dataset identities;
* :mod:`~storage_schemas.reader`: the one reader, :class:`~storage_schemas.reader.ScoredDataset`.

The package needs pyarrow and NumPy only; Polars is imported where a Polars frame is asked for.
"""

from storage_schemas.identity import (  # noqa: F401
    IDENTITY_FORMAT,
    data_identity_differences,
    describe_teacher,
    iter_identity_differences,
    shard_identity_differences,
)
from storage_schemas.layout import (  # noqa: F401
    CARD_NAME,
    MANIFEST_NAME,
    SHARD_RE,
    complete_shard_files,
    dataset_dir,
    file_sha256,
    marker_name,
    marker_of,
    read_manifest,
    shard_file_problems,
    shard_index,
    shard_name,
    strict_json,
    write_bytes_atomic,
    write_json_atomic,
)
from storage_schemas.rows import RowRules, check_rows, table_problems  # noqa: F401
from storage_schemas.schema import (  # noqa: F401
    LIST_COLUMNS,
    META_CODE_VERSION,
    META_IDENTITY,
    META_KEYS,
    META_SCHEMA_VERSION,
    META_SHARD,
    NOTE_REASONS,
    ROW_SCHEMA,
    SCHEMA_VERSION,
    SKIP_REASONS,
    ZERO_TOKEN_REASONS,
    ContractError,
    check_schema,
    polars_schema,
    read_shard_metadata,
    schema_with_metadata,
)
