"""Mutation testing of the core: does the default suite fail when the core is broken?

Each mutant in ``mutants.toml`` (next to this file) replaces one exact snippet of one file with a
plausible bug. The runner copies the repository's working tree (tracked and untracked, not ignored
files) into a temporary folder once, and for every mutant writes the mutated file into that copy,
runs the mutant's focused subset of the default suite there (``pytest -x -m "not slow"``, first
failure stops it), and restores the file. The working tree is never modified. A mutant is

* ``killed`` when the tests fail (or time out),
* ``survived`` when they pass,
* ``equivalent`` when it survives and the table says why it cannot be told apart from the
  original (a mutant marked equivalent that is killed is reported as killed, and as a wrong entry),
* ``error`` when its snippet is not found exactly once, the mutated file does not compile, or a
  test path it names does not exist: the table needs updating after the code moved.

Before the mutants, the union of their tests runs on the unmutated copy (the baseline): a mutant
only counts as killed if those tests pass without it. Results go to ``mutation-results/latest.json``
and ``latest.md``. The exit status is 0 when every mutant is killed or listed as equivalent.

    python -m mutation                  # everything (make mutation)
    python -m mutation only=[W1,T1]     # some mutants (make mutation ARGS="only=[W1,T1]")
    python -m mutation check=true       # only check the table: every snippet found once, every test path there

Settings: :class:`MutationConfig` (``conf/mutation.yaml`` overrides it).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from pipeline.runtime.config import ConfigError, build, raise_if
from stages.common import entry_point

REPO = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).resolve().parent / "mutants.toml"
RESULTS = REPO / "mutation-results"


@dataclass(frozen=True)
class MutationConfig:
    only: list[str] = field(default_factory=list)  # mutant ids; empty: every mutant
    check: bool = False  # only check the table (table_problems), run nothing
    baseline: bool = True  # first run the mutants' tests on the unmutated copy
    timeout: float = 600.0  # seconds per mutant before it counts as killed
    write: bool = True  # false: print only, leave mutation-results/ alone (also with only=[...])

    def problems(self) -> list[str]:
        return [] if self.timeout > 0 else [f"timeout: {self.timeout} must be > 0"]


def mutation_config(cfg: DictConfig) -> MutationConfig:
    """The typed settings, the mutant ids checked against the table; every problem at once."""
    from omegaconf import OmegaConf

    problems: list[str] = []
    values = OmegaConf.to_container(cfg, resolve=True)
    typed = build(MutationConfig, values, "", problems)
    known = [m.id for m in load_mutants()]
    only = values.get("only") if isinstance(values.get("only"), list) else []
    problems += [f"only: {i!r} is not a mutant id of {TABLE.name}" for i in only if i not in known]
    raise_if(problems)
    return typed


@dataclass
class Mutant:
    id: str
    area: str
    file: str
    original: str
    replacement: str
    tests: list[str]
    what: str
    equivalent: str | None = None
    status: str = ""
    detail: str = ""
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def load_mutants(path: Path = TABLE) -> list[Mutant]:
    table = tomllib.loads(path.read_text())
    mutants = [Mutant(**entry) for entry in table["mutant"]]
    ids = [m.id for m in mutants]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ConfigError(f"{path}: duplicate mutant ids {duplicates}")
    return mutants


def table_problems(mutants: list[Mutant], root: Path = REPO) -> list[tuple[str, str]]:
    """``(mutant id, problem)`` for every mutant that no longer applies to the tree at ``root``:
    its file is gone, its snippet is not found exactly once or the mutated file does not compile,
    or a test path it names does not exist."""
    found = []
    for m in mutants:
        path = root / m.file
        problem = snippet_problem(m, path.read_text()) if path.is_file() else f"{m.file}: no such file: update the table"
        if problem:
            found.append((m.id, problem))
        found += [(m.id, f"tests: {t} does not exist: update the table") for t in m.tests
                  if not (root / t.split("::")[0]).exists()]
    return found


def snippet_problem(m: Mutant, source: str) -> str | None:
    """Why the mutant cannot be applied to ``source`` (None when it can)."""
    count = source.count(m.original)
    if count != 1:
        return f"{m.file}: the original snippet occurs {count} times (expected once): update the table"
    if m.original == m.replacement:
        return "replacement equals the original"
    try:
        compile(source.replace(m.original, m.replacement), m.file, "exec")
    except SyntaxError as exc:
        return f"the mutated {m.file} does not compile: {exc}"
    return None


def copy_working_tree(dest: Path) -> None:
    """The files git would see (tracked, and untracked but not ignored) of the working tree."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    shared = REPO.parent / "shared"  # the tests find real tokenizers at <repository>/../shared
    if shared.exists():
        (dest.parent / "shared").symlink_to(shared.resolve())


