"""Stage 2 on several processes: two real ``torchrun`` launchers on 127.0.0.1 (c10d rendezvous,
gloo on CPU, one process each), and one node's two processes started by ``torchrun`` or
``accelerate launch`` exactly as docs/multi-node.md shows (no CPU or backend setting: the stage
makes the launch one data-parallel run on CPUs), against one process with the same global batch.

What each process reads is recorded by a ``sitecustomize`` module that the test puts first on the
launchers' ``PYTHONPATH`` (test-only instrumentation; the code under test is unchanged): it wraps
``storage_schemas.reader.read_row_group`` (every row group decoded, with its columns),
``pipeline.student_data.lengths.count_tokens`` (the token count) and ``PackedDataset.__getitems__``
(the samples a rank's data-loader workers are asked for), and appends one JSON line per call,
tagged with the process's global rank and launcher, to a per-process file.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.train_student.checkpoints import COMPLETE_NAME
from pipeline.train_student.run import run_training
from storage_schemas.reader import ROW_COLUMNS
from tests.train_student.test_train_student import compose, metrics

REPO = Path(__file__).resolve().parents[2]
MICRO, SEQ, GLOBAL_SAMPLES = 2, 32, 8  # 8 sequences per step: 1 process x 4 micro-batches, or 2 x 2
EXACT = ("step", "learning_rate", "sample_first", "sample_last", "tokens_seen", "kept_fraction", "mapped_fraction",
         "nonfinite_steps", "skipped_steps")
# Float32 sums in another order: one process adds its micro-batches' gradients, two processes add
# two each and then all-reduce (and the metrics are summed per rank, then across ranks). Each
# step's values differ from the one-process run by a few float32 ulps at most, which the
# training then carries along; 1e-4 relative is far below any difference a wrong batch,
# selection or scaling would make (those change the loss in the second or third digit).
CLOSE = ("loss", "grad_norm", "loss_kept", "loss_all", "teacher_loss_kept", "teacher_loss_dropped", "excess_loss")
RTOL = 1e-4

SITECUSTOMIZE = '''
import json, os
if os.environ.get("READ_LOG_DIR"):
    import storage_schemas.reader as reader
    import pipeline.student_data.dataset as dataset
    import pipeline.student_data.lengths as lengths

    def _log(**record):
        record.update(pid=os.getpid(), rank=int(os.environ.get("RANK", "-1")), node=os.environ.get("NODE_TAG"))
        with open(os.path.join(os.environ["READ_LOG_DIR"], f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\\n")

    _read, _count, _items = reader.read_row_group, lengths.count_tokens, dataset.PackedDataset.__getitems__

    def read_row_group(shard, group, columns=None):
        _log(what="row_group", shard=os.path.basename(str(shard.path)), group=group,
             columns=list(columns) if columns else None)
        return _read(shard, group, columns)

    def count_tokens(tokenizer, texts):
        _log(what="count", n=len(texts))
        return _count(tokenizer, texts)

    def getitems(self, indices):
        _log(what="samples", indices=[int(k) for k in indices])
        return _items(self, indices)

    reader.read_row_group = lengths.read_row_group = read_row_group
    lengths.count_tokens, dataset.PackedDataset.__getitems__ = count_tokens, getitems
'''


def overrides(student: Path, scored: Path, out: Path, run: str, steps: int, cache: Path) -> list[str]:
    """The run's settings as a user gives them to a launcher: nothing about CPUs or the backend."""
    return [
        "student.embedded=false", f"student.model={student}", f"student.seq_len={SEQ}", f"data.folders=[{scored}]",
        f"data.cache_dir={cache}", "data.num_workers=1", f"train.micro_batch_size={MICRO}",
        f"train.global_batch_tokens={GLOBAL_SAMPLES * SEQ}", f"train.max_steps={steps}", "train.warmup_steps=2",
        "train.learning_rate=3e-3", "train.min_learning_rate=3e-4", "train.logging_steps=1", "train.save_steps=3",
        "train.report_to=[]", "train.progress=false", "train.cpu_threads=1",
        f"output_dir={out}/{run}",
        # every document trained and counted: not the embedded recipe's held-out shard and its evaluation
        "data.held_out_shards=0", "train.eval_every=null",
    ]


