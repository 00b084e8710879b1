"""Comparing dataset identities (docs/METHOD.md §1.5, §2.5).

The identity (``manifest.json``'s ``identity``, and each shard's ``vocagno.identity``) says what
produced the data, never where it sits: the teacher by hub id and revision or by the digests of its
config and weights, its tokenizer by digest, the corpus by file names, row counts, sizes and content
digests (identity format :data:`IDENTITY_FORMAT`). Where the teacher and the corpus were found is
kept apart, in the manifest's ``location``, for people; it is never compared. A manifest written
before this format (no ``format`` key) is adopted with ``migrate_identity=true``: its old identity
is kept as ``adopted_from``, and shards written under it stay valid.
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


def identity_format(identity: Mapping[str, Any]) -> int:
    """The identity's format: 1 for identities written before the format was recorded."""
    return int(identity.get("format", 1))


def shard_identity_differences(shard_identity: Mapping[str, Any], manifest: Mapping[str, Any]) -> list[str]:
    """How a shard's identity differs from its folder's: none when it equals the manifest's
    identity, or the identity the folder had before it was migrated (``adopted_from``)."""
    adopted = manifest.get("adopted_from")
    if adopted is not None and dict(shard_identity) == adopted:
        return []
    return list(iter_identity_differences(shard_identity, manifest.get("identity") or {}))


def data_identity_differences(recorded: dict, current: dict) -> list[str]:
    """How the data identity ``current`` (:meth:`storage_schemas.reader.ScoredDataset.identity`, plus what stage 2 adds)
    differs from ``recorded`` (a checkpoint's), leaving out where things are: each folder's path
    and manifest sha256 (the manifest also holds the location and code version of the last rerun,
    which change when the data does not; the shards' sha256, which cover each shard's footer and
    the identity in it, pin the data) and the paths and wording of skipped shards. A folder
    migrated since the record (``adopted_from``) matches the identity it was adopted from."""
    return list(iter_identity_differences(_comparable(recorded, current), _comparable(current, None)))


def _comparable(identity: dict, current: dict | None) -> dict:
    out = {k: v for k, v in identity.items() if k not in ("folders", "shards_skipped")}
    now = (current or {}).get("folders") or []
    folders = {}  # keyed by position, so that differences are named down to the field
    for i, folder in enumerate(identity.get("folders") or []):
        ident = folder.get("identity")
        adopted = now[i].get("adopted_from") if i < len(now) else None
        if adopted is not None and ident == adopted:
            ident = now[i]["identity"]
            if i == 0:
                out["teacher"] = current.get("teacher")
        folders[str(i)] = {"complete": folder.get("complete"), "identity": ident}
    out["folders"] = folders
    out["shards_skipped"] = [Path(s.get("file", "")).name for s in identity.get("shards_skipped") or []]
    return out
