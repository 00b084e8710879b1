"""``train.report_to`` through the Hugging Face Trainer's own integrations, offline: MLflow's local
file store and W&B's offline mode (no network). What arrived is read back (MLflow's client; the
records of W&B's offline run file) and compared with ``metrics.jsonl`` of the same run, which
separate code writes (:class:`pipeline.train_student.trainer.JsonlMetricsCallback`): every figure
of every training log, the guided loss's own statistics, a mixture's shares and several teachers'
metrics included. The tests skip where the ``trackers`` extra is not installed (CI installs it).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import math
import os
import socket
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.runtime.config import ConfigError
from pipeline.student_data.settings import AlignmentConfig
from pipeline.train_student.config import MixtureCorpus, TrainConfig
from pipeline.train_student.run import run_training
from pipeline.train_student.trackers import MLFLOW_FILE_STORE
from test_multi_teacher import rewrite
from test_one_line_errors import REPO, cli, refused
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
    from pipeline.train_student.config import train_job_config

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


def stage2(student: Path, scored: Path, tmp_path: Path, *extra: str) -> list[str]:
    """A short run through the command line (the run folder is ``tmp_path / 'out'``)."""
    return ["student.embedded=false", f"student.model={student}", "student.seq_len=32", f"data.folders=[{scored}]",
            f"data.cache_dir={tmp_path / 'lengths'}", "data.held_out_shards=0", "train.eval_every=null",
            "train.max_steps=3", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1",
            "train.logging_steps=1", "train.save_steps=2", "train.use_cpu=true", "train.cpu_threads=1",
            "train.progress=false", *extra]


def forget_mlflow_settings(monkeypatch) -> None:
    """MLflow's own defaults for the commands: no MLFLOW_ variable (an earlier MLflow run in this
    process sets MLFLOW_EXPERIMENT_ID)."""
    for name in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)


def test_mlflow_with_its_defaults_is_refused_with_the_line_that_makes_it_work(tiny_student, micro_scored, tmp_path,
                                                                                monkeypatch):
    """MLflow's default store (``sqlite:///mlflow.db``) cannot be opened by mlflow-skinny: one line,
    exit 2, before any work (no run folder, no length cache, no mlflow.db); the line it gives works."""
    pytest.importorskip("mlflow", reason="the trackers extra is not installed (pip install 'vocagno[trackers]')")
    if importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("the full mlflow package is installed: its default store opens")
    forget_mlflow_settings(monkeypatch)
    assert not (REPO / "mlflow.db").exists()
    line = refused(cli("train_student", tmp_path, *stage2(tiny_student, micro_scored, tmp_path, "train.report_to=[mlflow]")),
                   f"mlflow cannot open its tracking store sqlite:///{REPO}/mlflow.db (a database, MLflow's default "
                   "with MLFLOW_TRACKING_URI unset, which mlflow-skinny (the trackers extra) cannot open")
    assert line.count("\n") == 1 and line.startswith("error: train.report_to: ") and MLFLOW_FILE_STORE in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "lengths").exists()
    assert not (REPO / "mlflow.db").exists() and not (REPO / "mlruns").exists()

    # the line's setting, with $PWD the folder the command runs in (here, for the test, tmp_path)
    store = {name: value.replace("$PWD", str(tmp_path)) for name, value in
             (pair.split("=", 1) for pair in MLFLOW_FILE_STORE.split())}
    done = cli("train_student", tmp_path, *stage2(tiny_student, micro_scored, tmp_path, "train.report_to=[mlflow]"),
               env=store)
    assert done.returncode == 0, done.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=store["MLFLOW_TRACKING_URI"])
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == "out" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss_kept")] == [1, 2, 3]


def test_a_tracker_that_does_not_start_ends_the_run_in_one_line_before_its_first_step(tiny_student, micro_scored,
                                                                                       tmp_path, monkeypatch):
    """An MLflow server that does not answer (the store opens: it is only asked once training
    begins): one line naming the tracker and what sets it up, exit 2; no step trained, no
    checkpoint, no final model."""
    pytest.importorskip("mlflow", reason="the trackers extra is not installed (pip install 'vocagno[trackers]')")
    forget_mlflow_settings(monkeypatch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    result = cli("train_student", tmp_path, *stage2(tiny_student, micro_scored, tmp_path, "train.report_to=[mlflow]"),
                 env=env)
    line = refused(result, "error: train.report_to: mlflow did not start (", f"127.0.0.1:{port}",
                   "nothing was trained. Set it up (MLFLOW_TRACKING_URI (a server, http://<host>:5000, or local files: "
                   f"{MLFLOW_FILE_STORE})), or leave it out of train.report_to")
    assert line.count("\n") == 1, line
    out = tmp_path / "out"
    assert not metrics(out) if (out / "metrics.jsonl").exists() else True
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists()


def test_the_recipe_reaches_the_tracker(tiny_student, micro_scored, tmp_path, monkeypatch):
    """Through the command line, two teachers, MLflow's file store: the run's params hold the
    recipe (loss and selection, each teacher's alignment as resolved, the teachers, the scored
    folders and a digest of each one's dataset identity, the student's tokenizer), so runs can be
    filtered by it; the values are read back and compared with the manifests and the tokenizer."""
    pytest.importorskip("mlflow", reason="the trackers extra is not installed (pip install 'vocagno[trackers]')")
    from mlflow.tracking import MlflowClient
    from transformers import AutoTokenizer

    forget_mlflow_settings(monkeypatch)
    other = rewrite(micro_scored, tmp_path / "b", "micro-b", lambda d: replace(d, losses=d.losses[::-1].copy()))
    store = {"MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}
    args = stage2(tiny_student, micro_scored, tmp_path, "train.report_to=[mlflow]", "loss.ratio=0.3",
                  "loss.combine=mean", "loss.aggregate=mean")
    args[args.index(f"data.folders=[{micro_scored}]")] = f"data.folders=[{micro_scored},{other}]"
    done = cli("train_student", tmp_path, *args, env=store)
    assert done.returncode == 0, done.stderr[-3000:]

    for name, value in store.items():
        monkeypatch.setenv(name, value)
    client = MlflowClient(tracking_uri=store["MLFLOW_TRACKING_URI"])
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    params = run.data.params

    def digest(folder: Path) -> str:
        identity = json.loads((folder / "manifest.json").read_text())["identity"]
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]

    tokenizer = AutoTokenizer.from_pretrained(tiny_student).backend_tokenizer.to_str()
    expected = {
        "recipe.loss.mode": "guided", "recipe.loss.ratio": "0.3", "recipe.loss.rank_over": "batch",
        "recipe.loss.unmapped": "include",
        "recipe.loss.alignment": "token,token",  # the student's tokenizer is not the teacher's
        "recipe.loss.aggregate": "mean,mean", "recipe.loss.combine": "mean",
        "recipe.teachers": "micro,micro-b",
        "recipe.data.folders": f"{micro_scored},{other}",
        "recipe.data.identity": f"micro:{digest(micro_scored)},micro-b:{digest(other)}",
        "recipe.data.held_out_shards": "0",
        "recipe.student.tokenizer": str(tiny_student),
        "recipe.student.tokenizer_sha256": hashlib.sha256(tokenizer.encode()).hexdigest()[:12],
        "recipe.student.seq_len": "32",
    }
    assert {k: params.get(k) for k in expected} == expected
    assert len(params["recipe.data.digest"]) == 12
    assert params["learning_rate"]  # beside the Trainer's own parameters
