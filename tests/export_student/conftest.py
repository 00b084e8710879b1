"""Fixtures of the export tests (helpers: export_helpers.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def student_tokenizer(tiny_student):
    from pipeline.method.tokenization import load_tokenizer

    return load_tokenizer(str(tiny_student))
