"""The contract's reader under the name inspection callers import; it lives in
:mod:`storage_schemas.reader`."""

from storage_schemas.reader import DocumentNotFoundError, DocumentRecord, ScoredDataset  # noqa: F401
