"""Teachers the real engine meets: with a BOS token (a random-init Llama whose tokenizer puts BOS
first), whose positions leave no room for window + 1, that it cannot run, or that vLLM is missing
for. Each start-up failure is one line naming the setting and the fix (:class:`EngineStartError`,
a user error: never retried). Losses are checked against a plain transformers forward."""

from __future__ import annotations

import json

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM lives in its own environment: make test-vllm")

from pipeline.runtime.config import ConfigError, UserError  # noqa: E402
from pipeline.score_teacher.backends.base import ScorerConfig  # noqa: E402
from pipeline.score_teacher.backends.vllm import EngineStartError, VLLMScorer  # noqa: E402
from pipeline.score_teacher.corpus import CorpusConfig, Document  # noqa: E402
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig  # noqa: E402
from pipeline.score_teacher.prepare import prepare
from pipeline.score_teacher.teacher import WindowSettings, score_documents  # noqa: E402
from pipeline.method.tokenization import bos_token_id, load_tokenizer  # noqa: E402
from tests.vllm_engine.helpers import load_model, reference_document, remove_named_log, vllm_processes  # noqa: E402

pytestmark = pytest.mark.vllm

ATOL = 5e-5


@pytest.fixture(scope="module")
def bos_engine(bos_teacher):
    scorer = VLLMScorer(ScorerConfig(backend="vllm", model=str(bos_teacher), window=63, dtype="float32"))
    yield scorer
    scorer.close()


def test_a_teacher_with_bos_scores_the_first_token_and_windows_after(bos_engine, bos_teacher, micro_corpus):
    from pipeline.embedded.sample_corpus import clean_texts

    tokenizer, model = load_tokenizer(str(bos_teacher)), load_model(bos_teacher)
    bos = bos_token_id(tokenizer)
    assert bos is not None
    texts = [*sorted(clean_texts(micro_corpus), key=len)[-2:], "a"]
    settings = WindowSettings(window=63, stride=40, bos_id=bos)
    result = score_documents([Document(f"d{i}", t) for i, t in enumerate(texts)], tokenizer, bos_engine, settings)
    for doc in result.documents:
        z = np.concatenate([[bos], doc.ids])  # the model input: BOS, then the text's tokens
        expected = reference_document(model, z, 63, 40)[1:]
        assert np.isfinite(doc.losses).all(), "with BOS every token, the first included, has a loss"
        np.testing.assert_allclose(doc.losses, expected, atol=ATOL, rtol=0)
    assert len(result.documents[-1].ids) >= 1 and len(result.documents[0].ids) > 3 * 63


def test_a_teacher_whose_positions_leave_no_room_for_the_output_token(vllm_teacher, micro_corpus):
    """64 positions: stage 1 plans windows of 63 for vLLM (62 would waste a position, 64 the engine
    refuses); teacher.window=64 is refused before Ray with the fix; and the real engine itself
    refuses max_model_len = positions + 1, the reason for the rule."""
    def job(window):
        return ScoreJobConfig(teacher=TeacherConfig(name="m", model=str(vllm_teacher), window=window),
                              corpus=CorpusConfig(name="owm-micro", files=[str(f) for f in micro_corpus]),
                              scorer=ScorerConfig(backend="vllm"), output_dir="unused")

    assert prepare(job(None)).scorer.window == 63
    with pytest.raises(ConfigError, match=r"teacher.window: 64 \+ 1 .* set teacher.window <= 63"):
        prepare(job(64))
    with pytest.raises(EngineStartError, match=r"max_model_len \(65\) is greater than the derived max_model_len") as caught:
        VLLMScorer(ScorerConfig(backend="vllm", model=str(vllm_teacher), window=64, dtype="float32"))
    remove_named_log(str(caught.value))


def test_an_architecture_vllm_does_not_know_is_one_line_naming_the_other_backend(vllm_teacher, tmp_path):
    import shutil

    bad = tmp_path / "foobar"
    shutil.copytree(vllm_teacher, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineStartError) as caught:
        VLLMScorer(ScorerConfig(backend="vllm", model=str(bad), window=63, dtype="float32"))
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert "Model architectures ['FooBarForCausalLM'] are not supported" in message
    assert "use scorer.backend=transformers" in message and "Supported architectures" not in message
    remove_named_log(message)


def test_a_teacher_the_cpu_engine_cannot_run_fails_at_start_not_mid_job(micro_teacher):
    """The shared micro teacher has head size 16, which vLLM's CPU attention lacks: the engine starts,
    then dies on its first request. The scorer sends one at start-up, so the failure is a start-up
    failure: one line with the root cause (logged only by the engine's worker process), and no
    engine process is left."""
    if not _on_cpu():
        pytest.skip("a GPU runs head size 16")
    with pytest.raises(EngineStartError) as caught:
        VLLMScorer(ScorerConfig(backend="vllm", model=str(micro_teacher), window=63, dtype="float32"))
    message = str(caught.value)
    assert "\n" not in message
    assert "Unsupported CPU attention configuration: head_dim=16" in message
    assert "use scorer.backend=transformers" in message
    assert vllm_processes() == []
    remove_named_log(message)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
