"""``python -m stages.inspect``: every command through the composed Hydra config, on the real
stage-1 output (micro_scored), writing where it says; config problems reported all at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from rich.console import Console

from stages.common import ConfigError
from stages.inspect import run, tokenizer_slug

CONF = Path(__file__).resolve().parents[2] / "conf" / "inspect"
PNG = b"\x89PNG\r\n\x1a\n"


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("inspect", overrides=list(overrides))


def run_command(*overrides: str, console: Console | None = None) -> tuple[int, str]:
    console = console or Console(record=True, width=140, soft_wrap=True)
    status = run(config("progress=false", *overrides), console)
    return status, console.export_text(clear=False)


@pytest.fixture()
def mistral(shared_tokenizers) -> str:
    return str(shared_tokenizers / "mistral-v1.tokenizer.model")


def test_summary_writes_json_and_colours_one_document(micro_scored, tmp_path):
    console = Console(record=True, width=140, force_terminal=True, color_system="truecolor")
    status, text = run_command(f"path={micro_scored}", f"out_dir={tmp_path}", "summary.max_chars=300", console=console)
    assert status == 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["documents"] == json.loads((micro_scored / "manifest.json").read_text())["totals"]["documents"]
    assert saved["quantiles"]["0.5"] is not None and isinstance(saved["per_shard"], list)
    assert "per shard" in text and "highest mean loss" in text and "teacher loss (nats)" in text
    assert "micro (local model, weights sha256 " in text, "the teacher by its name, not None"
    assert "\x1b[" in console.export_text(styles=True)  # the document is coloured in a terminal


def test_default_out_dir_is_inside_the_dataset(micro_scored, tmp_path):
    import shutil

    copy = Path(shutil.copytree(micro_scored, tmp_path / "ds"))
    status, text = run_command("command=validate", f"path={copy}")
    assert status == 0 and (copy / "inspect" / "validation.json").is_file()
    assert f"wrote {copy / 'inspect' / 'validation.json'}" in text
    assert run_command("command=validate", f"path={copy}")[0] == 0  # its own output folder is no problem


def test_vocab_overlap_defaults_to_the_datasets_teacher(micro_scored, mistral, tmp_path):
    status, text = run_command("command=vocab-overlap", f"path={micro_scored}", f"student={mistral}", f"out_dir={tmp_path}")
    assert status == 0 and "raw strings" in text and "normalised" in text
    (saved,) = (tmp_path / "vocab-overlap").glob("*--vs--mistral-v1.tokenizer.json")
    result = json.loads(saved.read_text())
    assert result["teacher"]["kind"] == "byte_level" and result["student"]["tokens"] == 31_997
    assert 0 < result["normalised"]["shared"] <= result["normalised"]["teacher"]


def test_align_report_writes_report_and_aligned_tokens(micro_scored, mistral, tmp_path):
    status, text = run_command("command=align-report", f"path={micro_scored}", f"student={mistral}", f"out_dir={tmp_path}",
                               "align.limit_docs=25", "align.write_aligned=true", "align.chunk_counts=[1,8]")
    assert status == 0 and "token-level vs chunk-level alignment" in text and "8 chunks" in text
    report = json.loads((tmp_path / "align" / "mistral-v1.tokenizer.json").read_text())
    assert report["documents"] == 25 and set(report["chunk_level"]) == {"1", "8"}
    written = list((tmp_path / "aligned" / "mistral-v1.tokenizer").glob("shard-*.parquet"))
    import polars as pl

    assert pl.scan_parquet(written).select(pl.len()).collect().item() == 25


def test_html_and_plots(micro_scored, mistral, tmp_path):
    assert run_command("command=html", f"path={micro_scored}", f"student={mistral}", f"out_dir={tmp_path}")[0] == 0
    overview = (tmp_path / "html" / "overview--mistral-v1.tokenizer.html").read_text()
    assert overview.count("<h2>") == 3 and "highest mean loss" in overview and 'class="s"' in overview
    doc = json.loads((micro_scored / "manifest.json").read_text())["shards"][1]["source"]["first_doc_id"]
    assert run_command("command=html", f"path={micro_scored}", f"doc={doc}", f"out_dir={tmp_path}")[0] == 0
    single = next((tmp_path / "html").glob("train-00000-of-00002.parquet_40.html")).read_text()
    assert single.count("<h2>") == 1 and 'class="s"' not in single
    status, text = run_command("command=plots", f"path={micro_scored}", f"student={mistral}", f"out_dir={tmp_path}",
                               "align.limit_docs=20")
    pngs = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "plots").rglob("*.png"))
    assert status == 0 and pngs == ["plots/loss_histogram.png", "plots/mistral-v1.tokenizer/chunk_quality.png",
                                    "plots/mistral-v1.tokenizer/mapped_share.png",
                                    "plots/mistral-v1.tokenizer/teacher_per_student.png"]
    assert all((tmp_path / p).read_bytes().startswith(PNG) for p in pngs)


def test_config_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        run(config("command=align-report", "align.how=median", "align.chunk_counts=[0,4]"), Console(quiet=True))
    message = str(err.value)
    for expected in ("path: command=align-report needs path", "student: command=align-report needs student",
                     "align.how: 'median'", "align.chunk_counts"):
        assert expected in message
    with pytest.raises(ConfigError, match="command: 'bogus' is not one of"):
        run(config("command=bogus"), Console(quiet=True))


@pytest.mark.parametrize(("source", "slug"), [
    ("Qwen/Qwen2.5-Math-7B-Instruct", "Qwen--Qwen2.5-Math-7B-Instruct"),
    ("../shared/tokenizers/ggml-vocab-llama-spm.gguf", "ggml-vocab-llama-spm"),
    ("/abs/mistral-v1.tokenizer.model", "mistral-v1.tokenizer"),
    ("./my tokenizer/", "my_tokenizer"),
])
def test_tokenizer_slug(source, slug):
    assert tokenizer_slug(source) == slug


def test_terminal_output_never_reads_data_as_markup():
    """Doc ids and token text such as ``[/math]`` print literally (rich would parse them as tags)."""
    import numpy as np

    from storage_schemas.reader import DocumentRecord
    from pipeline.inspection.pieces import LossScale
    from pipeline.inspection.terminal import document_table, document_text

    text = "x [/math] [bold] [/] y"
    record = DocumentRecord("[/doc]", text, np.arange(5, dtype=np.int32), np.array([0, 2, 10, 17, 21], np.int32),
                            np.array([2, 10, 17, 21, 22], np.int32), np.array([np.nan, 1, 2, 3, 4], np.float32), "f", 0)
    console = Console(record=True, width=100)
    scale = LossScale.from_values(record.losses)
    console.print(document_table(record))
    console.print(document_text(record, scale))
    out = console.export_text()
    assert "'[/math] '" in out and "[/doc]" in out and text in out


def test_an_out_dir_that_is_or_holds_a_dataset_is_refused(tmp_path):
    dataset = tmp_path / "scored" / "v1"
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_text("{}")  # a stand-in: the refusal comes before anything is read
    for out, how in ((dataset, "is path"), (tmp_path / "scored", "holds path")):
        with pytest.raises(ConfigError, match=f"out_dir {out} {how} "):
            run_command(f"path={dataset}", f"out_dir={out}")
    assert sorted(p.name for p in dataset.iterdir()) == ["manifest.json"]
