"""What the toy-scale experiment is made of: its corpora, teachers and students, built and cached.

Each builder is deterministic and returns a cached result when its parameters match a stamp in
the folder, so a rerun of ``make repro`` rebuilds nothing that is already there.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.runtime.config import check_at_least, check_choice
from pipeline.embedded.model_shape import ModelShape
from pipeline.embedded.sample_corpus import build_sample_corpus, clean_texts, generate_documents
from pipeline.embedded.tiny_student import new_student_model, train_student_tokenizer
from pipeline.embedded.tiny_teacher import (
    TinyTeacherSpec,
    build_folder,
    build_tiny_teacher,
    fit_blocks,
    pack_blocks,
    train_tokenizer,
)

STAMP = "_REPRO_BUILD.json"
STUDENT_TOKENIZERS = ("sentencepiece_bpe", "byte_level_bpe")


@dataclass(frozen=True)
class CorpusSpec:
    """The study's corpora (its values: conf/repro.yaml)."""

    student_docs: int  # the corpus the students train on (mixed)
    noise_share: float  # chance that a page of the student corpus is noise
    teacher_docs: int  # clean pages the teachers train on
    held_out_docs: int  # clean pages nobody trains on (evaluation)
    pretrain_docs: int  # the base students' general pretraining mixture (same noise share)
    seed: int  # student corpus; teacher corpus seed + 1, held-out pages seed + 2, pretraining seed + 3

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("student_docs", "teacher_docs", "held_out_docs", "pretrain_docs"):
            check_at_least(problems, name, getattr(self, name), 1)
        if not 0.0 <= self.noise_share <= 1.0:
            problems.append(f"noise_share: {self.noise_share} is not in [0, 1]")
        return problems


@dataclass(frozen=True)
class StudentSpec(ModelShape):
    """A named base student: its tokenizer kind and vocabulary size, and its sizes (``ModelShape``)."""

    name: str
    tokenizer: str  # one of STUDENT_TOKENIZERS
    vocab_size: int

    def problems(self) -> list[str]:
        problems: list[str] = []
        check_choice(problems, "tokenizer", self.tokenizer, STUDENT_TOKENIZERS)
        check_at_least(problems, "vocab_size", self.vocab_size, 260)  # the byte pieces and the specials, at least
        return problems


@dataclass(frozen=True)
class PretrainSpec:
    """How each base student is pretrained before continual pretraining (plain next-token loss;
    the study's values: conf/repro.yaml)."""

    steps: int
    batch_size: int
    block: int
    learning_rate: float
    seed: int  # initialisation and data order of the base

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("steps", "batch_size", "block"):
            check_at_least(problems, name, getattr(self, name), 1)
        if self.learning_rate <= 0:
            problems.append(f"learning_rate: {self.learning_rate} must be > 0")
        return problems


@dataclass(frozen=True, kw_only=True)
class TeacherSpec(TinyTeacherSpec):
    """A named tiny teacher: the embedded teacher's spec, trained on the toy experiment's clean pages."""

    name: str


@dataclass
class Corpora:
    student_files: list[Path]
    teacher_texts: list[str]
    held_out: list[str]
    noise_texts: list[str] = field(default_factory=list)  # noise pages of the student corpus
    pretrain_texts: list[str] = field(default_factory=list)  # the base students' pretraining mixture

    def describe(self) -> dict:
        student = describe_student_corpus(self.student_files)
        return {"student_docs_by_kind": student["docs_by_kind"], "student_chars_by_kind": student["chars_by_kind"],
                "noise_char_share": student["noise_char_share"],
                "teacher_docs": len(self.teacher_texts), "teacher_chars": sum(map(len, self.teacher_texts)),
                "held_out_docs": len(self.held_out), "held_out_bytes": sum(len(t.encode()) for t in self.held_out),
                "pretrain_docs": len(self.pretrain_texts), "pretrain_chars": sum(map(len, self.pretrain_texts))}


def build_corpora(root: str | os.PathLike, spec: CorpusSpec) -> Corpora:
    """The student corpus (Parquet in OpenWebMath's schema), the teachers' clean texts and the
    held-out clean pages (no long problem collections, which would dominate the evaluation)."""
    root = Path(root)
    student_files = build_student_corpus(root, spec, spec.noise_share)
    teacher_files = build_sample_corpus(root / f"teacher-corpus-n{spec.teacher_docs}-s{spec.seed + 1}",
                                        n_docs=spec.teacher_docs, n_files=2, seed=spec.seed + 1, noise_share=0.0)
    held_out = []
    for doc in generate_documents(spec.held_out_docs * 2, seed=spec.seed + 2, noise_share=0.0):
        meta = json.loads(doc["metadata"])
        if doc["text"] and doc["text"].strip() and meta["kind"] == "clean" and "long" not in meta["features"]:
            held_out.append(doc["text"])
    noise = []
    for f in student_files:
        t = pq.read_table(f, columns=["text", "metadata"]).to_pydict()
        noise += [x for x, m in zip(t["text"], t["metadata"]) if x and json.loads(m).get("kind") == "noise"]
    pretrain = [d["text"] for d in generate_documents(spec.pretrain_docs, seed=spec.seed + 3, noise_share=spec.noise_share)
                if d["text"] and d["text"].strip()]
    return Corpora(student_files, clean_texts(teacher_files), held_out[: spec.held_out_docs], noise, pretrain)


