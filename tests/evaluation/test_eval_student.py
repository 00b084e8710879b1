"""The evaluation stage end to end: real tiny HF models, local JSONL task files written here, the
real generate loop, scoring checked against a model whose every output is known."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from pipeline.evaluation.generation import GenerationConfig
from pipeline.evaluation.run import EvalJobConfig, TaskInput, run_evaluation
from pipeline.evaluation.tasks import TASKS, DataError, lm_eval_exemplars, load_exemplars, load_records

REPO = Path(__file__).resolve().parents[2]

# The "chain" model: a one-layer Llama whose attention and MLP write nothing, so its next token is a
# fixed function of the current token. After "A:" it always says "The answer is 42 ." and then
# "Q:" (a stop sequence); after "Solution:" it says "\boxed{42}" then "Problem:".
CHAIN = {"A:": "The", "The": "answer", "answer": "is", "is": "42", "42": ".", ".": "Q:", "Q:": "Q:",
         "Solution:": "\\boxed{42}", "\\boxed{42}": "Problem:", "Problem:": "Problem:"}
CHAIN_OUTPUT = "The answer is 42 ."


def build_chain_model(out: Path, context: int = 512) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "</s>"] + sorted(set(CHAIN) | set(CHAIN.values()))
    vocab = {w: i for i, w in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>")
    hidden = 32
    config = LlamaConfig(vocab_size=len(words), hidden_size=hidden, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=context,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=vocab["</s>"], bos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, : len(words)] = torch.eye(len(words))  # token t -> e_t
        for t in range(len(words)):  # logits: next(t) gets 1, everything else 0
            model.lm_head.weight[vocab[CHAIN.get(words[t], ".")], t] = 1.0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


GSM8K = [  # gold 42 in three forms: 3 of 6 correct for a model that always answers 42
    {"question": "Tom has 40 apples and buys 2 more. How many now?", "answer": "He has 40 + 2 = <<40+2=42>>42.\n#### 42"},
    {"question": "What is 6 times 7?", "answer": "42"},
    {"question": "What is 6 times 7 minus 1?", "answer": "#### 41"},
    {"question": "How many are 84 halves?", "answer": 42.0},
    {"question": "How many people?", "answer": "#### 1,042"},
    {"question": "How many days in a week?", "answer": "7"},
]
MATH = [  # 2 of 3 correct: \frac{84}{2} equals 42
    {"question": "Compute $6 \\cdot 7$.", "answer": "$6 \\cdot 7 = \\boxed{42}$"},
    {"question": "Compute $84/2$.", "answer": "\\frac{84}{2}"},
    {"question": "Compute $43$.", "answer": "43"},
]
GOLD_VALUES = {"gsm8k": [42, 42, 41, 42, 1042, 7], "math": [42, 42, 43]}  # the records above, by hand


def plain_number(text: str | None) -> Fraction | None:
    """``text`` as an exact number when it is a plain decimal or fraction (thousands commas allowed)."""
    try:
        return Fraction(text.replace(",", "")) if text is not None else None
    except ValueError:
        return None


SHOTS = [
    {"question": "Ann has 3 pens and gets 2. How many?", "answer": "She has 3 + 2 = <<3+2=5>>5 pens.\n#### 5"},
    {"question": "Bob had 9 and lost 4. How many left?", "answer": "9 - 4 = 5 left. #### 5"},
]
MATH_SHOTS = [
    {"question": "Compute $1+1$.", "answer": "$1+1=\\boxed{2}$."},
    {"question": "Compute $2+2$.", "answer": "4"},
]


def write_tasks(d: Path) -> Path:
    write_jsonl(d / "gsm8k.jsonl", GSM8K)
    write_jsonl(d / "math.jsonl", MATH)
    write_jsonl(d / "shots" / "gsm8k.jsonl", SHOTS)
    write_jsonl(d / "shots" / "math.jsonl", MATH_SHOTS)
    return d


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory) -> Path:
    return build_chain_model(tmp_path_factory.mktemp("chain") / "model")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


def chain_job(model: Path, task_dir: Path, out: Path, tasks=("gsm8k", "math"), **changes) -> EvalJobConfig:
    generation = GenerationConfig(model=str(model), batch_size=4, max_new_tokens=12, cpu_threads=1,
                                  **changes.pop("generation", {}))
    inputs = [TaskInput(t, str(task_dir / f"{t}.jsonl"), str(task_dir / "shots" / f"{t}.jsonl")) for t in tasks]
    return EvalJobConfig(generation=generation, tasks=inputs, output_dir=str(out),
                         num_fewshot=changes.pop("num_fewshot", 2), progress=False,
                         **{"fewshot_source": "file", **changes})


def read_samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_scores_a_model_whose_answers_are_known(chain_model, task_dir, tmp_path):
    record = run_evaluation(chain_job(chain_model, task_dir, tmp_path / "eval"))
    g, m = record["tasks"]["gsm8k"], record["tasks"]["math"]
    assert (g["n"], g["correct"], g["accuracy"], g["no_answer"]) == (6, 3, 0.5, 0)
    assert (m["n"], m["correct"], m["no_answer"]) == (3, 2, 0) and m["accuracy"] == pytest.approx(2 / 3)
    samples = read_samples(tmp_path / "eval")
    gsm8k, math = samples[:6], samples[6:]
    assert [s["generation"].strip() for s in gsm8k] == [CHAIN_OUTPUT] * 6  # cut before the stop sequence "Q:"
    assert [s["gold"] for s in gsm8k] == ["42", "42", "41", "42", "1042", "7"]
    assert [s["correct"] for s in gsm8k] == [True, True, False, True, False, False]
    assert [s["line"] for s in gsm8k] == [1, 2, 3, 4, 5, 6] and [s["index"] for s in gsm8k] == list(range(6))
    assert [s["generation"].strip() for s in math] == ["\\boxed{42}"] * 3  # cut before "Problem:"
    assert [s["correct"] for s in math] == [True, True, False]
    assert m["example_prompt"].startswith("Problem:\nCompute $1+1$.\n\nSolution: $1+1=\\boxed{2}$.\n\nProblem:\n")
    assert "Solution: The final answer is $\\boxed{4}$.\n\n" in m["example_prompt"]


def test_fewshot_file_is_required_when_asked_for(chain_model, task_dir, tmp_path):
    job = chain_job(chain_model, task_dir, tmp_path / "eval")
    job = EvalJobConfig(**{**job.__dict__, "tasks": [TaskInput("math", job.tasks[1].data_file)]})
    with pytest.raises(FileNotFoundError, match="math: fewshot_source=file but no few-shot file"):
        run_evaluation(job)
    assert not (tmp_path / "eval").exists()


def test_prompt_has_the_exemplars_in_chain_of_thought_form(chain_model, task_dir, tmp_path):
    record = run_evaluation(chain_job(chain_model, task_dir, tmp_path / "eval", tasks=["gsm8k"]))
    prompt = record["tasks"]["gsm8k"]["example_prompt"]
    assert prompt == ("Q: Ann has 3 pens and gets 2. How many?\nA: She has 3 + 2 = 5 pens. The answer is 5.\n\n"
                      "Q: Bob had 9 and lost 4. How many left?\nA: 9 - 4 = 5 left. The answer is 5.\n\n"
                      "Q: Tom has 40 apples and buys 2 more. How many now?\nA:")
    comparable = record["tasks"]["gsm8k"]["comparable"]
    assert comparable["num_fewshot"] == 2 and comparable["n"] == 6 and comparable["stop"] == ["Q:", "\n\n"]


def test_outputs_and_identity(chain_model, task_dir, tmp_path):
    from storage_schemas import file_sha256

    out = tmp_path / "eval"
    record = run_evaluation(chain_job(chain_model, task_dir, out, limit=4, label="chain", tasks=["gsm8k"]))
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.md", "samples.jsonl"]
    assert json.loads((out / "eval.json").read_text()) == record
    assert record["tasks"]["gsm8k"]["n"] == 4 and record["settings"]["limit"] == 4
    ident = record["identity"]
    assert ident["kind"] == "local" and ident["config_sha256"] == file_sha256(chain_model / "config.json")
    assert len(ident["weights_sha256"]) == 64 and ident["tokenizer_sha256"]
    assert "| gsm8k | 2 | 4 | 3 | 75.0% | 0 |" in (out / "eval.md").read_text()


def test_prompts_longer_than_the_context_keep_their_end(task_dir, tmp_path):
    model = build_chain_model(tmp_path / "short", context=24)
    record = run_evaluation(chain_job(model, task_dir, tmp_path / "eval", tasks=["gsm8k"]))
    assert record["truncated_prompts"] == 6  # 2-shot prompts are ~40 words; 24 - 12 new tokens fit
    assert record["tasks"]["gsm8k"]["correct"] == 3  # the problem's own "A:" was kept


@pytest.fixture(scope="module")
def tiny_student(micro_corpus, tmp_path_factory) -> Path:
    from pipeline.embedded.sample_corpus import clean_texts
    from pipeline.embedded.tiny_student import TinyStudentSpec, build_tiny_student

    spec = TinyStudentSpec(vocab_size=400, limit_alphabet=100, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, context=256, seed=5)
    return build_tiny_student(clean_texts(micro_corpus)[:60], tmp_path_factory.mktemp("student") / "sp", spec)


def test_stage_end_to_end_on_the_tiny_student(tiny_student, task_dir, tmp_path):
    """``python -m stages.eval_student`` on the embedded student's architecture and tokenizer:
    accuracy is exactly the share of per-sample records the scorer marks correct."""
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, "-m", "stages.eval_student", f"checkpoint={tiny_student}", "tasks=[gsm8k,math]",
         f"data_dir={task_dir}", f"fewshot_dir={task_dir / 'shots'}", "num_fewshot=0", "generation.max_new_tokens=8",
         "generation.cpu_threads=1", f"out_dir={out}", "hydra.run.dir=" + str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((out / "eval.json").read_text())
    samples = read_samples(out)
    assert [s["task"] for s in samples] == ["gsm8k"] * 6 + ["math"] * 3
    judged = 0
    for task in ("gsm8k", "math"):
        rows = [s for s in samples if s["task"] == task]
        for s, gold in zip(rows, GOLD_VALUES[task]):  # each stored verdict judged by hand where it can be
            value = plain_number(s["extracted"])
            if s["extracted"] is None:
                assert s["correct"] is False, s
            elif value is not None:
                assert s["correct"] == (value == gold), s
                assert s["extracted"].replace(",", "") in s["generation"].replace(",", ""), s
            else:
                continue  # a LaTeX answer: no hand reference here
            judged += 1
        r = record["tasks"][task]
        assert r["n"] == len(rows) and r["correct"] == sum(s["correct"] for s in rows)
        assert r["accuracy"] == r["correct"] / r["n"]
    assert judged >= 6, samples
    assert record["identity"]["kind"] == "local" and record["label"] == "sp"
    assert "gsm8k" in result.stdout and f"Wrote {out / 'eval.json'}, eval.md" in result.stdout  # never wrapped


@pytest.mark.parametrize("line, message", [
    ("{not json", "gsm8k.jsonl:2: not valid JSON"),
    ('["a list"]', "gsm8k.jsonl:2: expected a JSON object"),
    ('{"question": "q"}', "gsm8k.jsonl:2: 'answer' must be a string or a number"),
    ('{"question": "", "answer": "1"}', "gsm8k.jsonl:2: 'question' must be a non-empty string"),
    ('{"question": "q", "answer": "no number"}', "gsm8k.jsonl:2: no numeric answer"),
])
def test_bad_lines_name_the_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K[0], line])
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        load_records(path, TASKS["gsm8k"])


def test_bad_input_exits_2_with_one_line(chain_model, tmp_path):
    data = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K[0], "", '{"question": "q", "answer": 1', GSM8K[1]])
    bad = subprocess.run([sys.executable, "-m", "stages.eval_student", f"checkpoint={chain_model}", "num_fewshot=0",
                          f"data_files.gsm8k={data}", f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'logs'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr == f"error: {data}:3: not valid JSON (Expecting ',' delimiter)\n"
    assert not (tmp_path / "out").exists()


def test_every_config_problem_is_reported_at_once(tmp_path):
    from hydra import compose, initialize_config_dir

    from stages.common import ConfigError
    from stages.eval_student import job_config

    overrides = [f"data_files.gsm8k={tmp_path / 'nope.jsonl'}", "tasks=[gsm8k,sat,gsm9k]", "limit=0",
                 "generation.backend=onnx", "fewshot_source=web", "checkpoint=../not/here"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="eval_student", overrides=overrides)
    with pytest.raises(ConfigError) as err:
        job_config(cfg)
    for problem in ("gsm8k: task file not found", "nope.jsonl", "sat: no task file", "unknown gsm9k", "limit: 0",
                    "generation.backend: 'onnx'", "fewshot_source: 'web'", "checkpoint: ../not/here is not a folder"):
        assert problem in str(err.value)


def test_output_folder_is_named_after_the_checkpoint(tmp_path):
    from stages.eval_student import run_name

    final = tmp_path / "students" / "owm" / "tiny-tiny-guided" / "final"
    final.mkdir(parents=True)
    assert run_name(str(final)) == "tiny-tiny-guided-final"
    assert run_name("TinyLlama/TinyLlama_v1.1") == "TinyLlama--TinyLlama_v1.1"


def test_choice_records_and_prompt(tmp_path):
    from pipeline.evaluation.tasks import build_prompt, fewshot_prefix

    spec = TASKS["mathqa"]
    path = write_jsonl(tmp_path / "mathqa.jsonl", [
        {"question": "2 + 2?", "choices": ["3", "4", "5"], "answer": "b"},
        {"question": "3 + 3?", "choices": ["6", "7"], "answer": 0},
        {"question": "Pick (A) 1 (B) 2", "answer": "(B)"},
    ])
    records = load_records(path, spec)
    assert [r.gold for r in records] == ["B", "A", "B"]
    shots = load_exemplars(write_jsonl(tmp_path / "shots.jsonl", [{"question": "1 + 1?", "choices": ["2", "3"], "answer": "A"}]), spec)
    prompt = build_prompt(spec, fewshot_prefix(spec, shots), records[0])
    assert prompt == ("Q: 1 + 1?\nAnswer Choices: (A) 2 (B) 3\nA: The answer is (A).\n\n"
                      "Q: 2 + 2?\nAnswer Choices: (A) 3 (B) 4 (C) 5\nA:")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "choices": ["1", "2"], "answer": "D"}])
    with pytest.raises(DataError, match="bad.jsonl:1: no choice answer"):
        load_records(bad, spec)


def test_choice_tasks_need_a_fewshot_file_unless_zero_shot(chain_model, tmp_path):
    data = write_jsonl(tmp_path / "sat.jsonl", [{"question": "q", "choices": ["1", "2"], "answer": "A"}])
    job = EvalJobConfig(generation=GenerationConfig(model=str(chain_model)), tasks=[TaskInput("sat", str(data))],
                        output_dir=str(tmp_path / "out"), progress=False)
    with pytest.raises(ValueError, match="sat: 4-shot needs a few-shot file"):
        run_evaluation(job)


def test_lm_eval_standard_exemplars():
    from importlib.util import find_spec

    if find_spec("lm_eval") is None:
        pytest.skip("lm-evaluation-harness is not installed (pip install 'vocagno[eval]')")
    shots = lm_eval_exemplars("gsm8k_cot")
    assert len(shots) == 8 and all(s.target.rstrip().endswith(".") and "The answer is" in s.target for s in shots)
    assert shots[0].question.startswith("There are 15 trees in the grove")
    math_shots = lm_eval_exemplars("minerva_math")
    assert len(math_shots) == 4 and all("\\boxed" in s.target for s in math_shots)


@pytest.mark.vllm
@pytest.mark.gpu
def test_vllm_backend_generates_in_prompt_order(chain_model, task_dir, tmp_path):
    pytest.importorskip("vllm")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a GPU")
    record = run_evaluation(chain_job(chain_model, task_dir, tmp_path / "eval", generation={"backend": "vllm"}, tasks=["gsm8k"]))
    assert record["tasks"]["gsm8k"]["correct"] == 3 and record["settings"]["backend"] == "vllm"
