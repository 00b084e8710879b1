"""The synthetic markers folder is a valid scored dataset, and checking its markers alone finds what
the full validation finds at folder level: a marker that differs from its entry, a missing shard."""

from __future__ import annotations

import json

from pipeline.inspection.validate import validate_dataset, validate_markers
from rehearsal.markers import build, op_progress, op_resume


def test_the_markers_folder_is_valid_and_its_checks_find_damage(tmp_path):
    folder = tmp_path / "markers-30"
    build(folder, 30)
    assert validate_dataset(folder).ok and validate_markers(folder).ok
    assert op_resume(folder, 30) == {"done": 30, "pending": 0}
    assert op_progress(folder, 30)["tokens"] == 30 * 8

    marker = folder / "shard-000007.done.json"
    entry = json.loads(marker.read_text())
    marker.write_text(json.dumps({**entry, "sha256": "0" * 64}))
    (folder / "shard-000011.parquet").unlink()
    found = {(p.file, p.message.split(" (")[0]) for p in validate_markers(folder).errors}
    assert ("shard-000007.done.json", "marker differs from the manifest entry in sha256") in found
    assert ("shard-000011.parquet", "listed in the manifest but missing from the folder") in found
    full = {(p.file, p.message.split(" (")[0]) for p in validate_dataset(folder).errors}
    assert found <= full
