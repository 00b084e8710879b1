"""``make inspect`` on a scored folder with a damaged shard (cut short, bytes changed in place, gone):
the command warns, naming the shard and what is wrong, never shows the folder as "(complete)", and
its figures are those of the sound shards alone. The reference is pyarrow's own reading of the
sound shards' files, and the manifest as stage 1 wrote it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "cut short":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "bytes changed in place":  # the same size, a footer that still reads
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["cut short", "bytes changed in place", "gone"])
def test_a_damaged_shard_is_named_and_left_out_never_shown_complete(micro_scored, tmp_path, how):
    folder = Path(shutil.copytree(micro_scored, tmp_path / "ds"))
    entries = json.loads((folder / "manifest.json").read_text())["shards"]
    bad = entries[1]["file"]
    damage(folder / bad, how)
    run = subprocess.run([sys.executable, "-m", "stages.inspect", f"path={folder}", "summary.show_document=true",
                          f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'logs'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"warning: {bad}: " in run.stdout, run.stdout[:3000]
    assert "(complete)" not in run.stdout
    assert f"(complete in its manifest, but 1 of its {len(entries)} listed shards are damaged" in run.stdout
    sound = [pq.read_table(folder / e["file"]) for e in entries if e["file"] != bad]
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["documents"] == sum(t.num_rows for t in sound)
    assert saved["tokens"] == sum(sum(len(ids) for ids in t.column("token_ids").to_pylist()) for t in sound)
    assert [r["file"] for r in saved["per_shard"]] == [e["file"] for e in entries if e["file"] != bad]
    assert list(saved["damaged"]) == [bad]
