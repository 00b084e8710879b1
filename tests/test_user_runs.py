"""A user's own corpus through the command line, as the README writes it (``data=open-web-math
data.name=... data.source=files 'data.files=[...]'``), scored with the tiny preset's settings at a
window of the user's choosing, then exported and trained on: what the dataset card claims, the
window plan, the threads the actors use, and that a run prints only the project's own lines.
The micro teacher and student stand in for the embedded ones (built in seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "VOCAGNO_TRACEBACK": ""}
# What third-party libraries printed on every run before it was silenced at its source.
NOISE = ("Token authentication", "\x1b[", "Loading weights", "Writing model shards", "pin_memory",
         "mtime may not be reliable", "Traceback")


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=600)


def front_matter(card: Path) -> dict:
    return yaml.safe_load(card.read_text().split("---\n", 2)[1])


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("project")


@pytest.fixture(scope="module")
def own_corpus(micro_teacher, micro_corpus, project):
    """Stage 1 on 40 documents of the user's file, the tiny preset with ``teacher.window=32``, one
    actor given 4 CPUs of a local Ray cluster that says it has 4."""
    args = ["data=open-web-math", "data.name=spacey", "data.source=files", f"data.files=[{micro_corpus[0]}]",
            "data.limit_docs=40", "data.rows_per_shard=20", "teacher=tiny", "teacher.embedded=false",
            "teacher.name=micro", f"teacher.model={micro_teacher}", "teacher.window=32", "teacher.num_cpus=4",
            "ray.num_cpus=4", "progress=false", f"output_root={project / 'scored'}",
            f"artifacts_dir={project / 'artifacts'}"]
    first = run("stages.score_teacher", *args, f"hydra.run.dir={project / 'logs' / 'first'}")
    assert first.returncode == 0, first.stderr[-3000:]
    return project / "scored" / "spacey" / "micro" / "v1", args, first


def test_a_real_stage1_run_prints_only_the_projects_lines(own_corpus):
    _, _, first = own_corpus
    assert not [n for n in NOISE if n in first.stderr], first.stderr[-3000:]
    assert first.stderr == "", "with progress=false a successful run writes nothing to stderr"
    assert "score-teacher" in first.stdout and "complete" in first.stdout


def test_a_window_of_your_own_gets_half_of_it_as_stride(own_corpus):
    folder, _, _ = own_corpus
    windows = json.loads((folder / "manifest.json").read_text())["identity"]["windows"]
    assert windows == {"window": 32, "stride": 16, "min_left_context": 16}


def test_an_actor_uses_the_cpus_it_was_given_never_more_than_the_cores(own_corpus, project):
    (actor,) = json.loads((project / "logs" / "first" / "summary.json").read_text())["actors"]
    cores = max(1, len(os.sched_getaffinity(0)) * psutil.cpu_count(logical=False) // psutil.cpu_count())
    assert actor["torch_threads"] == min(4, cores)  # physical cores (hyperthreads of a core count once)


@pytest.fixture(scope="module")
def licensed(own_corpus, project):
    """The card before, then the same command again with ``data.license=cc-by-4.0``."""
    folder, args, _ = own_corpus
    before = {"meta": front_matter(folder / "README.md"), "card": (folder / "README.md").read_text(),
              "identity": json.loads((folder / "manifest.json").read_text())["identity"]}
    given = run("stages.score_teacher", *args, "data.license=cc-by-4.0",
                f"hydra.run.dir={project / 'logs' / 'license'}")
    return folder, before, given


def test_a_corpus_from_files_has_no_license_until_one_is_given(licensed):
    folder, before, given = licensed
    assert "license" not in before["meta"] and "source_datasets" not in before["meta"], before["meta"]
    assert "| license | not given: set `data.license=<id>`" in before["card"]
    assert given.returncode == 0, given.stderr[-3000:]
    assert "0 scored now, 2 already done" in given.stdout
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["license"] == "cc-by-4.0" and manifest["identity"] == before["identity"], "not in the identity"
    meta = front_matter(folder / "README.md")
    assert meta["license"] == "cc-by-4.0" and "source_datasets" not in meta and "language" not in meta


def test_the_export_states_the_corpus_license_and_prints_only_its_own_lines(licensed, tiny_student, project):
    folder, _, _ = licensed
    out = project / "export"
    res = run("stages.export_student", "student.embedded=false", f"student.model={tiny_student}", "student.seq_len=32",
              f"data.folders=[{folder}]", f"data.cache_dir={project / 'lengths'}", "export.progress=false",
              f"output_dir={out}", f"hydra.run.dir={project / 'logs' / 'export'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr == "", res.stderr[-3000:]
    meta = front_matter(out / "README.md")
    assert meta["license"] == "cc-by-4.0" and "source_datasets" not in meta
    assert "The corpus's license, `cc-by-4.0`, applies to this export too." in (out / "README.md").read_text()


def test_a_real_stage2_run_prints_only_the_projects_lines(own_corpus, tiny_student, project):
    folder, _, _ = own_corpus
    res = run("stages.train_student", "student.embedded=false", f"student.model={tiny_student}", "student.seq_len=32",
              f"data.folders=[{folder}]", f"data.cache_dir={project / 'lengths'}", "train.max_steps=4",
              "train.save_steps=2", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1",
              "train.logging_steps=2", "train.progress=false", f"output_dir={project / 'run'}",
              f"hydra.run.dir={project / 'logs' / 'train'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not [n for n in NOISE if n in res.stderr], res.stderr[-3000:]
    assert res.stderr == "", "with train.progress=false a successful run writes nothing to stderr"
    # every 2 steps, and step 3: the last stable step of the embedded recipe's wsd schedule (stable/)
    assert sorted(p.name for p in (project / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3",
                                                                              "checkpoint-4"]
    assert (project / "run" / "stable").is_dir()


def test_the_same_corpus_cut_at_another_limit_is_named_as_the_limit_not_another_corpus(own_corpus, micro_corpus,
                                                                                         project):
    """Both files listed and data.limit_docs=100: the limit now reaches the second file, whose digest
    the folder's identity lacks; the refusal names the limit, before any work."""
    folder, args, _ = own_corpus
    changed = [a for a in args if not a.startswith(("data.files=", "data.limit_docs="))]
    res = run("stages.score_teacher", *changed, f"data.files=[{micro_corpus[0]},{micro_corpus[1]}]",
              "data.limit_docs=100", f"hydra.run.dir={project / 'logs' / 'limit'}")
    assert res.returncode == 2, res.stderr[-3000:]
    assert ("That folder holds corpus 'spacey' scored with data.limit_docs=40, this run asks for data.limit_docs=100: "
            "give data.limit_docs=40 to go on with it, or overwrite=true (below) to score the new limit there."
            ) in res.stderr.splitlines(), res.stderr
    assert "another corpus" not in res.stderr


ACTOR_SPEAKS = """
import ray
from pipeline.score_teacher.ray_cluster import RayConfig, init_ray
init_ray(RayConfig(num_cpus=1))

@ray.remote
def speak():
    print("a line from an actor", flush=True)

ray.get(speak.remote())
import time; time.sleep(2)  # the driver prints the actors' lines as they come
ray.shutdown()
"""


def test_ray_started_by_the_job_passes_actor_lines_as_plain_text(tmp_path):
    """The job's local cluster: no note that token authentication is on (it is, by default), and an
    actor's line on the driver's terminal without colour codes around its prefix."""
    env = {k: v for k, v in ENV.items() if k not in ("RAY_COLOR_PREFIX", "RAY_AUTH_MODE")}
    res = subprocess.run([sys.executable, "-c", ACTOR_SPEAKS], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if "a line from an actor" in ln]
    assert lines and lines[0].startswith("(speak pid=") and "\x1b[" not in lines[0], res.stdout + res.stderr
    assert "Token authentication" not in res.stderr, res.stderr
