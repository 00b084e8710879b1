"""Inspection memory stays flat when the dataset grows (lazy, streaming scans): the summary and the
validation of an 8x larger dataset peak at about the same memory, far below the data's size.

Each measurement runs in a fresh process and reports its peak RSS (``VmHWM``) above the RSS it had
after its imports, so the numbers are not mixed up with pytest's or the other measurements'.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

DOCS_PER_SHARD = 250
TOKENS_PER_DOC = 1600
SMALL, LARGE = 4, 32  # shards

CHILD = r"""
import json, sys
from pathlib import Path
from storage_schemas.reader import ScoredDataset
from pipeline.inspection.summary import summarize
from pipeline.inspection.validate import validate_dataset

def status_mib(key):  # VmRSS: now; VmHWM: peak of this process image (ru_maxrss would include the parent's)
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) / 1024

folder, what = sys.argv[1], sys.argv[2]
baseline = status_mib("VmRSS")
if what == "eager":  # the control: what loading the whole dataset takes
    import polars as pl
    result = {"rows": pl.read_parquet([str(p) for p in ScoredDataset.open(folder).shard_paths]).height}
elif what == "summary":
    s = summarize(ScoredDataset.open(folder))
    result = {"tokens": s.tokens, "mean": s.loss_mean}
else:
    r = validate_dataset(folder, checksums=True)
    result = {"ok": r.ok, "rows": r.rows_checked, "problems": [str(p) for p in r.problems][:5]}
peak = status_mib("VmHWM")
print(json.dumps({**result, "baseline_mib": baseline, "peak_mib": peak, "growth_mib": peak - baseline}))
"""


def build_dataset(folder: Path, n_shards: int) -> int:
    """Synthetic but contract-valid shards written by the real writer; returns the bytes the list
    and text columns take in memory once loaded."""
    from pipeline.score_teacher.writer import write_manifest, write_shard
    from pipeline.score_teacher.teacher import ScoredDocument, ShardResult

    folder.mkdir(parents=True)
    rng = np.random.default_rng(n_shards)
    identity = {"teacher": {"name": "synthetic", "vocab_size": 50_000, "bos_id": None}, "corpus": {"n_shards": n_shards}}
    starts = np.arange(TOKENS_PER_DOC, dtype=np.int32) * 4
    text = "abc " * TOKENS_PER_DOC
    done = {}
    for s in range(n_shards):
        docs = []
        for d in range(DOCS_PER_SHARD):
            losses = rng.gamma(2.0, 1.5, TOKENS_PER_DOC).astype(np.float32)
            losses[0] = np.nan
            ids = rng.integers(0, 50_000, TOKENS_PER_DOC, dtype=np.int32)
            docs.append(ScoredDocument(f"s{s}:{d}", text, ids, starts, starts + 3, losses))
        done[s] = write_shard(folder, s, ShardResult(documents=docs), identity, {"start": 0}, "memory-test")
    write_manifest(folder, identity, done, n_shards, "memory-test")
    tokens = n_shards * DOCS_PER_SHARD * TOKENS_PER_DOC
    return tokens * (4 * 4) + n_shards * DOCS_PER_SHARD * len(text)


def measure(folder: Path, what: str) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(folder), what], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    root = tmp_path_factory.mktemp("memory")
    return {name: (root / name, build_dataset(root / name, n)) for name, n in (("small", SMALL), ("large", LARGE))}


@pytest.fixture(scope="module")
def eager_growth(datasets) -> tuple[float, float]:
    """Peak growth when the small and the large dataset are loaded whole (the control)."""
    return measure(datasets["small"][0], "eager")["growth_mib"], measure(datasets["large"][0], "eager")["growth_mib"]


@pytest.mark.parametrize("what", ["summary", "validate"])
def test_memory_stays_flat_as_the_dataset_grows(datasets, eager_growth, what):
    (small_dir, _), (large_dir, large_bytes) = datasets["small"], datasets["large"]
    small, large = measure(small_dir, what), measure(large_dir, what)
    if what == "summary":
        assert large["tokens"] == LARGE * DOCS_PER_SHARD * TOKENS_PER_DOC
    else:
        assert small["ok"] and large["ok"] and large["rows"] == LARGE * DOCS_PER_SHARD, large["problems"]
    eager_small, eager_large = eager_growth
    print(f"\n{what}: peak growth {small['growth_mib']:.0f} MiB ({SMALL} shards) -> {large['growth_mib']:.0f} MiB "
          f"({LARGE} shards); loading them whole: {eager_small:.0f} -> {eager_large:.0f} MiB "
          f"({large_bytes / 2**20:.0f} MiB of columns)")
    # 8x the data: loading it whole grows by ~200 MiB; the lazy scans by a small fraction of that
    # (polars' streaming engine has a fixed overhead of its own, about the same for both sizes).
    assert eager_large - eager_small > 150
    assert large["growth_mib"] - small["growth_mib"] < 0.25 * (eager_large - eager_small)
    assert large["growth_mib"] < 0.6 * eager_large
