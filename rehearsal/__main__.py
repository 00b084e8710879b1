"""``python -m rehearsal [hydra overrides]`` (``make rehearse``): OpenWebMath's scale rehearsed on CPUs.

Reads as a list of steps: compose and check the settings (:mod:`rehearsal.config`); prepare the
teacher's tokenizer folder and the micro student once; run every fraction through every stage
(:mod:`rehearsal.run`; a fraction whose results are saved under ``work_dir/results`` is reused
with ``reuse=true``), the folder of synthetic markers (:mod:`rehearsal.markers`); write
``scale.json``, ``scale.md`` and ``scale.png`` and the bill's section of the docs page
(:mod:`rehearsal.report`).
Usage: ``make rehearse``, ``make rehearse ARGS="fractions=[0.0001,0.001]"``, ``ARGS="reuse=false"``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from rehearsal.config import RehearseConfig, rehearse_config
from stages.common import entry_point, quiet_libraries

log = logging.getLogger("rehearse")


def rehearse(cfg: RehearseConfig) -> dict:
    from benchmarks.measure import LoadSampler, machine_info
    from rehearsal.report import bill, growth, targets

    t0 = time.perf_counter()
    load = LoadSampler()
    try:
        results, markers = run_everything(cfg)
    finally:
        busy = load.stop()
    wall = sum(s["wall_s"] for r in results for s in r["steps"].values()) + (
        sum(op.get("wall_s", 0) for op in (markers or {}).get("operations", {}).values()))
    grown = growth(results)
    return {"when": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine_info(), "load_average": busy["mean_1min"],
            "load": busy, "config": dataclasses.asdict(cfg), "seconds_this_call": time.perf_counter() - t0,
            "steps_wall_s": wall, "fractions": results, "growth": grown, "bill": bill(results, cfg),
            "markers": markers, "targets": targets(results, grown, markers, wall),
            "shared_machine_note": busy_note([*results, markers or {}])}


BUSY_SHARE = 0.25  # others' load, as a share of the cores, above which a part's figures are flagged


def shared_with_others(load: dict, cores: int) -> bool:
    """Whether the rest of the machine kept more than ``BUSY_SHARE`` of the cores busy while a part
    ran: its mean 1-minute load less what its own processes used (``own_cpu_rate``: their CPU
    seconds per wall second). A part saved before that was recorded: a load above 3/4 of the cores."""
    if "own_cpu_rate" in load:
        return load["mean_1min"] - load["own_cpu_rate"] > BUSY_SHARE * cores
    return load["mean_1min"] > 0.75 * cores


def busy_note(parts: list[dict], cores: int | None = None) -> str | None:
    """A warning when other work shared the machine while some part ran (or its load is unknown)."""
    cores = cores or os.cpu_count() or 1
    unknown = [p.get("tag", "markers") for p in parts if p and not p.get("load")]
    busy = [p.get("tag", "markers") for p in parts if p.get("load") and shared_with_others(p["load"], cores)]
    if not unknown and not busy:
        return None
    return ("Other work shared the machine while " + ", ".join(busy + unknown) + " ran (load average more than "
            f"{BUSY_SHARE * cores:g} above what the rehearsal's own processes kept busy, or not recorded): its wall "
            "times and CPU seconds include what the contention cost; rerun on an idle machine for the figures to quote.")


def cpu_seconds() -> float:
    """The CPU seconds of the rehearsal so far: this process's own (its threads: the samplers, an
    in-process S3 server) and every measured step's, the whole process tree of each (a step's Ray
    cluster is not a child its command waits for, so the kernel's count for waited-for children
    would miss its workers)."""
    from rehearsal.measure import STEPS_CPU_S

    return time.process_time() + STEPS_CPU_S[0]


def run_everything(cfg: RehearseConfig) -> tuple[list[dict], dict | None]:
    """Every fraction, then the markers folder; a fraction (or the folder) whose results are saved
    is read back with ``reuse``."""
    from benchmarks.measure import LoadSampler
    from rehearsal.markers import run_markers
    from rehearsal.run import Context, prepare_models, run_fraction, tag_of

    work = Path(to_absolute_path(cfg.work_dir))
    results_dir = work / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "VOCAGNO_CACHE": str(work / "cache"), "HF_HOME": str(work / "hf-home"), "PYTHONUNBUFFERED": "1"}
    teacher, student = prepare_models(dataclasses.replace(cfg, tokenizers_dir=to_absolute_path(cfg.tokenizers_dir)), work)
    ctx = Context(cfg, work, teacher, student, env)

    def cached(name: str, make):
        saved = results_dir / f"{name}.json"
        if cfg.reuse and saved.is_file():
            log.info("rehearse: %s reused from %s", name, saved)
            return json.loads(saved.read_text())
        load = LoadSampler()  # how busy the machine was while this part ran
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        try:
            result = make()
        finally:
            busy = load.stop()
        result["load"] = {**busy, "own_cpu_rate": round((cpu_seconds() - cpu0) / (time.perf_counter() - t0), 2)}
        saved.write_text(json.dumps(result, indent=1, default=str))
        return result

    results = [cached(tag_of(f), lambda f=f: run_fraction(ctx, f)) for f in sorted(cfg.fractions)]
    markers = (cached(f"markers-{cfg.markers_shards}", lambda: run_markers(ctx, cfg.markers_shards))
               if "markers" in cfg.steps else None)
    return results, markers


@entry_point("rehearse", dataclasses.asdict(RehearseConfig()), check=rehearse_config)
def main(cfg: DictConfig) -> None:
    from rehearsal.report import write_docs_bill, write_report

    quiet_libraries()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    typed = rehearse_config(cfg)
    report = rehearse(typed)
    paths = write_report(report, Path(to_absolute_path(typed.out_dir)))
    if typed.docs_page and write_docs_bill(Path(to_absolute_path(typed.docs_page)), report):
        print(f"the bill's section of {typed.docs_page} rewritten")
    for t in report["targets"]:
        verdict = "-" if t["ok"] is None else ("ok" if t["ok"] else "MISSED")
        print(f"{verdict:7s} {t['target']}: {t['value']} ({t['op']} {t['limit']}) {t['note']}")
    print("\n".join(str(p) for p in paths if p))


if __name__ == "__main__":
    sys.exit(main())
