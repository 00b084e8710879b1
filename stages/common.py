"""Helpers shared by the Hydra entry points: typed configs, checked all at once, and logging."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")


class ConfigError(ValueError):
    """One or more configuration problems; the message lists every one."""


def plain(cfg: DictConfig | dict, key: str | None = None) -> dict:
    node = cfg if key is None else cfg[key]
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def typed(cls: type[T], values: dict[str, Any], where: str, problems: list[str], drop: tuple[str, ...] = ()) -> T | None:
    """Build dataclass ``cls`` from ``values``; unknown and missing keys are added to ``problems``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: v for k, v in values.items() if k not in drop}
    unknown = sorted(set(values) - set(fields))
    missing = sorted(
        n for n, f in fields.items()
        if n not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    problems += [f"{where}.{k}: unknown key (known: {', '.join(sorted(fields))})" for k in unknown]
    problems += [f"{where}.{k}: required" for k in missing]
    if unknown or missing:
        return None
    return cls(**values)


def raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


USER_ERRORS = (ConfigError, FileNotFoundError, PermissionError, ValueError, RuntimeError)


def exit_on_user_error(fn):
    """Known input/config problems end the stage with one clear line and exit code 2, no traceback
    (set VOCAGNO_TRACEBACK=1 to see it)."""
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
