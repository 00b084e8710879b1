"""What the bench cases run on: real tokenizers, math text, random-weight models, small corpora.

Everything is deterministic and cached under the bench's work folder, so a second run skips the
slow set-up (loading a GGUF vocabulary is slow; a folder with ``tokenizer.json`` loads fast):

* :func:`real_tokenizer` loads one of the paper's tokenizers from ``../shared/tokenizers`` through
  :func:`pipeline.method.tokenization.load_tokenizer`, saves it as a plain tokenizer folder and, from then
  on, loads the folder, after checking once that both give the same fingerprint;
* :func:`math_texts` takes the clean documents of the sample corpus generator until the text
  reaches a byte budget;
* :func:`random_causal_lm` writes a random-weight Llama-architecture checkpoint of a given shape
  (:class:`RandomModelShape`), with a tokenizer alongside, that ``run_score_job`` and ``from_pretrained`` load by path;
* :func:`sample_corpus` writes the first ``n`` documents of the sample corpus as one Parquet file.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.results import figure
from pipeline.runtime.config import check_at_least
from pipeline.embedded.model_shape import ModelShape

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]

REAL_TOKENIZERS = {
    "llama-spm": "ggml-vocab-llama-spm.gguf",  # TinyLlama / Llama-2: the student
    "qwen2": "ggml-vocab-qwen2.gguf",  # Qwen2.5-Math: the paper's best teacher
    "deepseek": "ggml-vocab-deepseek-llm.gguf",
    "mistral": "mistral-v1.tokenizer.model",  # Mistral-ProXMath
}

_LOADED: dict[tuple[str, str], object] = {}


def real_tokenizer(name: str, tokenizers_dir: str | os.PathLike, cache_dir: str | os.PathLike):
    """The real tokenizer ``name`` (a key of :data:`REAL_TOKENIZERS`), loaded once per process."""
    key = (name, str(tokenizers_dir))
    if key not in _LOADED:
        _LOADED[key] = _load_real(name, Path(tokenizers_dir), Path(cache_dir))
    return _LOADED[key]


def real_tokenizer_folder(name: str, tokenizers_dir: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """A folder holding the real tokenizer ``name`` as ``tokenizer.json`` (for other processes)."""
    real_tokenizer(name, tokenizers_dir, cache_dir)
    folder = Path(cache_dir) / name
    if json.loads((folder / STAMP).read_text()).get("format") != "folder":
        raise ValueError(f"tokenizer {name} does not survive save_pretrained unchanged; no folder form")
    return folder


STAMP = "_SOURCE.json"


def _load_real(name: str, tokenizers_dir: Path, cache_dir: Path):
    """Load from the cache when its stamp matches the source file and the fingerprint matches;
    else from the source, then cache it as a folder, or pickled where ``save_pretrained`` changes
    it (Qwen2's reload adds an NFC normaliser)."""
    import pickle

    from pipeline.method.tokenization import fingerprint, load_tokenizer

    source = tokenizers_dir / REAL_TOKENIZERS[name]
    if not source.is_file():
        raise FileNotFoundError(f"real tokenizer {name} not found at {source} (the test tokenizers beside the repository: see README.md)")
    folder = cache_dir / name
    want = {"source": str(source.resolve()), "size": source.stat().st_size, "mtime_ns": source.stat().st_mtime_ns}
    stamp = json.loads((folder / STAMP).read_text()) if (folder / STAMP).is_file() else {}
    if stamp.get("source_file") == want:
        try:
            if stamp.get("format") == "folder":
                tok = load_tokenizer(str(folder))
            else:
                tok = pickle.loads((folder / "tokenizer.pkl").read_bytes())  # written below, by this code
            if fingerprint(tok) == stamp.get("sha256"):
                return tok
        except Exception as exc:  # a stale or broken cache: rebuild it
            log.warning("tokenizer cache %s unusable (%s); rebuilding", folder, exc)
    tok = load_tokenizer(str(source))
    sha = fingerprint(tok)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    form = "folder" if fingerprint(load_tokenizer(str(folder))) == sha else "pickle"
    if form == "pickle":
        (folder / "tokenizer.pkl").write_bytes(pickle.dumps(tok))
    (folder / STAMP).write_text(json.dumps({"source_file": want, "sha256": sha, "format": form}, indent=1))
    return tok


def math_texts(min_bytes: int, seed: int = 0, kinds: tuple[str, ...] = ("clean",)) -> list[str]:
    """Sample-corpus documents of the given kinds, in corpus order, until their UTF-8 size
    reaches ``min_bytes`` (clean = worked problems, LaTeX, unicode maths, some emoji and CJK)."""
    from pipeline.embedded.sample_corpus import generate_documents

    n_docs = 64
    while True:  # one corpus of n_docs documents; twice as many if it is too small
        texts: list[str] = []
        total = 0
        for d in generate_documents(n_docs, seed=seed):
            if d["text"] and json.loads(d["metadata"] or "{}").get("kind") in kinds:
                texts.append(d["text"])
                total += len(d["text"].encode("utf-8"))
                if total >= min_bytes:
                    return texts
        n_docs *= 2


def sample_corpus(out_dir: str | os.PathLike, n_docs: int, seed: int = 0) -> list[Path]:
    """The sample corpus of ``n_docs`` documents (noise and bad rows included) as Parquet."""
    from pipeline.embedded.sample_corpus import build_sample_corpus

    return build_sample_corpus(Path(out_dir) / f"corpus-n{n_docs}-s{seed}", n_docs=n_docs, n_files=1, seed=seed)


@dataclass(frozen=True, kw_only=True)
class RandomModelShape(ModelShape):
    """The shape of a random-weight Llama-architecture model (speed does not need training), with
    whether its output head shares the embedding and the seed of its initialisation."""

    hidden_size: int = 384
    intermediate_size: int = 1024
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int | None = None  # None: num_heads
    context: int = 512
    tie_word_embeddings: bool = False
    seed: int = 0

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "context"):
            check_at_least(problems, name, getattr(self, name), 1)
        check_at_least(problems, "num_kv_heads", self.num_kv_heads, 1)
        if self.hidden_size % self.num_heads:
            problems.append(f"num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            problems.append(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        return problems


def build_model(shape: RandomModelShape, vocab_size: int, bos_id: int | None = None, eos_id: int | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=shape.tie_word_embeddings, bos_token_id=bos_id,
                         eos_token_id=eos_id, **shape.hf_config_args())
    torch.manual_seed(shape.seed)
    return LlamaForCausalLM(config)


def count_parameters(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


def random_causal_lm(out_dir: str | os.PathLike, shape: RandomModelShape, tokenizer) -> Path:
    """A checkpoint folder (safetensors + tokenizer) of a random-weight model; cached by its shape
    and tokenizer (the stamp's ``spec``)."""
    folder = Path(out_dir)
    stamp = folder / "_BENCH_MODEL.json"
    want = {"spec": asdict(shape), "vocab_size": len(tokenizer), "tokenizer": tokenizer.name_or_path}
    if stamp.is_file() and json.loads(stamp.read_text()).get("build") == want:
        return folder
    model = build_model(shape, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    stamp.write_text(json.dumps({"build": want, "parameters": count_parameters(model)}, indent=1))
    return folder


def model_parameters(folder: str | os.PathLike) -> dict:
    """The parameter counts of a model folder: the stamp of one built here, else counted on a model
    built from the folder's config on the meta device (no weights read: a real teacher's folder)."""
    stamp = Path(folder) / "_BENCH_MODEL.json"
    if stamp.is_file():
        return json.loads(stamp.read_text())["parameters"]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return count_parameters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder))))


