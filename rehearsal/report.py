"""The rehearsal's results: ``scale.json`` (every measurement), ``scale.md`` (the tables, each
target with its verdict, the bill for all of OpenWebMath), ``scale.png`` (cost against teacher
tokens, log-log) and the bill's section of docs/sizing-a-run.md.

Growth exponents are measured between the two largest fractions: ``log(cost2 / cost1) /
log(tokens2 / tokens1)``. The bill extrapolates each cost linearly in the teacher tokens from those
two points (the fixed cost of a run and its cost per token), to OpenWebMath's 14.7B tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rehearsal.corpus import OWM_DOCUMENTS, OWM_TOKENS

GPU_TOKENS_PER_S = 39_000  # a 7B forward at 70% MFU on an H100 (the figure)
STAGES = ("corpus", "stage1", "rerun", "count", "train", "export", "summary", "validate")
MAIN_ROLES = ("driver", "scorer actor", "raylet", "gcs_server", "forked worker", "spawned worker")
BILL_BEGIN = "<!-- rehearse:bill:begin (written by make rehearse from bench-results/scale.json) -->"
BILL_END = "<!-- rehearse:bill:end -->"


def exponent(c1: float, c2: float, t1: float, t2: float) -> float | None:
    if min(c1, c2, t1, t2) <= 0 or t1 == t2:
        return None
    return math.log(c2 / c1) / math.log(t2 / t1)


def linear(c1: float, c2: float, t1: float, t2: float, t: float) -> float:
    """The line through ``(t1, c1)`` and ``(t2, c2)`` at ``t`` (the fixed cost and the cost per token)."""
    slope = (c2 - c1) / (t2 - t1) if t2 != t1 else c2 / t2
    return c2 + slope * (t - t2)


def growth(results: list[dict]) -> dict:
    """Per step, between the two largest fractions: the wall-time exponent and every role's peak-RSS ratio."""
    if len(results) < 2:
        return {}
    a, b = results[-2], results[-1]
    t1, t2 = a["teacher_tokens"], b["teacher_tokens"]
    out = {}
    for name in STAGES:
        s1, s2 = a["steps"].get(name), b["steps"].get(name)
        if not s1 or not s2:
            continue
        rss = {role: s2["roles"][role]["peak_rss_mib"] / s1["roles"][role]["peak_rss_mib"]
               for role in s2["roles"] if role in s1["roles"] and s1["roles"][role]["peak_rss_mib"] > 0}
        out[name] = {"wall_exponent": exponent(s1["wall_s"], s2["wall_s"], t1, t2),
                     "cpu_exponent": exponent(s1["cpu_s"], s2["cpu_s"], t1, t2),
                     "rss_ratio": rss, "worst_rss_ratio": max(rss.values(), default=None),
                     "worst_rss_role": max(rss, key=rss.get) if rss else None}
    return out


def bill(results: list[dict], cfg) -> dict:
    """All of OpenWebMath from the two largest fractions (module docstring)."""
    if len(results) < 2:
        return {}
    a, b = results[-2], results[-1]
    t1, t2, t = a["teacher_tokens"], b["teacher_tokens"], OWM_TOKENS
    shards = math.ceil(OWM_DOCUMENTS / cfg.rows_per_shard)
    out: dict = {"teacher_tokens": t, "documents": OWM_DOCUMENTS, "shards": shards, "files": 2 * shards + 2,
                 "scored_bytes": linear(a["scored_bytes"], b["scored_bytes"], t1, t2, t),
                 "manifest_bytes": b["manifest_bytes"] / b["shards"] * shards, "core_hours": {}}
    for name in STAGES:
        s1, s2 = a["steps"].get(name), b["steps"].get(name)
        if s1 and s2 and name not in ("rerun", "corpus", "train"):  # a training run of fixed steps does not grow
            out["core_hours"][name] = linear(s1["cpu_s"], s2["cpu_s"], t1, t2, t) / 3600
    s1, s2 = a["steps"].get("stage1"), b["steps"].get("stage1")
    if s1 and s2:
        d1, d2 = s1["roles"]["driver"]["peak_rss_mib"], s2["roles"]["driver"]["peak_rss_mib"]
        # in shards; where the two sizes differ by less than the noise, the larger measured value
        out["driver_rss_mib"] = max(d2, linear(d1, d2, a["shards"], b["shards"], shards))
        actor = (s2["roles"]["scorer actor"]["cpu_s"] - s1["roles"]["scorer actor"]["cpu_s"]) / (t2 - t1)
        whole = (s2["cpu_s"] - s1["cpu_s"]) / (t2 - t1)
        out["actor_cpu_s_per_token"] = actor
        out["job_cpu_s_per_token"] = whole
        out["cores_per_gpu_actor"] = actor * GPU_TOKENS_PER_S
        out["cores_per_gpu_job"] = whole * GPU_TOKENS_PER_S
        out["gpu_hours"] = t / GPU_TOKENS_PER_S / 3600
    c = b["steps"].get("count")
    if c and b.get("student_tokens"):
        student = b["student_tokens"] / t2 * t
        per_worker = c["result"]["tokens_per_s"] / c["result"]["workers"]
        out["student_tokens"] = student
        out["first_count_hours"] = {w: student / (per_worker * w) / 3600 for w in (1, 2, 8, 16, 32)}
    return out


