"""A real two-node Slurm on this one machine, for the launcher tests: its own munged, slurmctld and
two slurmd (``node1``, ``node2``: two NodeNames on 127.0.0.1 with ports of their own), all started
from a folder of the test's with a configuration written there and stopped by their process ids.
Nothing of the machine's own Slurm or MUNGE set-up is used or changed (``SLURM_CONF`` points the
clients at the folder's configuration). Needs root and Debian's ``slurm-wlm`` and ``munge``
(``make test-slurm`` installs them).

Each slurmd runs every task of its node with ``TaskProlog`` (``task-prolog.sh``): while the file
``break-<node>`` exists in the folder, the tasks of that node get ``VENV`` pointing at a folder that
does not exist, as on a node that does not mount the project's environment.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

NODES = ("node1", "node2")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE"}

CONF = """\
ClusterName=vocagnotest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={folder}/task-prolog.sh
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait={kill_wait}
MinJobAge=3600
SlurmdParameters=config_overrides
{nodes}
PartitionName=test Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""

TASK_PROLOG = """\
#!/bin/sh
# Runs before every task; "export NAME=value" lines set the task's environment.
if [ -e "{folder}/break-$SLURMD_NODENAME" ]; then
    echo "export VENV={folder}/no-such-venv"
fi
"""


def missing_tools() -> list[str]:
    return [tool for tool in DAEMONS if shutil.which(tool) is None]


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class SlurmCluster:
    folder: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.folder / "slurm.conf")}

    def run(self, *command: str, check: bool = True) -> str:
        proc = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, script: Path, *args: str, options: list[str], env: dict[str, str], cwd: Path) -> int:
        """Submit ``script`` as it is, with sbatch ``options`` and the settings in ``env`` (its
        environment, on top of this process's); returns the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], cwd=cwd,
                              env={**self.env, **env}, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, NodeList, ...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for(self, job_id: int, states: set[str], timeout: float = 600) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["JobState"] in states:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['JobState']} after {timeout} s (waiting for {states})")
            time.sleep(0.5)

    def wait_until_done(self, job_id: int, timeout: float = 600) -> dict[str, str]:
        """Wait until the job has ended and every process of it is gone (state no longer COMPLETING)."""
        job = self.wait_for(job_id, FINAL_STATES, timeout)
        deadline = time.monotonic() + 120
        while "COMPLETING" in self.run("squeue", "--noheader", "--jobs", str(job_id), "--format=%T", check=False):
            assert time.monotonic() < deadline, f"job {job_id} still completing"
            time.sleep(0.5)
        return job

    def break_node(self, node: str, broken: bool) -> None:
        flag = self.folder / f"break-{node}"
        flag.touch() if broken else flag.unlink(missing_ok=True)

    def stop(self) -> None:
        """Cancel this cluster's jobs (a job outlives a stopped slurmd), then stop the daemons it
        started, by the process ids in their pid files."""
        if (self.folder / "slurmctld.pid").exists():
            self.run("scancel", f"--user={os.getuid()}", check=False)
            deadline = time.monotonic() + 60
            while self.run("squeue", "--noheader", check=False).strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        pid_files = [self.folder / f"slurmd-{n}.pid" for n in NODES]
        pid_files += [self.folder / "slurmctld.pid", self.folder / "munge" / "munged.pid"]
        for pid_file in pid_files:
            try:
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
            except (FileNotFoundError, ValueError, ProcessLookupError):
                continue
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)


def start_cluster(folder: Path, cpus_per_node: int = 2, kill_wait_s: int = 10) -> SlurmCluster:
    """Write the configuration into ``folder`` and start munged, slurmctld and the two slurmd."""
    for sub in ("state", "spool", "munge"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    munge = folder / "munge"
    for path in (folder, munge):  # munged insists that every folder above its socket be reachable by all
        path.chmod(0o755)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    prolog = folder / "task-prolog.sh"
    prolog.write_text(TASK_PROLOG.format(folder=folder))
    prolog.chmod(0o755)
    ctld_port, *node_ports = free_ports(1 + len(NODES))
    nodes = "\n".join(f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={p} "
                      f"CPUs={cpus_per_node} State=UNKNOWN" for n, p in zip(NODES, node_ports))
    (folder / "slurm.conf").write_text(CONF.format(
        host=socket.gethostname(), ctld_port=ctld_port, folder=folder, nodes=nodes, node_list=",".join(NODES),
        kill_wait=kill_wait_s))
    cluster = SlurmCluster(folder)
    try:
        cluster.run("munged", f"--socket={munge}/munge.socket", f"--key-file={key}", f"--pid-file={munge}/munged.pid",
                    f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed")
        cluster.run("slurmctld", "-f", str(folder / "slurm.conf"))
        for node in NODES:
            cluster.run("slurmd", "-f", str(folder / "slurm.conf"), "-N", node)
        deadline = time.monotonic() + 60
        while True:
            states = cluster.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).split()
            if states.count("idle") == len(NODES):
                return cluster
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm nodes did not come up: {states}; logs in {folder}")
            time.sleep(0.5)
    except BaseException:
        cluster.stop()
        raise
