"""The bench's parameter count of a model folder it did not build (a real teacher's: no stamp),
against a count by hand from the shapes of the tensors stored in its safetensors file."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from benchmarks.inputs import RandomModelShape, build_model, model_parameters


@pytest.mark.parametrize("tied", [False, True])
def test_parameters_of_a_folder_without_a_stamp(tmp_path, tied):
    shape = RandomModelShape(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, context=64,
                             tie_word_embeddings=tied)
    build_model(shape, vocab_size=100).save_pretrained(str(tmp_path), safe_serialization=True)
    assert not (tmp_path / "_BENCH_MODEL.json").exists()
    stored = {}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= d
            stored[name] = n
    # Per layer: q,k,v,o 4*32*32, gate/up/down 3*32*48, two norms 2*32 = 4096+4608+64 = 8768; the
    # embedding 100*32 = 3200, the final norm 32, the head 3200 unless tied (not stored then).
    by_hand = 2 * 8768 + 3200 + 32 + (0 if tied else 3200)
    assert sum(stored.values()) == by_hand
    assert model_parameters(tmp_path) == {"total": by_hand, "embedding": 3200, "non_embedding": by_hand - 3200}