def run_in_vllm_env(module: str, cfg, work: Path, teacher, corpus: list[str], measures: dict, timeout_s: float,
                    **task) -> dict | None:
    """Run ``python -m <module> <task file>`` with ``cfg.python`` (vLLM's environment) and return the
    result it writes; with no such interpreter, a result whose figures say why the case was skipped.
    ``task`` adds entries to the task file (``cfg``, ``teacher``, ``corpus`` and ``out`` are always in it)."""
    python = Path(cfg.python) if Path(cfg.python).is_absolute() else REPO / cfg.python
    if not python.exists():
        note = f"skipped: {cfg.python} not found (make setup-vllm builds vLLM's environment)"
        return {"skipped": note, "figures": [figure(key, measure, None, note=note) for key, measure in measures.values()]}
    work.mkdir(parents=True, exist_ok=True)
    task_file, out = work / "task.json", work / "result.json"
    task_file.write_text(json.dumps({"cfg": asdict(cfg), "teacher": str(teacher), "corpus": list(map(str, corpus)),
                                     "out": str(out), **task}))
    out.unlink(missing_ok=True)
    child = subprocess.run([str(python), "-m", module, str(task_file)], cwd=REPO, capture_output=True, text=True,
                           timeout=timeout_s)
    if child.returncode != 0 or not out.exists():
        raise RuntimeError(f"{module}'s child exited {child.returncode}: {child.stderr[-3000:]}")
    return json.loads(out.read_text())


def corpus_windows(task: dict) -> tuple[list[str], list]:
    """The first ``task["cfg"]["n_docs"]`` non-blank documents of ``task["corpus"]`` (Parquet files)
    and their windows, tokenized by ``task["teacher"]``'s tokenizer and planned as stage 1 plans them
    (``cfg["window"]``, ``cfg["stride"]``; the tiny teacher adds no BOS). Used by the cases that run
    in vLLM's environment, so the imports stay inside."""
    import numpy as np
    import pyarrow.parquet as pq

    from pipeline.method.tokenization import encode_batch, load_tokenizer
    from pipeline.method.windows import plan_windows

    cfg = task["cfg"]
    texts: list[str] = []
    for path in task["corpus"]:
        texts += [t for t in pq.read_table(path, columns=["text"]).column("text").to_pylist() if t and t.strip()]
        if len(texts) >= cfg["n_docs"]:
            break
    texts = texts[: cfg["n_docs"]]
    windows = []
    for enc in encode_batch(load_tokenizer(task["teacher"]), texts):
        z = np.asarray(enc.ids, dtype=np.int64)
        windows += [z[w.start:w.stop] for w in plan_windows(len(z), cfg["window"], cfg["stride"])]
    return texts, windows
