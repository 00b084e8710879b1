"""Comparing dataset identities (docs/METHOD.md §1.5, §2.5).

The identity (``manifest.json``'s ``identity``, and each shard's ``vocagno.identity``) says what
produced the data, never where it sits: the teacher by hub id and revision or by the digests of its
config and weights, its tokenizer by digest, the corpus by file names, row counts, sizes and content
digests (identity format :data:`IDENTITY_FORMAT`). Where the teacher and the corpus were found is
kept apart, in the manifest's ``location``, for people; it is never compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

IDENTITY_FORMAT = 2  # the identity holds content digests, no locations


def iter_identity_differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    """Human-readable differences between two identity dicts (nested), for clear refusals."""
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        name = f"{prefix}{key}"
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            yield from iter_identity_differences(va, vb, prefix=name + ".")
        elif va != vb:
            yield f"{name}: {va!r} != {vb!r}"


def describe_teacher(teacher: Mapping[str, Any]) -> str:
    """One line for people: the teacher's name, where it comes from (hub id and revision, or a
    local model by the start of its weights' digest), its dtype and BOS."""
    if teacher.get("source") == "hub":
        where = f"{teacher.get('model')} @ {teacher.get('revision') or 'main'}"
    else:
        weights = str(teacher.get("weights_sha256") or teacher.get("files_sha256") or "?")
        where = f"local model, weights sha256 {weights[:12]}"
    bos = f"BOS id {teacher['bos_id']}" if teacher.get("bos_id") is not None else "no BOS"
    return f"{teacher.get('name', '?')} ({where}; {teacher.get('dtype', '?')}, {bos})"


def shard_identity_differences(shard_identity: Mapping[str, Any], manifest: Mapping[str, Any]) -> list[str]:
    """How a shard's identity differs from its folder's (none: it belongs there)."""
    return list(iter_identity_differences(shard_identity, manifest.get("identity") or {}))


def data_identity_differences(recorded: dict, current: dict) -> list[str]:
    """How the data identity ``current`` (:meth:`storage_schemas.reader.ScoredDataset.identity`, plus what stage 2 adds)
    differs from ``recorded`` (a checkpoint's), leaving out where things are: each folder's path
    and manifest sha256 (the manifest also holds the location and code version of the last rerun,
    which change when the data does not; the shards' sha256, which cover each shard's footer and
    the identity in it, pin the data) and the paths and wording of skipped shards."""
    return list(iter_identity_differences(_comparable(recorded), _comparable(current)))


def _comparable(identity: dict) -> dict:
    out = {k: v for k, v in identity.items() if k not in ("folders", "shards_skipped")}
    # keyed by position, so that differences are named down to the field
    out["folders"] = {str(i): {"complete": f.get("complete"), "identity": f.get("identity")}
                      for i, f in enumerate(identity.get("folders") or [])}
    out["shards_skipped"] = [Path(s.get("file", "")).name for s in identity.get("shards_skipped") or []]
    mixture = identity.get("mixture")
    if isinstance(mixture, dict):  # a data mixture: each corpus's data compared as a run of it alone, by name
        corpora = mixture.get("corpora") or []
        out["mixture"] = {**mixture, "corpora": {str(c.get("name", i)): {**c, "data": _comparable(c.get("data") or {})}
                                                 for i, c in enumerate(corpora)},
                          "order": [c.get("name") for c in corpora]}
    return out