def run_tests(copy: Path, tests: list[str], timeout: float, ray_tmp: Path) -> tuple[int | None, str, float]:
    """pytest in the copy; returns (exit status or None on timeout, output, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "RAY_TMPDIR": str(ray_tmp),
           "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-m", "not slow", "-p", "no:cacheprovider",
           "--hypothesis-seed=0", *tests]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the test process and what it started (its Ray cluster)
        out, _ = proc.communicate()
        code = None
    except BaseException:  # interrupted: take the tests down with the runner
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return code, out, time.monotonic() - t0


def failed_tests(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)


def check_import_location(copy: Path) -> None:
    """The copy's modules, not the installed working tree's, must be the ones imported."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    where = subprocess.run([sys.executable, "-c", "import pipeline, storage_schemas; print(pipeline.__file__); "
                            "print(storage_schemas.__file__)"], cwd=copy, env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    if not all(Path(w).resolve().is_relative_to(copy.resolve()) for w in where):
        raise SystemExit(f"the temporary copy is not what Python imports: {where}")


def run(mutants: list[Mutant], timeout: float, baseline: bool) -> dict:
    started = time.monotonic()
    state = working_tree_state()  # what the copy is made of, before anything can change it
    base = Path(tempfile.mkdtemp(prefix="vm-"))
    copy = base / "repo"
    copy.mkdir()
    try:
        copy_working_tree(copy)
        check_import_location(copy)
        for mid, problem in table_problems(mutants, copy):
            m = next(m for m in mutants if m.id == mid)
            m.status, m.detail = "error", "; ".join(filter(None, [m.detail, problem]))
        sources = {m.file: (copy / m.file).read_text() for m in mutants if not m.status}
        runnable = [m for m in mutants if not m.status]
        baseline_result = None
        if baseline and runnable:
            tests = list(dict.fromkeys(t for m in runnable for t in m.tests))
            print(f"baseline: {len(tests)} test paths on the unmutated copy ...", flush=True)
            code, out, seconds = run_tests(copy, tests, 4 * timeout, base / "ray")
            baseline_result = {"tests": tests, "exit": code, "seconds": round(seconds, 1), "failed": failed_tests(out)}
            print(f"baseline: exit {code} in {seconds:.0f} s", flush=True)
            if code != 0:
                print(out[-5000:])
                raise SystemExit("the focused tests fail without any mutant: fix that first")
        for n, m in enumerate(runnable, 1):
            target = copy / m.file
            target.write_text(sources[m.file].replace(m.original, m.replacement))
            try:
                code, out, m.seconds = run_tests(copy, m.tests, timeout, base / "ray")
            finally:
                target.write_text(sources[m.file])
            m.failed = failed_tests(out)
            if code is None:
                m.status, m.detail = "killed", f"timed out after {timeout:.0f} s"
            elif code == 0:
                m.status = "equivalent" if m.equivalent else "survived"
                m.detail = m.equivalent or "the focused tests pass with this bug"
            elif code in (1, 2, 3):  # test failures, interrupted, internal error
                m.status = "killed"
                m.detail = ", ".join(m.failed[:3]) or out.strip().splitlines()[-1]
                if m.equivalent:
                    m.detail += " (listed as equivalent, but it is killed: fix the table)"
            else:  # 4: usage error, 5: no tests collected
                m.status, m.detail = "error", f"pytest exit {code}: {out.strip().splitlines()[-1]}"
            print(f"[{n}/{len(runnable)}] {m.id:<6} {m.status:<10} {m.seconds:6.1f} s  {m.detail[:110]}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return summarize(mutants, baseline_result, time.monotonic() - started, timeout, state)


def working_tree_state() -> dict:
    git = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "--short=12", "HEAD"), "working_tree_clean": not git("status", "--porcelain")}