def targets(results: list[dict], grown: dict, markers: dict | None, total_wall: float) -> list[dict]:
    """Each target of the issue with the measured value and a verdict."""
    rows = []

    def add(what, value, limit, op, note=""):
        ok = None if value is None else (value <= limit if op == "<=" else value >= limit)
        rows.append({"target": what, "value": value, "limit": limit, "op": op, "ok": ok, "note": note})

    for name, g in grown.items():
        if name in ("corpus",):
            continue
        add(f"{name}: wall-time exponent between the two largest sizes", g["wall_exponent"], 1.04, "<=")
        add(f"{name}: peak RSS growth of every process", g["worst_rss_ratio"], 1.25, "<=", g["worst_rss_role"] or "")
    if results:
        b = results[-1]
        s = b["steps"].get("stage1")
        if s:
            add("stage 1: teacher tokens per CPU-second, all processes (whole run)", b["teacher_tokens"] / s["cpu_s"],
                200_000, ">=")
        if len(results) >= 2 and s and results[-2]["steps"].get("stage1"):
            a = results[-2]
            marginal = (b["teacher_tokens"] - a["teacher_tokens"]) / (s["cpu_s"] - a["steps"]["stage1"]["cpu_s"])
            add("stage 1: teacher tokens per CPU-second, sustained (between the two largest)", marginal, 200_000, ">=")
        r = b["steps"].get("rerun")
        if r:
            add("rerun of the finished job: wall seconds", r["wall_s"], 10.0, "<=",
                "scored nothing" if b["checks"].get("rerun_scored_nothing") else "SCORED SOMETHING")
        t = b["steps"].get("train")
        if t:
            add("stage 2: first optimizer step after start, counts cached (s)", t["events"].get("first_step_s"), 30.0, "<=")
        c = b["steps"].get("count")
        if c:
            add(f"stage 2: first length count, student tokens/s with {c['result']['workers']} workers",
                c["result"]["tokens_per_s"], 1_000_000, ">=")
    for r in results:
        k = r.get("kills")
        if k:
            for what in ("stage1", "export"):
                if k.get(what):
                    add(f"{what} killed {len(k[what]['kills'])}x and rerun: output byte-identical", float(k[what]["identical"]),
                        1.0, ">=", f"{r['tag']}")
                    add(f"{what} after a kill redoes at most the shards in flight",
                        float(k[what]["redone_at_most_in_flight"]), 1.0, ">=", f"{r['tag']}")
    if markers:
        for name, m in markers.get("operations", {}).items():
            note = f"peak RSS {m.get('peak_rss_mib', 0):,.0f} MiB"
            if name == "full validation":  # reads every shard: not one of the targets
                rows.append({"target": f"{markers['shards']:,}-shard folder: {name} (s)", "value": m.get("wall_s"),
                             "limit": None, "op": "", "ok": None, "note": note + "; every shard opened and read"})
                continue
            add(f"{markers['shards']:,}-shard folder: {name} (s)", m.get("wall_s"), 30.0, "<=", note)
    add("make rehearse: wall minutes", total_wall / 60, 30.0, "<=", "all fractions and steps")
    return rows