def reference_run(student: Path, scored: Path, out: Path, steps: int) -> Path:
    """One process, in this process (on the CPU), from the very config the stage composes."""
    from stages.train_student import job_config

    job = job_config(compose([*overrides(student, scored, out, "one-process", steps, out / "one-process-lengths"),
                              "train.use_cpu=true"]))
    run_training(job)
    return Path(job.output_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(node: int, port: int, args: list[str], out: Path, logs: Path) -> subprocess.Popen:
    """One node's launcher (of two) in its own session (so that it, its worker and its data-loader
    worker die together). Node 0 hosts the rendezvous store."""
    launcher = ["torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=vocagno-test-{port}",
                f"--rdzv-conf=is_host={str(node == 0).lower()}", "--max-restarts=0"]
    return start(launcher, args, out, logs, f"node{node}")


def start(launcher: list[str], args: list[str], out: Path, logs: Path, tag: str) -> subprocess.Popen:
    """``python -m <launcher> -m stages.train_student <args>`` in its own session, on the CPU (no
    GPU visible), its output in ``<out>/<tag>.log``, every process's reads logged (SITECUSTOMIZE)."""
    instrument = out / "instrument"
    instrument.mkdir(exist_ok=True)
    (instrument / "sitecustomize.py").write_text(SITECUSTOMIZE)
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NODE_TAG": tag, "CUDA_VISIBLE_DEVICES": "",
           "READ_LOG_DIR": str(logs), "PYTHONPATH": os.pathsep.join([str(instrument), str(REPO)])}
    command = [sys.executable, "-m", *launcher, "-m", "stages.train_student", *args, f"hydra.run.dir={out}/hydra/{tag}"]
    with open(out / f"{tag}.log", "ab") as f:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def two_nodes(student, scored, out: Path, run: str, steps: int, caches: tuple[Path, Path], logs: Path):
    port = free_port()
    return [launch(n, port, overrides(student, scored, out, run, steps, caches[n]), out, logs) for n in (0, 1)]


