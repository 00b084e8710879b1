"""The export is written exactly once: a rerun after a partial run or a kill writes only what is
missing and gives the bytes of an uninterrupted run; a changed setting, or a folder holding
something else, is refused before anything there changes."""

from __future__ import annotations

import errno
import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import pipeline.export_student.job as export_job
from export_helpers import exported_rows, make_export, manifest
from pipeline.export_student.job import run_export
from pipeline.folders.shard_folder import DatasetMismatchError


def files(folder: Path) -> dict[str, str]:
    """sha256 of every shard file, part and marker (the manifest and the card are derived)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).glob("shard-*"))}


def stamps(folder: Path, names) -> dict[str, tuple[int, int]]:
    return {n: ((Path(folder) / n).stat().st_ino, (Path(folder) / n).stat().st_mtime_ns) for n in names}


@pytest.fixture(scope="module")
def whole(tiny_student, micro_scored, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "export"
    run_export(make_export(tiny_student, micro_scored, out, formats=["parquet", "megatron"]))
    return out


def test_partial_then_killed_then_rerun_equals_an_uninterrupted_export(whole, tiny_student, micro_scored, tmp_path,
                                                                       monkeypatch):
    out = tmp_path / "export"
    job = make_export(tiny_student, micro_scored, out, formats=["parquet", "megatron"])
    n = manifest(whole)["n_shards_planned"]
    assert n >= 5

    first = run_export(replace(job, export=replace(job.export, limit_shards=2)))
    assert (first.shards_written, first.complete) == (2, False) and not manifest(out)["complete"]
    kept = stamps(out, [p for p in files(out)])

    real = export_job.write_marker

    def killed_before_the_third_marker(folder, entry):  # files renamed into place, marker never written
        if entry["index"] == 3:
            raise KeyboardInterrupt("killed")
        real(folder, entry)

    monkeypatch.setattr(export_job, "write_marker", killed_before_the_third_marker)
    with pytest.raises(KeyboardInterrupt):
        run_export(job)
    monkeypatch.setattr(export_job, "write_marker", real)
    assert (out / "shard-000003.parquet").exists() and not (out / "shard-000003.done.json").exists()
    assert [e["index"] for e in manifest(out)["shards"]] == [0, 1, 2] and not manifest(out)["complete"]

    last = run_export(job)
    assert last.complete and last.shards_done_before == 3 and last.shards_written == n - 3
    assert files(out) == files(whole)  # the same bytes, shard 3 redone whole
    assert stamps(out, kept) == kept  # the first run's shards were not rewritten
    assert [r["sample_index"] for r in exported_rows(out)] == list(range(manifest(whole)["totals"]["rows"]))
    again = run_export(job)
    assert again.shards_written == 0 and files(out) == files(whole)


def test_a_changed_setting_is_refused_and_overwrite_redoes_the_export(whole, tiny_student, micro_scored, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(whole, out)
    before = files(out)
    for change, named in (({"loss": {"aggregate": "mean"}}, "aggregate"), ({"data": {"seed": 1}}, "seed"),
                          ({"rows_per_shard": 8}, "rows_per_shard"), ({"formats": ["parquet"]}, "formats")):
        job = make_export(tiny_student, micro_scored, out, **{"formats": ["parquet", "megatron"], **change})
        with pytest.raises(DatasetMismatchError, match=named) as refused:
            run_export(job)
        assert "\n" not in str(refused.value)  # one line
        assert files(out) == before
    redone = run_export(make_export(tiny_student, micro_scored, out, loss={"aggregate": "mean"}, overwrite=True))
    assert redone.complete and not list(out.glob("*.input_ids.bin"))  # the old Megatron files went with the old export
    assert manifest(out)["identity"]["teachers"][0]["alignment"]["aggregate"] == "mean"


def test_a_folder_holding_a_scored_dataset_or_inside_one_is_refused(tiny_student, micro_scored, tmp_path):
    scored_copy = tmp_path / "scored"
    shutil.copytree(micro_scored, scored_copy)
    before = files(scored_copy)
    with pytest.raises(DatasetMismatchError, match="another kind of output"):
        run_export(make_export(tiny_student, micro_scored, scored_copy))
    with pytest.raises(DatasetMismatchError, match="another kind of output"):
        run_export(make_export(tiny_student, micro_scored, scored_copy, overwrite=False))
    assert files(scored_copy) == before and not (scored_copy / "index.json").exists()
    with pytest.raises(DatasetMismatchError, match="lies inside data.folders"):
        run_export(make_export(tiny_student, micro_scored, Path(micro_scored) / "export"))
    assert not (Path(micro_scored) / "export").exists()


def test_a_damaged_part_of_a_marked_shard_is_redone(whole, tiny_student, micro_scored, tmp_path):
    """A marker names every file of its shard with its size: a Megatron file cut short makes the
    shard unfinished, and the rerun writes it again (the Parquet file of that shard included)."""
    out = tmp_path / "export"
    shutil.copytree(whole, out)
    victim = out / "shard-000001.teacher_loss.bin"
    victim.write_bytes(victim.read_bytes()[:-8])
    again = run_export(make_export(tiny_student, micro_scored, out, formats=["parquet", "megatron"]))
    assert again.shards_written == 1 and files(out) == files(whole)


def everything(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_overwrite_gives_the_old_export_back_when_the_new_one_fails_before_its_first_shard(
        whole, tiny_student, micro_scored, tmp_path, monkeypatch):
    out = tmp_path / "export"
    shutil.copytree(whole, out)
    before = everything(out)

    def disk_fails(*args, **kwargs):  # a disk failing mid-write, which cannot be made to happen on demand here
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(export_job, "write_export_shard", disk_fails)
    with pytest.raises(OSError, match="Input/output error"):
        run_export(make_export(tiny_student, micro_scored, out, loss={"aggregate": "mean"}, overwrite=True))
    assert everything(out) == before, "every shard, part, marker, the manifest and the card are back"


def test_an_export_into_the_students_folder_is_refused_whatever_overwrite_says(tiny_student, micro_scored, tmp_path):
    student = shutil.copytree(tiny_student, tmp_path / "student")
    before = everything(student)
    with pytest.raises(DatasetMismatchError, match=r"output_dir .*student is student.model .*whatever overwrite says"):
        run_export(make_export(student, micro_scored, student, overwrite=True))
    assert everything(student) == before