def summarize(mutants: list[Mutant], baseline: dict | None, seconds: float, timeout: float, state: dict) -> dict:
    counts = {s: sum(m.status == s for m in mutants) for s in ("killed", "equivalent", "survived", "error")}
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
        **state,
        "seconds": round(seconds, 1),
        "timeout_per_mutant_s": timeout,
        "total": len(mutants),
        "counts": counts,
        "baseline": baseline,
        "mutants": [{k: getattr(m, k) for k in ("id", "area", "file", "what", "status", "detail", "failed", "tests")}
                    | {"seconds": round(m.seconds, 1)} for m in mutants],
    }


def write_results(result: dict, folder: Path = RESULTS) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    c = result["counts"]
    lines = [
        f"# Mutation testing of the core ({result['date']})",
        "",
        f"{result['total']} mutants: **{c['killed']} killed**, {c['equivalent']} equivalent, "
        f"{c['survived']} survived, {c['error']} not applicable. Wall time {result['seconds'] / 60:.1f} min "
        f"on {result['machine']}; commit {result['commit']}"
        + ("" if result["working_tree_clean"] else " with uncommitted changes") + ".",
        "",
        "Each mutant is one exact snippet replaced in a temporary copy of the repository "
        "(`mutation/mutants.toml`); its focused tests run with `pytest -x -m \"not slow\"`. "
        "Killed: the tests fail. Equivalent: listed with the reason no test can tell it apart.",
        "",
        "| id | area | file | bug | status | tests that failed first / reason | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in result["mutants"]:
        detail = m["detail"].replace("|", "\\|")
        lines.append(f"| {m['id']} | {m['area']} | `{m['file']}` | {m['what']} | {m['status']} | {detail} | {m['seconds']} |")
    (folder / "latest.md").write_text("\n".join(lines) + "\n")


def check_table(mutants: list[Mutant]) -> int:
    """Print every mutant that no longer applies; 1 when there is one."""
    problems = table_problems(mutants)
    for mid, problem in problems:
        print(f"{mid}: {problem}")
    print(f"{len(mutants)} mutants, {len(mutants) - len({mid for mid, _ in problems})} apply")
    return int(bool(problems))


def run_mutants(mutants: list[Mutant], cfg: MutationConfig) -> int:
    result = run(mutants, cfg.timeout, baseline=cfg.baseline)
    if cfg.write and not cfg.only:
        write_results(result)
    c = result["counts"]
    print(f"{result['total']} mutants: {c['killed']} killed, {c['equivalent']} equivalent, {c['survived']} survived, "
          f"{c['error']} errors; {result['seconds'] / 60:.1f} min")
    for m in result["mutants"]:
        if m["status"] in ("survived", "error") or "fix the table" in m["detail"]:
            print(f"  {m['id']} ({m['file']}): {m['status']}: {m['detail']}")
    wrong = [m for m in result["mutants"] if "fix the table" in m["detail"]]
    return 0 if c["survived"] == 0 and c["error"] == 0 and not wrong else 1


@entry_point("mutation", asdict(MutationConfig()), check=mutation_config)
def main(cfg: DictConfig) -> None:
    """Exit status 0 when every mutant is killed or listed as equivalent (with check=true: when
    every mutant applies), else 1."""
    settings = mutation_config(cfg)
    mutants = [m for m in load_mutants() if not settings.only or m.id in settings.only]
    status = check_table(mutants) if settings.check else run_mutants(mutants, settings)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    sys.exit(main())