def wait_all(procs: list[subprocess.Popen], out: Path, tags: tuple[str, ...] = ("node0", "node1")) -> None:
    codes = [p.wait(timeout=600) for p in procs]
    tails = "\n".join((out / f"{tag}.log").read_text()[-3000:] for tag in tags)
    assert codes == [0] * len(procs), tails


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL both nodes whole: each launcher and every process under it (torchrun starts its
    worker in a session of its own, so the launcher's process group is not enough)."""
    victims = [pid for p in procs if p.poll() is None for pid in (p.pid, *descendants(p.pid))]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(Path(f"/proc/{pid}").exists() and not _zombie(pid) for pid in victims):
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def read_log(logs: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(logs.glob("*.jsonl")) for line in f.read_text().splitlines()]


def assert_like_one_process(run: Path, reference: Path, steps: int) -> float:
    """Same steps, samples and schedule exactly; losses and norms to RTOL. Returns the largest
    relative difference seen."""
    got, want = metrics(run), metrics(reference)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [{k: r[k] for k in EXACT} for r in got] == [{k: r[k] for k in EXACT} for r in want]
    worst = 0.0
    for a, b in zip(got, want):
        for k in CLOSE:
            assert math.isclose(a[k], b[k], rel_tol=RTOL), (a["step"], k, a[k], b[k])
            worst = max(worst, abs(a[k] - b[k]) / abs(b[k]))
    return worst


def rank_samples(rank: int, steps: int) -> set[int]:
    """The samples a rank trains (worked by hand): the sequential order cut into micro-batches of
    MICRO, dealt to the 2 ranks in turn, for steps x GLOBAL_SAMPLES samples."""
    return {k for k in range(steps * GLOBAL_SAMPLES) if (k // MICRO) % 2 == rank}


def needed_row_groups(scored: Path, student: Path, samples: set[int]) -> set[tuple[str, int]]:
    """(shard file, row group) of every document the given samples take tokens from, from the
    packing plan that an independent build of the same data gives."""
    from pipeline.method.tokenization import load_tokenizer
    from pipeline.student_data.build import build_student_data
    from pipeline.student_data.settings import AlignmentConfig, PackingConfig
    from storage_schemas.reader import open_scored_dataset

    data = build_student_data(open_scored_dataset([scored]), load_tokenizer(str(student)),
                              PackingConfig(seq_len=SEQ), AlignmentConfig())
    plan, shards = data.plan, data.scored.shards
    needed = set()
    for k in samples:
        for d, _, _ in plan.documents_of(k):
            shard = shards[int(plan.doc_shard[d])]
            needed.add((shard.path.name, shard.row_group_of(int(plan.doc_row[d]))[0]))
    return needed


@pytest.mark.long
def test_two_launchers_train_like_one_process_and_count_once(one_process, tiny_student, micro_scored, tmp_path):
    """Two nodes with a shared length cache: the per-step losses of one process with the same
    global batch; the token count done once, on global rank 0, reading only ``text``; each rank's
    data-loader workers decode only row groups of documents of samples that rank trains."""
    steps, reference = 4, one_process
    cache, logs = tmp_path / "lengths", tmp_path / "reads"
    wait_all(two_nodes(tiny_student, micro_scored, tmp_path, "two-nodes", steps, (cache, cache), logs), tmp_path)
    worst = assert_like_one_process(tmp_path / "two-nodes", reference, steps)
    print(f"largest relative difference from one process: {worst:.3g}")

    records = read_log(logs)
    counts = [r for r in records if r["what"] == "count"]
    assert {r["rank"] for r in counts} == {0}, "only global rank 0 counts"
    n_docs = json.loads((micro_scored / "manifest.json").read_text())["totals"]["documents"]
    assert sum(r["n"] for r in counts) == n_docs, "every document counted exactly once"
    counting_reads = [r for r in records if r["what"] == "row_group" and r["columns"] != list(ROW_COLUMNS)]
    assert counting_reads and all(r["columns"] == ["text"] and r["rank"] == 0 for r in counting_reads)
    assert len(list(cache.rglob("*.npy"))) == len(json.loads((micro_scored / "manifest.json").read_text())["shards"])

    trained = {rank: set() for rank in (0, 1)}
    decoded = {rank: set() for rank in (0, 1)}
    for r in records:
        if r["what"] == "samples":
            trained[r["rank"]].update(r["indices"])
        elif r["what"] == "row_group" and r["columns"] == list(ROW_COLUMNS):
            decoded[r["rank"]].add((r["shard"], r["group"]))
    all_groups = {(e["file"], 0) for e in json.loads((micro_scored / "manifest.json").read_text())["shards"]}
    for rank in (0, 1):
        assert trained[rank] == rank_samples(rank, steps)
        assert decoded[rank], f"rank {rank} decoded nothing"
        assert decoded[rank] <= needed_row_groups(micro_scored, tiny_student, rank_samples(rank, steps)), rank
    assert decoded[0] | decoded[1] < all_groups, "a short run leaves some shards unread"


# docs/multi-node.md's commands for two processes on one CPU machine, with a free port (tests run side
# by side); accelerate starts several processes only with --multi_gpu, its name for data parallel
ONE_NODE_LAUNCHERS = {
    "torchrun": lambda port: ["torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"],
    "accelerate launch": lambda port: ["accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
                                       f"--main_process_port={port}"],
}


@pytest.fixture(scope="module")
def one_process(tiny_student, micro_scored, tmp_path_factory) -> Path:
    """The reference: one process, the same global batch (8 sequences a step), 4 steps."""
    return reference_run(tiny_student, micro_scored, tmp_path_factory.mktemp("one-process"), 4)


@pytest.mark.long
@pytest.mark.parametrize("launcher", list(ONE_NODE_LAUNCHERS))
def test_one_node_launched_as_the_docs_show_is_one_run(launcher, one_process, tiny_student, micro_scored, tmp_path):
    """Two processes on the CPU, launched as docs/multi-node.md shows, without ``train.use_cpu`` or
    a backend: each trains its own micro-batches of every global batch, the per-step losses are
    those of one process with the same global batch (not those of one process with half of it,
    which two processes each training the whole batch alone would log), only global rank 0 writes
    the checkpoints and ``final/``, and the summary's tokens are the ones trained."""
    steps, logs = 4, tmp_path / "reads"
    args = overrides(tiny_student, micro_scored, tmp_path, "run", steps, tmp_path / "lengths")
    proc = start(ONE_NODE_LAUNCHERS[launcher](free_port()), args, tmp_path, logs, "launch")
    wait_all([proc], tmp_path, ("launch",))
    run = tmp_path / "run"
    print(f"largest relative difference from one process: {assert_like_one_process(run, one_process, steps):.3g}")

    trained = {rank: set() for rank in (0, 1)}
    for r in read_log(logs):
        if r["what"] == "samples":
            trained[r["rank"]].update(r["indices"])
    assert trained == {rank: rank_samples(rank, steps) for rank in (0, 1)}, "each rank its own micro-batches"
    assert complete_steps(run) == [3, 4] and (run / "final" / "model.safetensors").is_file()
    assert not list(run.glob(".*tmp*")), "nothing left half-written"
    summary = json.loads((run / "summary.json").read_text())
    samples_trained = sum(r["sample_last"] - r["sample_first"] + 1 for r in metrics(run))
    assert summary["tokens_per_step"] == GLOBAL_SAMPLES * SEQ
    assert summary["tokens_trained"] == samples_trained * SEQ == steps * GLOBAL_SAMPLES * SEQ
    log = (tmp_path / "launch.log").read_text()
    assert f"{steps} ({GLOBAL_SAMPLES * SEQ} tokens each)" in log and "parallel_mode" not in log


def test_a_world_size_without_a_launcher_is_refused_in_one_line(tiny_student, micro_scored, tmp_path):
    """``WORLD_SIZE`` above 1 in the shell without a launcher's rank and rendezvous address: one line
    naming them and the way out, exit status 2, before anything is written."""
    args = overrides(tiny_student, micro_scored, tmp_path, "run", 4, tmp_path / "lengths")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, "-m", "stages.train_student", *args, f"hydra.run.dir={tmp_path}/hydra"],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**env, "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "", "VOCAGNO_TRACEBACK": ""})
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0] == ("error: WORLD_SIZE=2 but RANK and MASTER_ADDR unset: not a launch of 2 processes by torchrun "
                        "or accelerate launch, which set them all (docs/multi-node.md); launch with one of them, or "
                        "unset WORLD_SIZE to train in one process")
    assert not (tmp_path / "run").exists() and not (tmp_path / "lengths").exists()


def complete_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in run.glob(f"checkpoint-*/{COMPLETE_NAME}"))