def _num(v, digits=2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def _load(part: dict) -> str:
    load = part.get("load") or {}
    return f"{load['mean_1min']} / {load['max_1min']}" if load else "not recorded"


def markdown(report: dict) -> str:
    lines = ["# Scale rehearsal: OpenWebMath-shaped fractions through every stage", "",
             f"{report['when']}; machine: {report['machine'].get('cpu_model')}, {report['machine'].get('cpu_count')} cores; "
             "1-minute load average while each part ran (mean / max): " + "; ".join(
                 f"{r['tag']} {_load(r)}" for r in report["fractions"]) + (
                 f"; markers {_load(report['markers'])}" if report.get("markers") else "")
             + ". Teacher: the rehearsal teacher (Qwen2.5's tokenizer, no model). Commands and settings: `scale.json`.",
             ""]
    if report.get("shared_machine_note"):
        lines += [f"> {report['shared_machine_note']}", ""]
    lines += ["## Targets", "", "| target | measured | limit | ok | note |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        lines.append(f"| {t['target']} | {_num(t['value'])} | {t['op']} {_num(t['limit'])} | "
                     f"{'-' if t['ok'] is None else ('yes' if t['ok'] else '**no**')} | {t['note']} |")
    lines += ["", "## Each step", "",
              "| fraction | step | wall s | CPU s | peak RSS MiB: driver / actor / raylet / workers | shared memory MiB (stage 1: Ray's object store) | written |",
              "|---|---|---|---|---|---|---|"]
    for r in report["fractions"]:
        for name, s in r["steps"].items():
            roles = s["roles"]
            rss = " / ".join(_num(roles.get(k, {}).get("peak_rss_mib"), 0) for k in
                             ("driver", "scorer actor", "raylet")) + " / " + _num(max(
                [roles.get(k, {}).get("peak_rss_mib", 0) for k in ("forked worker", "spawned worker")]), 0)
            lines.append(f"| {r['tag']} ({r['teacher_tokens']:,} tokens) | {name} | {_num(s['wall_s'], 1)} | "
                         f"{_num(s['cpu_s'], 1)} | {rss} | {_num(s['object_store_peak_mib'], 1)} | "
                         f"{s['files_written']:,} files, {s['bytes_written'] / 2**20:,.1f} MiB |")
    lines += ["", "## Growth between the two largest fractions", "",
              "| step | wall exponent | CPU exponent | worst peak-RSS ratio (role) |", "|---|---|---|---|"]
    for name, g in report["growth"].items():
        lines.append(f"| {name} | {_num(g['wall_exponent'], 3)} | {_num(g['cpu_exponent'], 3)} | "
                     f"{_num(g['worst_rss_ratio'], 3)} ({g['worst_rss_role']}) |")
    lines += ["", "## The bill for all of OpenWebMath", "", bill_table(report.get("bill") or {}), ""]
    if report.get("markers"):
        m = report["markers"]
        lines += [f"## A folder of {m['shards']:,} shards (synthetic markers)", "",
                  "| operation | wall s | CPU s | peak RSS MiB | note |", "|---|---|---|---|---|"]
        for name, op in m["operations"].items():
            lines.append(f"| {name} | {_num(op.get('wall_s'))} | {_num(op.get('cpu_s'))} | "
                         f"{_num(op.get('peak_rss_mib'), 0)} | {op.get('note', '')} |")
    return "\n".join(lines) + "\n"


def bill_table(b: dict) -> str:
    if not b:
        return "Not measured yet: `make rehearse` fills this in from two fractions (0.1% and 1% by default)."
    rows = [("teacher tokens, documents", f"{b['teacher_tokens'] / 1e9:.1f}B, {b['documents']:,}"),
            ("shards, files", f"{b['shards']:,}, {b['files']:,}"),
            ("scored dataset on disk", f"{b['scored_bytes'] / 2**30:,.0f} GiB"),
            ("manifest", f"{b['manifest_bytes'] / 2**20:,.1f} MiB")]
    for name, hours in b.get("core_hours", {}).items():
        rows.append((f"CPU core-hours: {name}", f"{hours:,.1f}"))
    if "driver_rss_mib" in b:
        rows += [("stage-1 driver's peak memory (linear in shards from the two sizes, at least the larger)",
                  f"{b['driver_rss_mib']:,.0f} MiB"),
                 ("GPU-hours of the forward at 39,000 tokens/s", f"{b['gpu_hours']:,.0f}"),
                 ("CPU cores per GPU to keep up at 39,000 tokens/s: its actor / the whole job",
                  f"{b['cores_per_gpu_actor']:.2f} / {b['cores_per_gpu_job']:.2f}")]
    if "first_count_hours" in b:
        rows.append(("rank 0's first length count, hours at data.length_workers = "
                     + ", ".join(map(str, b["first_count_hours"])),
                     ", ".join(f"{h:.2f}" for h in b["first_count_hours"].values())))
    return "| what | all of OpenWebMath |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (wall, cpu) = plt.subplots(1, 2, figsize=(12, 5))
    fractions = report["fractions"]
    for name in STAGES:
        points = [(r["teacher_tokens"], r["steps"][name]) for r in fractions if name in r["steps"]]
        if len(points) < 2:
            continue
        tokens = [t for t, _ in points]
        wall.plot(tokens, [s["wall_s"] for _, s in points], marker="o", label=name)
        cpu.plot(tokens, [s["cpu_s"] for _, s in points], marker="o", label=name)
    for ax, what in ((wall, "wall seconds"), (cpu, "CPU seconds, all processes")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("teacher tokens")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    if fractions:
        t = [r["teacher_tokens"] for r in fractions]
        base = next((r["steps"]["stage1"]["wall_s"] for r in fractions if "stage1" in r["steps"]), 1.0)
        wall.plot(t, [base * x / t[0] for x in t], "k--", alpha=0.4, label="linear")
    wall.legend(fontsize=8)
    fig.suptitle("Scale rehearsal: cost against teacher tokens (log-log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_docs_bill(page: Path, report: dict) -> bool:
    """Replace the bill's section of ``page`` (between its markers) with the measured table."""
    text = page.read_text()
    if BILL_BEGIN not in text or BILL_END not in text:
        return False
    head, rest = text.split(BILL_BEGIN, 1)
    _, tail = rest.split(BILL_END, 1)
    body = (f"\nMeasured by `make rehearse` on {report['when']} ({report['machine'].get('cpu_count')} cores; load "
            "average while each size ran: " + "; ".join(f"{r['tag']} {_load(r)}" for r in report["fractions"])
            + f"); fractions {', '.join(r['tag'] for r in report['fractions'])}, extrapolated linearly from the two "
            f"largest:\n\n{bill_table(report.get('bill') or {})}\n\n")
    page.write_text(head + BILL_BEGIN + body + BILL_END + tail)
    return True


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "scale.json", out_dir / "scale.md"
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path, plot(report, out_dir / "scale.png")
