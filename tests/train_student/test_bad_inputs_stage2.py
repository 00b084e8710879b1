"""Stage 2 on bad inputs not covered elsewhere (docs/RELIABILITY.md, "Stage 2"): special-token
strings through the packed data, broken rows in a shard, student checkpoints that must be
refused, a missing scored folder, configuration values out of range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from storage_schemas.reader import BadShardError, ShardReader, open_scored_dataset
from pipeline.student_data.build import build_student_data
from pipeline.student_data.settings import AlignmentConfig, PackingConfig
from pipeline.method.tokenization import load_tokenizer
from pipeline.train_student.config import StudentConfig
from pipeline.train_student.run import load_student
from storage_schemas import file_sha256, read_manifest
from test_train_student import compose


@pytest.mark.parametrize("student", ["tiny-sentencepiece", "llama2"])
def test_special_token_strings_in_documents_are_student_text(student, tiny_student, real_tokenizer, micro_scored):
    """Documents quoting ``</s>`` and ``<s>`` reach the packed samples as text: no control-token id
    inside a document, only the BOS/EOS the packing puts around it; the text decodes back."""
    tok = load_tokenizer(str(tiny_student)) if student == "tiny-sentencepiece" else real_tokenizer("llama-spm")
    data = build_student_data(open_scored_dataset([micro_scored]), tok, PackingConfig(seq_len=32, shuffle=False),
                              AlignmentConfig())
    reader = ShardReader(data.scored.shards)
    texts = [reader.row(int(s), int(r)).text for s, r in zip(data.plan.doc_shard, data.plan.doc_row)]
    quoting = [d for d, t in enumerate(texts) if "</s>" in t and "<s>" in t]
    assert quoting, "the micro corpus has pages quoting special-token strings"
    special = set(tok.all_special_ids)
    for d in quoting:
        doc = data.dataset.document(d)
        body = doc.ids[1:-1].tolist()
        assert (doc.ids[0], doc.ids[-1]) == (tok.bos_token_id, tok.eos_token_id)
        assert not special & set(body), [tok.convert_ids_to_tokens(i) for i in special & set(body)]
        assert "</s>" in tok.decode(body) and "<s>" in tok.decode(body)
        assert doc.mapped[1:-1].mean() > 0.9  # aligned to the teacher like any other text


def test_shard_with_unequal_list_lengths_is_named_or_skipped(micro_scored, tiny_student, tmp_path):
    """A row whose ``losses`` list is one shorter than its ``token_ids`` (a footer, size and row
    count that all look right): the token count reads only ``text``, so it is found when a
    data-loader worker decodes that row group; with ``on_bad_shard=skip`` the count decodes every
    column and leaves the shard out before the plan is made."""
    folder = tmp_path / "ds"
    shutil.copytree(micro_scored, folder)
    victim = folder / "shard-000001.parquet"
    table = pq.read_table(victim)
    rows = table.to_pylist()
    rows[3]["losses"] = rows[3]["losses"][:-1]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), victim)
    manifest = read_manifest(folder)
    entry = next(e for e in manifest["shards"] if e["file"] == victim.name)
    entry["bytes"], entry["sha256"] = victim.stat().st_size, file_sha256(victim)
    (folder / "manifest.json").write_text(json.dumps(manifest))

    tok = load_tokenizer(str(tiny_student))
    scored = open_scored_dataset([folder], verify="sha256")  # a consistent file: every check on open passes
    data = build_student_data(scored, tok, PackingConfig(seq_len=32), AlignmentConfig())
    victim_docs = [d for d, s in enumerate(data.plan.doc_shard) if data.scored.shards[s].path.name == victim.name]
    with pytest.raises(BadShardError, match="shard-000001.parquet: row group 0: lengths of"):
        data.dataset.documents(victim_docs[:1])
    kept = build_student_data(scored, tok, PackingConfig(seq_len=32), AlignmentConfig(), on_bad_shard="skip")
    assert [Path(b["file"]).name for b in kept.scored.skipped] == [victim.name]


def test_student_checkpoints_that_must_be_refused(tiny_student, tmp_path):
    """Pickle-only weights (``pytorch_model.bin``) are refused; code named by a config's
    ``auto_map`` never runs without ``student.trust_remote_code``; a tokenizer larger than the
    embedding and a sequence longer than the model's context are refused before training."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_student)
    vocab = model.config.vocab_size

    pickled = tmp_path / "pickled"
    AutoConfig.from_pretrained(tiny_student).save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match="model.safetensors"):
        load_student(StudentConfig(name="s", model=str(pickled), seq_len=32), vocab)

    remote = tmp_path / "remote-code"
    shutil.copytree(tiny_student, remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "evil.py").write_text(  # subclasses: registering them leaves the Llama classes as they are
        f"open({str(tmp_path / 'code-ran')!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig): pass\n"
        "class EvilModel(LlamaForCausalLM): config_class = EvilConfig\n")
    assert StudentConfig(name="s", model="m").trust_remote_code is False
    load_student(StudentConfig(name="s", model=str(remote), seq_len=32), vocab)
    assert not (tmp_path / "code-ran").exists()
    load_student(StudentConfig(name="s", model=str(remote), seq_len=32, trust_remote_code=True), vocab)
    assert (tmp_path / "code-ran").exists()  # the control: the same folder runs it when allowed

    with pytest.raises(ValueError, match=f"has {vocab + 1} tokens, the model's embedding only {vocab} rows"):
        load_student(StudentConfig(name="s", model=str(tiny_student), seq_len=32), vocab + 1)
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"student.seq_len {context + 1} exceeds the model's context {context}"):
        load_student(StudentConfig(name="s", model=str(tiny_student), seq_len=context + 1), vocab)


def test_missing_scored_folder_and_out_of_range_settings_are_named(tmp_path):
    from stages.common import ConfigError
    from stages.train_student import job_config

    job_config(compose([f"data.folders=[{tmp_path}/never-scored]"]))  # the folders are checked when the stage runs
    with pytest.raises(ConfigError, match=f"data.folders: scored dataset folder not found: {tmp_path}/never-scored "
                                          r"\(score the corpus first"):
        job_config(compose([f"data.folders=[{tmp_path}/never-scored]"]), check_files=True)
    with pytest.raises(ConfigError, match="train.max_nonfinite_in_a_row: 0 must be >= 1"):
        job_config(compose(["train.max_nonfinite_in_a_row=0"]))
