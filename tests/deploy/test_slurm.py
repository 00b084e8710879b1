"""The Slurm launchers in ``deploy/slurm/``, submitted as they are (``sbatch <file>``) to a real
two-node Slurm on this machine (:mod:`tests.deploy.slurm_cluster`), with the settings a user changes
given as sbatch options (``--nodes=2 --gpus-per-node=0 --cpus-per-task=1``) and environment
variables (``TEACHER``, ``DATA``, ``OUTPUT_ROOT``, ...), and stage settings after the file name.

The references are runs without Slurm: stage 1 by one scorer actor in one local Ray cluster, stage 2
by one process. What a one-host, two-slurmd cluster shows and what it cannot: both Slurm nodes are
the same machine (one IP address, one /tmp, one file system), so the tests prove the Slurm side
(steps, signals, requeue, teardown of every process), that Ray forms two distinct nodes (two raylets,
told apart by the label each launcher gives) with an actor on each, and that torchrun rendezvouses
across two launchers; not networking between hosts, a shared file system's behaviour, or GPUs.

``make test-slurm`` runs this module (as root: it starts the Slurm daemons); ``make test`` leaves it out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from storage_schemas import file_sha256, read_manifest
from tests.deploy.slurm_cluster import missing_tools, start_cluster
from tests.score_teacher.test_score_job import assert_same_dataset

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = REPO / "deploy" / "slurm"
SHARDS = 8
# The embedded default (sample corpus, tiny teacher), cut to 8 shards of 20 documents; one CPU per
# actor, so that each one-CPU Slurm node holds one.
STAGE1 = ["data.limit_docs=160", "data.rows_per_shard=20", "pool.num_cpus=1", "progress=false"]
TWO_NODES = ["--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1"]


@pytest.fixture(scope="module")
def slurm(request):
    if os.geteuid() != 0:
        pytest.skip("the Slurm daemons run as root (make test-slurm, as root)")
    if missing_tools():
        pytest.skip(f"Slurm or MUNGE not installed ({', '.join(missing_tools())}): make test-slurm installs them")
    folder = Path(tempfile.mkdtemp(prefix="vs-"))  # short: Unix socket paths under it stay short
    cluster = start_cluster(folder)
    yield cluster
    cluster.stop()
    if request.session.testsfailed:
        print(f"\nthe Slurm cluster's configuration and logs are kept in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slurm-work")


def launcher_env(slurm, work: Path, **settings: str) -> dict[str, str]:
    """The environment a user sets for the launchers (their settings at the top of the files)."""
    ray_tmp = slurm.folder / "r"
    ray_tmp.mkdir(exist_ok=True)
    return {"PROJECT_DIR": str(REPO), "VENV": str(Path(sys.executable).parents[1]), "LOG_DIR": str(work / "logs"),
            "RAY_TMP": str(ray_tmp), "HF_HUB_OFFLINE": "1", "WAIT_FOR_NODES_S": "120", **settings}


def submit_stage1(slurm, work: Path, output_root: Path, *, options: tuple[str, ...] = (), **env: str) -> int:
    return slurm.sbatch(LAUNCHERS / "score-teacher.sbatch", *STAGE1, f"artifacts_dir={work / 'artifacts'}",
                        options=[*TWO_NODES, f"--output={work}/%x-%j.out", *options], cwd=REPO,
                        env=launcher_env(slurm, work, TEACHER="tiny", DATA="sample", OUTPUT_ROOT=str(output_root), **env))


def dataset(root: Path) -> Path:
    return root / "owm-sample" / "tiny" / "v1"


def job_log(work: Path, name: str, job_id: int) -> str:
    return (work / f"{name}-{job_id}.out").read_text()


def ray_nodes(log: str) -> list[dict[str, str]]:
    """For each attempt the log shows (a requeued job appends), its Ray nodes: Slurm name -> Ray node id."""
    attempts: list[dict[str, str]] = []
    for line in log.splitlines():
        if line.startswith("score-teacher on "):
            attempts.append({})
        elif line.startswith("ray node "):
            name, rest = line[len("ray node "):].split(": ", 1)
            attempts[-1][name] = rest.split()[0]
    return attempts


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def job_processes(slurm, job_id: int) -> dict[int, tuple[int, str]]:
    """``{pid: (parent pid, command line)}`` of every process still running with this job's
    environment: Slurm sets SLURM_JOB_ID in every process of a job, and children inherit it (Ray's
    daemons and workers, torchrun and its workers); SLURM_CONF tells this test cluster's jobs from
    another's."""
    tags = (f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_CONF={slurm.folder / 'slurm.conf'}".encode())
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if all(tag in (proc / "environ").read_bytes().split(b"\0") for tag in tags):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[int(proc.name)] = (int(stat_fields(int(proc.name))[1]), cmdline)
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return found


def assert_nothing_left(slurm, job_id: int) -> None:
    """After the job: none of its processes, and no Ray folder of it under RAY_TMP."""
    deadline = time.monotonic() + 30
    while (left := job_processes(slurm, job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job_id} left: {[f'{pid}: {cmd[:200]}' for pid, (_, cmd) in left.items()]}"
    folders = sorted((slurm.folder / "r").glob(f"ray-{job_id}.*"))
    assert not folders, f"Ray folders of job {job_id} left: {folders}"


def markers(folder: Path) -> dict[int, bytes]:
    return {int(p.name.split("-")[1].split(".")[0]): p.read_bytes() for p in folder.glob("shard-*.done.json")}


def wait_until(predicate, what: str, slurm, job_id: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        state = slurm.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "COMPLETING"), \
            f"job {job_id} is {state} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# Stage 1


@pytest.fixture(scope="module")
def one_process(work) -> Path:
    """The reference: the same settings through the stage's command line, one scorer actor in a
    local Ray cluster, no Slurm. It also builds the embedded default the Slurm jobs then find."""
    out = work / "one-process"
    args = ["teacher=tiny", "data=sample", f"output_root={out}", *STAGE1, f"artifacts_dir={work / 'artifacts'}",
            "pool.num_actors=1", "ray.num_cpus=2", f"hydra.run.dir={work / 'one-process-logs'}"]
    proc = subprocess.run([sys.executable, "-m", "stages.score_teacher", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_manifest(dataset(out))["complete"]
    return dataset(out)


@pytest.fixture(scope="module")
def two_node_run(slurm, work, one_process) -> tuple[int, Path]:
    """The job's user has a Ray token of their own in ~/.ray (as ``ray.init()`` leaves one), which
    makes Ray 2.60's ``ray start --head`` ask for it while ``ray start --address`` does not send it:
    the launcher's token of the job must hold for every node."""
    out, home = work / "two-nodes", work / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0" * 64)
    job_id = submit_stage1(slurm, work, out, HOME=str(home))
    job = slurm.wait_until_done(job_id, timeout=1200)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_log(work, "score-teacher", job_id)
    return job_id, dataset(out)


def test_stage1_on_two_nodes_equals_one_process(slurm, work, one_process, two_node_run):
    job_id, out = two_node_run
    (nodes,) = ray_nodes(job_log(work, "score-teacher", job_id))
    assert sorted(nodes) == ["node1", "node2"] and len(set(nodes.values())) == 2, nodes
    summary = json.loads((work / "logs" / f"score-teacher-{job_id}" / "driver.0" / "summary.json").read_text())
    assert sorted(a["node_id"] for a in summary["actors"]) == sorted(nodes.values()), "one actor on each Ray node"
    scored_on = {json.loads(m)["scored_by"]["node_id"] for m in markers(out).values()}
    assert scored_on <= set(nodes.values())
    assert summary["shards_scored"] == SHARDS and summary["complete"]
    assert_same_dataset(out, one_process)
    assert_nothing_left(slurm, job_id)


def test_scancel_then_preemption_and_requeue_score_each_shard_once(slurm, work, one_process):
    """Job A is cancelled (``scancel``) while shard 3 hangs on purpose, the 7 others done; job B,
    the same submitted again, is requeued (``scontrol requeuehold``: SIGTERM to all its processes,
    SIGKILL after KillWait, back to the queue, as a preemption with requeue does; held until its
    processes are gone, so that the hang is released only for the next attempt) while shard 3
    hangs again. B's second attempt scores shard 3 alone. The shards finished before the kills keep
    their markers byte for byte (naming job A's Ray nodes), and the dataset equals one process's."""
    out_root, counter, release = work / "killed", work / "fault-tries", work / "release-shard-3"
    out = dataset(out_root)
    faults = json.dumps({"counter_dir": str(counter),
                         "shards": {"3": {"error": "hang", "times": 1000, "release": str(release)}}})
    tries = lambda: len(list(counter.glob("shard-3.try-*")))  # noqa: E731
    others_done = lambda: sorted(markers(out)) == [i for i in range(SHARDS) if i != 3]  # noqa: E731

    first = submit_stage1(slurm, work, out_root, VOCAGNO_INJECT_FAULTS=faults)
    wait_until(lambda: tries() and others_done(), "7 shards done and shard 3 hanging", slurm, first)
    before = markers(out)
    slurm.run("scancel", str(first))
    job = slurm.wait_until_done(first)
    assert job["JobState"] == "CANCELLED", job
    assert "interrupted (SIGTERM): stopped" in job_log(work, "score-teacher", first)
    assert_nothing_left(slurm, first)
    assert markers(out) == before and 3 not in before
    manifest = read_manifest(out)
    assert not manifest["complete"] and sorted(e["index"] for e in manifest["shards"]) == sorted(before)
    for entry in manifest["shards"]:  # each listed shard whole
        path = out / entry["file"]
        assert path.stat().st_size == entry["bytes"] and file_sha256(path) == entry["sha256"]
    assert not (out / ".lock").exists(), "the folder's lock was released"

    tried_in_a = tries()
    second = submit_stage1(slurm, work, out_root, VOCAGNO_INJECT_FAULTS=faults)
    wait_until(lambda: tries() > tried_in_a, "shard 3 hanging again", slurm, second)
    slurm.run("scontrol", "requeuehold", str(second))
    wait_until(lambda: slurm.job(second)["Restarts"] == "1" and slurm.job(second)["JobState"] == "PENDING"
               and not job_processes(slurm, second), "the first attempt gone", slurm, second)
    assert_nothing_left(slurm, second)
    release.touch()
    slurm.run("scontrol", "release", str(second))
    slurm.run("scontrol", "update", f"JobId={second}", "StartTime=now")  # not Slurm's 2 min wait after a requeue
    job = slurm.wait_until_done(second, timeout=1200)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        job_log(work, "score-teacher", second)
    assert_nothing_left(slurm, second)

    after = markers(out)
    assert {i: after[i] for i in before} == before, "the shards done before the kills were not scored again"
    attempts = ray_nodes(job_log(work, "score-teacher", second))
    assert len(attempts) == 2 and all(sorted(a) == ["node1", "node2"] for a in attempts)
    assert json.loads(after[3])["scored_by"]["node_id"] in attempts[1].values(), "shard 3 by the requeued attempt"
    logs = work / "logs" / f"score-teacher-{second}"
    summary = json.loads((logs / "driver.1" / "summary.json").read_text())
    assert (summary["shards_done_before"], summary["shards_scored"]) == (SHARDS - 1, 1)
    assert not (logs / "driver.0" / "summary.json").exists(), "the first attempt was stopped"
    assert_same_dataset(out, one_process)


def test_a_node_that_never_joins_ends_the_job_naming_it(slurm, work):
    """node2's tasks see no environment (VENV points nowhere there), so its Ray node never starts:
    the wait gives up after WAIT_FOR_NODES_S with one line naming node2; nothing is scored."""
    out_root = work / "never-joins"
    slurm.break_node("node2", True)
    try:
        job_id = submit_stage1(slurm, work, out_root, WAIT_FOR_NODES_S="15")
        job = slurm.wait_until_done(job_id)
    finally:
        slurm.break_node("node2", False)
    log = job_log(work, "score-teacher", job_id)
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "2:0"), log
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "1 of 2 nodes did not join" in errors[0], log
    assert "within 15 s: node2 (joined: node1)" in errors[0] and f"score-teacher-{job_id}/ray-node2.0.log" in errors[0]
    assert "Traceback" not in log
    assert not (work / "logs" / f"score-teacher-{job_id}" / "driver.0").exists() and not out_root.exists()
    assert_nothing_left(slurm, job_id)


# ---------------------------------------------------------------------------------------------
# Stage 2

STEPS = 8
# The embedded tiny student on the two-node scored sample: 8 steps of 8 sequences of 64 tokens
# (micro-batches of 2: one process accumulates 4, each of two processes 2).
STAGE2 = ["student.seq_len=64", "train.micro_batch_size=2", "train.global_batch_tokens=512", f"train.max_steps={STEPS}",
          "train.warmup_steps=2", "train.learning_rate=3e-3", "train.min_learning_rate=3e-4", "train.logging_steps=1",
          "train.save_steps=3", "train.use_cpu=true", "train.cpu_threads=1",
          "train.report_to=[]", "train.progress=false", "data.num_workers=1"]


def training_processes(slurm, job_id: int) -> tuple[set[int], list[int]]:
    """The job's training processes (the ones torchrun starts and their data-loader workers;
    torchrun itself, srun and the batch script are left out) and, among them, torchrun's children."""
    procs = job_processes(slurm, job_id)
    ours = {pid: ppid for pid, (ppid, cmd) in procs.items() if "stages.train_student" in cmd and "torchrun" not in cmd}
    torchruns = {pid for pid, (_, cmd) in procs.items() if "torchrun" in cmd}
    return set(ours), [pid for pid, ppid in ours.items() if ppid in torchruns]


def signal_all(pids, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_stopped(pids: list[int], timeout: float = 10) -> None:
    """Until each of ``pids`` is stopped (state T in /proc/<pid>/stat) or gone."""
    def stopped(pid: int) -> bool:
        try:
            return stat_fields(pid)[0] in ("T", "t", "Z", "X")
        except (OSError, IndexError):
            return True

    deadline = time.monotonic() + timeout
    while not all(stopped(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} never stopped"
        time.sleep(0.005)


@contextlib.contextmanager
def trainers_held(slurm, job_id: int, ready, timeout: float = 900):
    """Hold the job's training processes (SIGSTOP) at the first moment ``ready()`` is true, yield
    torchrun's children, SIGCONT them all on the way out; torchrun, srun and the batch script keep
    running, so a signal gets through. A step of a tiny run is shorter than one look at the run's
    files, so the run is never watched while it runs: it is stopped, looked at, and let go for
    20 ms at a time, so it moves at most a step or so between two looks."""
    deadline = time.monotonic() + timeout
    found = (set(), [])

    def started() -> bool:
        nonlocal found
        found = training_processes(slurm, job_id)
        return len(found[1]) >= 2

    wait_until(started, "the training processes", slurm, job_id, timeout)
    held, trainers = found
    assert len(trainers) == 2, f"one training process per node expected: {job_processes(slurm, job_id)}"
    try:
        while True:
            signal_all(held, signal.SIGSTOP)
            more, _ = training_processes(slurm, job_id)  # data-loader workers started since the last look
            signal_all(more - held, signal.SIGSTOP)
            held |= more
            wait_stopped(trainers)
            if ready():
                break
            assert all(Path(f"/proc/{pid}").exists() for pid in trainers), "the run ended before it was held"
            assert time.monotonic() < deadline, "timed out waiting for the run to be ready"
            signal_all(held, signal.SIGCONT)
            time.sleep(0.02)
        yield trainers
    finally:
        signal_all(held, signal.SIGCONT)


def wait_for_pending_term(pids: list[int], timeout: float = 120) -> None:
    """Until SIGTERM is pending in each of ``pids`` (``ShdPnd``/``SigPnd`` of /proc/<pid>/status)."""
    bit = 1 << (signal.SIGTERM - 1)

    def pending(pid: int) -> bool:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return bool((int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)) & bit)

    deadline = time.monotonic() + timeout
    while not all(pending(pid) for pid in pids):
        assert time.monotonic() < deadline, "SIGTERM never reached the training processes"
        time.sleep(0.2)


def stage2_settings(work: Path) -> list[str]:
    return [*STAGE2, f"artifacts_dir={work / 'artifacts'}", f"data.cache_dir={work / 'lengths'}"]


def test_stage2_on_two_nodes_killed_and_resubmitted_logs_the_losses_of_one_process(slurm, work, two_node_run):
    """torchrun on both nodes (rendezvous on node1), stopped after a checkpoint by a SIGTERM to the
    batch script alone (``scancel --batch``, as ``--signal=B:TERM@<s>`` sends before a time limit),
    which passes it on to every process, and submitted again: the run resumes from its newest
    complete checkpoint, and its steps (the first ones from the first job, the rest from the
    second) log what one process logs: samples, schedule and selection exactly, losses and norms to
    1e-4 relative (tests/train_student/test_multinode.py)."""
    from tests.train_student.test_multinode import assert_like_one_process, complete_steps
    from tests.train_student.test_train_student import metrics

    scored_root = two_node_run[1].parents[2]
    reference_root = work / "students-one-process"
    proc = subprocess.run([sys.executable, "-m", "stages.train_student", f"scored_root={scored_root}",
                           f"student_root={reference_root}", *stage2_settings(work),
                           f"hydra.run.dir={work / 'one-process-train-logs'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = reference_root / "owm-sample" / "tiny-tiny-guided"

    student_root = work / "students"
    run = student_root / "owm-sample" / "tiny-tiny-guided"
    env = launcher_env(slurm, work, EXPERIMENT="", SCORED_ROOT=str(scored_root), STUDENT_ROOT=str(student_root))

    def submit() -> int:
        return slurm.sbatch(LAUNCHERS / "train-student.sbatch", *stage2_settings(work), cwd=REPO, env=env,
                            options=[*TWO_NODES, f"--output={work}/%x-%j.out"])

    def checkpoint_and_a_step_after_it() -> bool:
        try:
            return bool(complete_steps(run)) and (run / "metrics.jsonl").exists() \
                and max(r["step"] for r in metrics(run)) > max(complete_steps(run))
        except ValueError:  # a metrics line half written when the run was stopped
            return False

    first = submit()
    # A step of this tiny run takes ~0.1 s, less than the signal's way through Slurm: the training
    # processes are held (SIGSTOP) from a moment after a complete checkpoint until the SIGTERM waits
    # in each, so the run is stopped mid-way.
    with trainers_held(slurm, first, checkpoint_and_a_step_after_it) as trainers:
        slurm.run("scancel", "--batch", "--signal=TERM", str(first))  # the batch script passes it on to each step
        wait_for_pending_term(trainers)
    job = slurm.wait_until_done(first)
    assert job["JobState"] != "COMPLETED", job
    assert_nothing_left(slurm, first)
    resumed_at = max(complete_steps(run))
    assert resumed_at < STEPS and not (run / "final").exists(), "cancelled mid-run"

    second = submit()
    job = slurm.wait_until_done(second, timeout=1200)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_log(work, "train-student", second)
    assert_nothing_left(slurm, second)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"checkpoint-{resumed_at}") and summary["steps"] == STEPS
    print(f"largest relative difference from one process: {assert_like_one_process(run, reference, STEPS):.3g}")
    ranks = sorted(p.name for p in (work / "logs" / f"train-student-{second}" / "train.0").iterdir())
    assert ranks == ["rank-0", "rank-1"], "two processes: one torchrun per node, one process each"
