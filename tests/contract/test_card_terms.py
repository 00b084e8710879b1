"""What a dataset card says of its corpus's terms: a license and source datasets only where they
are known (a hub corpus read from the hub, or a license its user gave), for the scored dataset's
card and the export's. Manifests are written by hand here; the expected front matter too."""

from __future__ import annotations

import yaml
from huggingface_hub import DatasetCardData

from pipeline.folders.dataset_card import front_matter, shared_terms
from pipeline.export_student import card as export_card

OWM = "open-web-math/open-web-math"


def scored_manifest(source: str, hub_id: str | None, license: str | None = None) -> dict:
    manifest = {"identity": {"corpus": {"name": "c", "source": source, "hub_id": hub_id}, "teacher": {"name": "t"}},
                "totals": {"documents": 10}, "shards": [{"file": "shard-000000.parquet", "sha256": "ab"}]}
    return {**manifest, "license": license} if license else manifest


def meta(front: dict) -> dict:
    """The front matter as the card's YAML holds it."""
    return yaml.safe_load(DatasetCardData(**front).to_yaml())


def test_a_hub_corpus_read_from_the_hub_has_its_known_terms():
    got = meta(front_matter(scored_manifest("hub", OWM)))
    assert (got["license"], got["language"], got["source_datasets"]) == ("odc-by", ["en"], [OWM])
    other = meta(front_matter(scored_manifest("hub", "someone/else")))
    assert "license" not in other and "language" not in other and other["source_datasets"] == ["someone/else"]


def test_a_corpus_from_files_has_no_terms_whatever_preset_it_was_named_from():
    got = meta(front_matter(scored_manifest("files", OWM)))  # data=open-web-math data.source=files
    assert not {"license", "language", "source_datasets"} & set(got), got


def test_a_license_given_is_stated_and_wins_over_the_known_one():
    assert meta(front_matter(scored_manifest("files", OWM, "cc-by-4.0")))["license"] == "cc-by-4.0"
    assert meta(front_matter(scored_manifest("hub", OWM, "other")))["license"] == "other"


def test_an_export_states_only_the_terms_its_corpora_share():
    owm = {"license": "odc-by", "language": ["en"], "source_datasets": [OWM]}
    mine = {"license": "cc-by-4.0", "language": None, "source_datasets": None}
    assert shared_terms([owm, owm]) == owm
    assert shared_terms([owm, mine]) == {"license": None, "language": None, "source_datasets": [OWM]}
    export = {"identity": {"teachers": []}, "totals": {"rows": 3}, "shards": [{"file": "shard-000000.parquet"}],
              "terms": mine}
    assert meta(export_card.front_matter(export))["license"] == "cc-by-4.0"
    assert "license" not in meta(export_card.front_matter({**export, "terms": shared_terms([owm, mine])}))
