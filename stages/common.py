"""Helpers shared by the Hydra entry points: config mappings into typed configs (:mod:`pipeline.config`),
the defaults the YAML files override, one-line errors, and logging."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from pipeline.config import ConfigError, UserError, build, raise_if  # noqa: F401  (stages import them from here)
from storage_schemas import ContractError
from storage_schemas.reader import DocumentNotFoundError

T = TypeVar("T")


def _dataset_dir(root: str, corpus: str, teacher: str) -> str:
    from storage_schemas import dataset_dir

    folder = dataset_dir(root, corpus, teacher)
    return folder if isinstance(folder, str) else folder.as_posix()  # an object-store URI stays a string


# ``${dataset_dir:<root>,<corpus>,<teacher>}`` in the YAML files: the scored folder's name comes
# from the contract (its schema version), never from a string repeated in configs.
OmegaConf.register_new_resolver("dataset_dir", _dataset_dir, replace=True)


def plain(cfg: DictConfig | dict, key: str | None = None) -> dict:
    node = cfg if key is None else cfg[key]
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def typed(cls: type[T], values: dict[str, Any], where: str, problems: list[str], drop: tuple[str, ...] = ()) -> T | None:
    """Build dataclass ``cls`` from ``values`` (:func:`pipeline.config.build`); problems are appended."""
    return build(cls, values, where, problems, drop=drop)


def register_defaults(name: str, tree: dict) -> None:
    """Make a stage's defaults (taken from its typed configs) the first entry of its YAML's
    defaults list, so the YAML only overrides and every key can be overridden without ``+``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=tree)


# The project's own errors about what the user gave. The contract package depends on nothing but
# pyarrow, so its errors (a bad shard, a document id not in the dataset) are named here.
USER_ERRORS = (UserError, ContractError, DocumentNotFoundError)


def exit_on_user_error(fn):
    """The project's user errors (:class:`pipeline.config.UserError`) end the stage with one clear
    line and exit code 2, no traceback (set VOCAGNO_TRACEBACK=1 to see it). Everything else (CUDA,
    NCCL and Ray errors, a bug) propagates with its traceback and another exit code."""
    import functools
    import os
    import sys

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            if os.environ.get("VOCAGNO_TRACEBACK"):
                raise
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def quiet_libraries() -> None:
    for name in ("transformers", "datasets", "ray", "filelock", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
