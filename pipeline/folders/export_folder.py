"""What a ``make export-student`` folder is, for the two sides that use it: its writer
(:mod:`pipeline.export_student`) and stage 2 training on it (``data.export``,
:mod:`pipeline.train_student.from_export`). The manifest names the format version under
:data:`EXPORT_VERSION_KEY`; each shard's Parquet rows hold ``sample_index``, ``input_ids``,
``teacher_loss`` and, with several teachers, each teacher's own losses in
:func:`teacher_loss_column` (the whole table: :mod:`pipeline.export_student.rows`, docs/export.md).
"""

from __future__ import annotations

EXPORT_VERSION_KEY = "export_version"
EXPORT_VERSION = 1


def teacher_loss_column(teacher: int) -> str:
    """The column of teacher ``teacher``'s own losses (several teachers only)."""
    return f"teacher_loss_t{teacher}"