@pytest.mark.slow
def test_two_launchers_killed_after_a_checkpoint_resume_to_the_same_run(tiny_student, micro_scored, tmp_path):
    """Node-local length caches (a different folder per launcher): still counted once, on global
    rank 0, and stored only in its node's cache. Both launchers SIGKILLed after a checkpoint and
    rerun: the resumed run equals an uninterrupted two-node run exactly (losses, samples, final
    weights bit for bit) and the one-process run to RTOL."""
    steps = 12
    reference = reference_run(tiny_student, micro_scored, tmp_path, steps)
    shared = tmp_path / "lengths-shared"
    wait_all(two_nodes(tiny_student, micro_scored, tmp_path, "straight", steps, (shared, shared), tmp_path / "r0"),
             tmp_path)

    caches, logs = (tmp_path / "lengths-node0", tmp_path / "lengths-node1"), tmp_path / "r1"
    run = tmp_path / "killed"
    procs = two_nodes(tiny_student, micro_scored, tmp_path, "killed", steps, caches, logs)
    deadline = time.time() + 300
    while time.time() < deadline and not (complete_steps(run) and max(r["step"] for r in metrics(run)) >= 5):
        assert all(p.poll() is None for p in procs), "a launcher ended before the kill"
        time.sleep(0.05)
    kill_all(procs)
    resumed_at = max(complete_steps(run))
    assert resumed_at < steps and not (run / "final").exists(), "killed mid-run"
    records = read_log(logs)
    counted = {r["node"] for r in records if r["what"] == "count"}
    rank0_node = {r["node"] for r in records if r["rank"] == 0}
    assert len(rank0_node) == 1 and counted == rank0_node, "counted once, by global rank 0"
    assert [bool(list(c.rglob("*.npy"))) for c in caches] == [f"node{n}" in rank0_node for n in (0, 1)]

    wait_all(two_nodes(tiny_student, micro_scored, tmp_path, "killed", steps, caches, tmp_path / "r2"), tmp_path)
    rerun = read_log(tmp_path / "r2")
    assert {r["rank"] for r in rerun if r["what"] == "count"} <= {0}
    if {r["node"] for r in rerun if r["rank"] == 0} == rank0_node:  # rank 0 on the node whose cache has the counts
        assert not [r for r in rerun if r["what"] == "count"], "counts read from rank 0's node-local cache"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"checkpoint-{resumed_at}") and summary["steps"] == steps
    straight = tmp_path / "straight"
    keys = (*EXACT, *CLOSE)
    assert [{k: r[k] for k in keys} for r in metrics(run)] == [{k: r[k] for k in keys} for r in metrics(straight)]
    a, b = load_file(run / "final" / "model.safetensors"), load_file(straight / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"largest relative difference from one process: {assert_like_one_process(run, reference, steps):.3g}")


