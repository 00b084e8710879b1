"""``train.report_to`` through the Hugging Face Trainer's own integrations, offline: MLflow's local
file store and W&B's offline mode (no network). What arrived is read back (MLflow's client; the
records of W&B's offline run file) and compared with ``metrics.jsonl`` of the same run, which
separate code writes (:class:`pipeline.train_student.trainer.JsonlMetricsCallback`): every figure
of every training log, the guided loss's own statistics, a mixture's shares and several teachers'
metrics included. The tests skip where the ``trackers`` extra is not installed (CI installs it).
"""

from __future__ import annotations

import glob
import json
import math
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.config import ConfigError
from pipeline.student_side import AlignmentConfig
from pipeline.train_student.mixture import MixtureCorpus
from pipeline.train_student.run import TrainConfig, run_training
from test_multi_teacher import rewrite
from test_train_student import make_job, metrics

SELECTION = ("loss_kept", "loss_all", "kept_fraction", "mapped_fraction", "teacher_loss_kept", "teacher_loss_dropped",
             "excess_loss")


def logged(run: Path) -> dict[int, dict[str, float]]:
    """The training logs of ``metrics.jsonl`` by step: every number but the callback's own ``time``."""
    return {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time") and isinstance(v, (int, float))}
            for r in metrics(run)}


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_mlflow_file_store_receives_every_logged_figure(tiny_student, micro_scored, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the trackers extra is not installed (pip install 'vocagno[trackers]')")
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "vocagno-test")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to use a file store
    other = rewrite(micro_scored, tmp_path / "b", "micro-b", lambda d: replace(d, losses=d.losses[::-1].copy()))
    job = make_job(tiny_student, micro_scored, tmp_path / "two-teachers", steps=3, report_to=["mlflow"])
    job = replace(job, data=replace(job.data, folders=[str(micro_scored), str(other)]),
                  alignment=AlignmentConfig(combine="mean"))
    run_training(job)

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("vocagno-test")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "two-teachers" and run.info.status == "FINISHED"
    expected = logged(tmp_path / "two-teachers")
    assert sorted(expected) == [1, 2, 3]
    keys = set().union(*expected.values())
    assert {*SELECTION, "loss", "grad_norm", "learning_rate", "decided_t0", "mapped_fraction_t1",
            "selection_jaccard_t0_t1", "sample_first", "tokens_seen"} <= keys
    for key in keys:
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert sorted(history) == [s for s in expected if key in expected[s]], key
        assert all(same(history[s], expected[s][key]) for s in history), (key, history)


BLOCK = 32768  # the offline run file is a LevelDB-format log: records in blocks of 32 KiB


def wandb_records(path: Path) -> list:
    """Every record of a W&B offline run file (``run-<id>.wandb``): a 7-byte header (``:W&B``,
    magic, version), then LevelDB log records (crc32c, length, type: 1 full, 2 first, 3 middle,
    4 last), a block's tail shorter than a record header left empty; each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_receives_every_logged_figure(tiny_student, micro_scored, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the trackers extra is not installed (pip install 'vocagno[trackers]')")
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_PROJECT": "vocagno-test"}.items():
        monkeypatch.setenv(name, value)
    twin = rewrite(micro_scored, tmp_path / "twin", "micro")  # a second corpus of the same teacher
    job = make_job(tiny_student, micro_scored, tmp_path / "mixed", steps=3, report_to=["wandb"])
    job = replace(job, data=replace(job.data, folders=[], mixture=[
        MixtureCorpus("a", 2.0, folders=[str(micro_scored)]), MixtureCorpus("b", 1.0, folders=[str(twin)])]))
    run_training(job)

    [run_file] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(Path(run_file))
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "mixed" and run.project == "vocagno-test"
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    arrived = {int(h["train/global_step"]): h for h in history if "train/loss_kept" in h}
    expected = logged(tmp_path / "mixed")
    assert sorted(arrived) == sorted(expected) == [1, 2, 3]
    assert {*SELECTION, "mixture_share_a", "mixture_share_b", "sample_last"} <= set(expected[1])
    for step, figures in expected.items():
        for key, value in figures.items():
            assert same(arrived[step][f"train/{key}"], value), (step, key)


def test_unknown_or_missing_trackers_are_named_before_any_work(monkeypatch):
    from pipeline.train_student import trackers
    from pipeline.train_student.run import train_job_config

    assert TrainConfig(report_to=["none"]).problems() == [] and TrainConfig(report_to=[]).problems() == []
    assert TrainConfig(report_to=["all", "wandb"]).problems() == [
        "report_to: ['all', 'wandb'] mixes all or none with other names; give one of them alone, or a list of trackers"]
    # a machine without the trackers extra (stood in for by what the Trainer reports installed)
    monkeypatch.setattr(trackers, "get_available_reporting_integrations", lambda: ["tensorboard"])
    with pytest.raises(ConfigError) as err:
        train_job_config({"student": {"name": "s", "model": "m"}, "data": {"folders": ["f"]}, "output_dir": "o",
                          "train": {"report_to": ["wandbb", "wandb", "mlflow", "tensorboard"]}})
    assert err.value.problems == [
        "train.report_to: 'wandbb' is not one of the Trainer's integrations (azure_ml, clearml, codecarbon, comet_ml, "
        "dagshub, dvclive, flyte, kubeflow, mlflow, neptune, swanlab, tensorboard, trackio, wandb); did you mean wandb?",
        "train.report_to: wandb is not installed (pip install 'vocagno[trackers]')",
        "train.report_to: mlflow is not installed (pip install 'vocagno[trackers]')"]
