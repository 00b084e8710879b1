"""Stage 1 on the user's own files through the real command, as the README writes it (the
OpenWebMath preset, ``data.source=files``), with the progress bar on: the bar's last line counts
every document and token the dataset holds, and the dataset's identity and card name the files
read, never the preset's hub id. The references are counted from the Parquet output and the corpus
files themselves, with pyarrow and hashlib."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
PRESET_HUB_ID = "open-web-math/open-web-math"  # conf/data/open-web-math.yaml


@pytest.fixture(scope="module")
def own_files_run(micro_teacher, micro_corpus, tmp_path_factory):
    """One run of ``make score-teacher`` over the micro corpus's two files, 4 shards of 40."""
    tmp = tmp_path_factory.mktemp("own-files")
    out = tmp / "scored"
    args = ["teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.window=64",
            "teacher.stride=32", "data=open-web-math",
            "data.name=mine", "data.source=files", "data.rows_per_shard=40",
            f"data.files=[{','.join(str(f) for f in micro_corpus)}]", f"output_dir={out}", "progress=true",
            f"hydra.run.dir={tmp / 'logs'}"]
    result = subprocess.run([sys.executable, "-m", "stages.score_teacher", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_the_last_progress_line_counts_the_whole_dataset(own_files_run):
    out, result = own_files_run
    shards = [pq.read_table(p, columns=["token_ids"]) for p in sorted(out.glob("shard-*.parquet"))]
    documents = sum(t.num_rows for t in shards)
    tokens = sum(pc.sum(pc.list_value_length(t.column("token_ids"))).as_py() or 0 for t in shards)
    assert len(shards) == 4 and documents > 0 and tokens > 0
    # tqdm redraws its line with \r; the last drawing is the closed bar's
    lines = [ln for ln in re.split(r"[\r\n]", result.stderr) if "docs=" in ln]
    assert lines, result.stderr[-3000:]
    last = lines[-1]
    assert "4/4" in last, last
    shown = dict(re.findall(r"(docs|tokens)=([\d,]+)", last))
    assert {k: int(v.replace(",", "")) for k, v in shown.items()} == {"docs": documents, "tokens": tokens}, last


def test_an_own_files_corpus_records_its_files_not_the_presets_hub_id(own_files_run, micro_corpus):
    out, _ = own_files_run
    manifest = json.loads((out / "manifest.json").read_text())
    corpus = manifest["identity"]["corpus"]
    assert corpus["source"] == "files" and corpus["name"] == "mine"
    assert corpus["hub_id"] is None and corpus["hub_config"] is None and corpus["revision"] is None, corpus
    # the files read, by their content: each file's name, rows, bytes and sha256, hashed independently
    listing = [[Path(f).name, pq.ParquetFile(f).metadata.num_rows, Path(f).stat().st_size,
                hashlib.sha256(Path(f).read_bytes()).hexdigest()] for f in micro_corpus]
    assert corpus["n_files"] == len(micro_corpus)
    assert corpus["files_sha256"] == hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    assert manifest["location"]["corpus_files"] == [str(Path(f).resolve()) for f in micro_corpus]
    everything = (out / "manifest.json").read_text() + (out / "README.md").read_text()
    everything += "".join(str(pq.read_schema(p).metadata) for p in out.glob("shard-*.parquet"))
    assert PRESET_HUB_ID not in everything and "open-web-math" not in everything
    card = (out / "README.md").read_text()
    assert "local files" in card and all(Path(f).name in card for f in micro_corpus), card