RANK_ZERO_WORKER = """
import json, os, sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from pipeline.student_data.lengths import _on_rank_zero
from storage_schemas.reader import BadShardError

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
calls, record = [], {}

def counts():
    calls.append("counts")
    return [np.arange(5, dtype=np.int32), "shard-000001.parquet: unreadable"]

def fails():
    calls.append("fails")
    raise BadShardError("shard-000007.parquet: row group 0 cannot be read")

got = _on_rank_zero(counts)
record["counts"] = [g.tolist() if isinstance(g, np.ndarray) else g for g in got]
try:
    _on_rank_zero(fails)
    record["fails"] = "returned"
except BadShardError as exc:
    record["fails"] = f"BadShardError: {exc}"
record["calls"] = calls
Path(out, f"{rank}.json").write_text(json.dumps(record))
torch.distributed.destroy_process_group()
"""


def test_rank_zero_computes_and_every_rank_gets_its_result_or_its_error(tmp_path):
    """Two real gloo processes: only rank 0 runs the computation; rank 1 gets the same value, and
    when rank 0 fails, rank 1 raises the same error instead of waiting for the timeout."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_ZERO_WORKER, str(r), port, str(tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    zero, one = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert zero["calls"] == ["counts", "fails"] and one["calls"] == []
    assert zero["counts"] == one["counts"] == [[0, 1, 2, 3, 4], "shard-000001.parquet: unreadable"]
    assert zero["fails"] == one["fails"] == "BadShardError: shard-000007.parquet: row group 0 cannot be read"
