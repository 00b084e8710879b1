"""Temporary: the names stage 2's and the export's modules still import from here, now in
:mod:`.settings`, :mod:`.lengths`, :mod:`.packing`, :mod:`.dataset` and :mod:`.build`. Goes once
those imports point at the new modules."""

from pipeline.student_data.build import StudentData, build_student_data, teacher_identity  # noqa: F401
from pipeline.student_data.dataset import PackedDataset, Window, collate_packed  # noqa: F401
from pipeline.student_data.lengths import count_tokens, sample_documents_of, student_per_teacher_token  # noqa: F401
from pipeline.student_data.packing import document_tokens  # noqa: F401
from pipeline.student_data.settings import (  # noqa: F401
    AlignmentConfig,
    PackingConfig,
    StudentDataError,
    resolve_alignment,
    scored_folder_problems,
)
