"""torch's threads never outnumber the cores a process may use: the rule (pipeline.runtime.cpu_threads) on a
machine of 4 usable cores, a cgroup quota read from its files, and the threads a real stage-2 run
trains with. The machine's affinity is replaced where the rule needs other cores than this one has."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
from transformers import TrainerCallback

from pipeline.runtime import cpu_threads
from pipeline.runtime.cpu_threads import cgroup_quota, threads_for, usable_cores


def physical_cores() -> int:
    """This process's CPUs counted as physical cores (hyperthreads of one core count once)."""
    return max(1, len(os.sched_getaffinity(0)) * psutil.cpu_count(logical=False) // psutil.cpu_count())


@pytest.fixture
def four_cores(monkeypatch, tmp_path):
    """A process that may run on 4 CPUs of a machine without hyperthreads, under no cgroup quota
    (this machine's may differ)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16)
    monkeypatch.setattr(cpu_threads, "CGROUP", tmp_path / "no-cgroup")


def test_the_threads_are_what_was_given_never_more_than_the_cores(four_cores):
    assert usable_cores() == 4
    assert [threads_for(c) for c in (None, 1, 2, 4, 8, 0.5)] == [4, 1, 2, 4, 4, 1]
    assert [threads_for(None, sharing=n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    assert threads_for(4, sharing=2) == 2


def test_hyperthreads_of_one_core_count_once(four_cores, monkeypatch):
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 8)  # 2 threads a core
    assert usable_cores() == 2 and threads_for(4) == 2


def test_a_cgroup_quota_lowers_the_cores(four_cores, monkeypatch, tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2 cores' worth of threads
    assert cgroup_quota(v2) == 2
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(v1) == 1
    monkeypatch.setattr(cpu_threads, "CGROUP", v1)
    assert usable_cores() == 1 and threads_for(8) == 1


class Threads(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(torch.get_num_threads())


@pytest.mark.parametrize("local_processes", [1, 2])
def test_stage2_trains_with_at_most_its_share_of_the_cores(tiny_student, micro_scored, tmp_path, monkeypatch,
                                                          local_processes):
    """train.cpu_threads=64 asks for more than any core count here; a data-parallel process gets its share."""
    from pipeline.train_student.config import DataConfig, StudentConfig, TrainConfig, TrainJobConfig
    from pipeline.train_student.run import run_training

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_processes))
    job = TrainJobConfig(
        student=StudentConfig(name="t", model=str(tiny_student), seq_len=32),
        data=DataConfig(folders=[str(micro_scored)], cache_dir=str(tmp_path / "lengths"), num_workers=0),
        train=TrainConfig(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=2, save_steps=100,
                          report_to=[], progress=False, use_cpu=True, cpu_threads=64),
        output_dir=str(tmp_path / "run"))
    before = torch.get_num_threads()
    seen = Threads()
    run_training(job, callbacks=[seen])
    assert seen.seen == [max(1, physical_cores() // local_processes)] * 2
    assert torch.get_num_threads() == before, "restored after training"