def build_student_corpus(root: str | os.PathLike, spec: CorpusSpec, noise_share: float) -> list[Path]:
    """The student corpus at a given noise share (same size and seed as ``spec``'s), as Parquet."""
    return build_sample_corpus(Path(root) / f"student-corpus-n{spec.student_docs}-s{spec.seed}-noise{noise_share:g}",
                               n_docs=spec.student_docs, n_files=4, seed=spec.seed, noise_share=noise_share)


def describe_student_corpus(files: list[Path]) -> dict:
    """Pages and characters by kind (clean, noise, empty) and the noise share of the characters."""
    kinds: dict[str, int] = {}
    chars: dict[str, int] = {}
    for f in files:
        t = pq.read_table(f, columns=["text", "metadata"]).to_pydict()
        for text, meta in zip(t["text"], t["metadata"]):
            kind = json.loads(meta or "{}").get("kind", "?")
            kinds[kind] = kinds.get(kind, 0) + 1
            chars[kind] = chars.get(kind, 0) + len(text or "")
    total = sum(chars.values()) or 1
    return {"docs_by_kind": kinds, "chars_by_kind": chars, "noise_char_share": round(chars.get("noise", 0) / total, 4)}


def build_teacher(root: str | os.PathLike, spec: TeacherSpec, corpora: Corpora) -> Path:
    """A tiny byte-level-BPE Qwen2 teacher trained on the clean teacher corpus (cached)."""
    tiny = TinyTeacherSpec(**{f.name: getattr(spec, f.name) for f in fields(TinyTeacherSpec)})  # its build stamp has no name
    return build_tiny_teacher(corpora.teacher_texts, Path(root) / f"teacher-{spec.name}", tiny,
                              eval_texts={"clean_held_out": corpora.held_out, "noise": corpora.noise_texts[:200]})


def _stamp_matches(folder: Path, params: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text())["params"] == params
    except (OSError, ValueError, KeyError):
        return False


def _student_tokenizer(spec: StudentSpec, texts: list[str]):
    if spec.tokenizer == "sentencepiece_bpe":
        return train_student_tokenizer(texts, spec.vocab_size)
    if spec.tokenizer == "byte_level_bpe":
        return train_tokenizer(texts, spec.vocab_size)
    raise ValueError(f"student tokenizer {spec.tokenizer!r} is not one of {', '.join(STUDENT_TOKENIZERS)}")


def build_student(root: str | os.PathLike, spec: StudentSpec, corpora: Corpora, pretrain: PretrainSpec) -> Path:
    """The *base* student that continual pretraining starts from, as in the paper (TinyLlama is a
    pretrained model): a random-init Llama with its own tokenizer, pretrained with the plain
    next-token loss on a general mixture (math and noise pages, like the student corpus but drawn
    from another seed). Cached; one base per student, shared by every seed and arm.

    The tokenizer is trained on the teachers' clean texts (a tokenizer made from general text, not
    from the training corpus).
    """
    root = Path(root)
    folder = root / f"student-{spec.name}-base"
    params = {"spec": asdict(spec), "pretrain": asdict(pretrain), "n_texts": len(corpora.teacher_texts),
              "n_pretrain_texts": len(corpora.pretrain_texts)}
    if _stamp_matches(folder, params):
        return folder
    tokenizer = _student_tokenizer(spec, corpora.teacher_texts)
    model = new_student_model(tokenizer, spec, pretrain.seed)
    blocks = pack_blocks(tokenizer, corpora.pretrain_texts, pretrain.block)

    def write(work: Path) -> None:
        out = fit_blocks(model, blocks, work / "trainer", steps=pretrain.steps, batch_size=pretrain.batch_size,
                         learning_rate=pretrain.learning_rate, seed=pretrain.seed)
        shutil.rmtree(work / "trainer", ignore_errors=True)
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        (work / "pretraining.json").write_text(json.dumps({"final_train_loss": out.training_loss,
                                                           "blocks": len(blocks), "n_params": model.num_parameters()}))
        (work / STAMP).write_text(json.dumps({"params": params}, indent=1) + "\n")

    return build_folder(folder, write)
