"""Typed configs from plain mappings, every problem reported at once.

Each stage's settings are frozen dataclasses: their defaults are the one place a default lives,
and a ``problems()`` method lists what is wrong with a value (a choice not among the allowed ones,
a number out of range) as ``"field: text"`` lines. :func:`build` turns a mapping (a composed YAML
config, a test's dict) into such a dataclass and collects, in one list, unknown keys, missing
required keys, values of the wrong type and the dataclass's own problems, so a typo in one key
never hides a bad value beside it. :func:`defaults` gives the mapping of defaults that a config
front end (Hydra in ``stages/``) lays under its YAML, which then only overrides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import signal
import types
import typing
from typing import Any, Iterable, Iterator, Mapping, TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A problem with what the user gave (configuration, input files, an output folder) that the
    message explains in full. A stage ends on one with that message on one line and exit code 2;
    any other exception (CUDA, NCCL, Ray, a bug) keeps its traceback. Subclasses also derive from
    the builtin error they refine (ValueError, FileNotFoundError ...) so callers may catch either."""


class ConfigError(UserError, ValueError):
    """One or more configuration problems; the message lists every one (``problems``)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]


class MissingPathError(UserError, FileNotFoundError):
    """A file or folder the configuration names does not exist."""


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM, SIGUSR1) stopped the work; raised in the main thread so that every
    ``finally`` runs (locks released, temporary files removed) before the entry point exits with
    the signal's status. ``detail``: what was kept, when there is more to say than that."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.detail = detail


@contextlib.contextmanager
def handling(signals: Iterable[int], handler) -> Iterator[None]:
    """``handler`` for each of ``signals`` (main thread only) while the block runs; the previous
    handlers come back after it."""
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def raise_if(problems: list[str]) -> None:
    """Raise :class:`ConfigError` when there are ``problems``: one problem as one line, several
    listed one per line."""
    if len(problems) == 1:
        raise ConfigError(problems[0], problems)
    if problems:
        raise ConfigError(f"invalid configuration ({len(problems)} problems):\n  - " + "\n  - ".join(problems), problems)


def override(key: str, value) -> str:
    """``key=value`` as a command line gives it to Hydra: the value quoted where Hydra would split
    or parse it (a comma, brackets, quotes), as it is otherwise (spaces, globs and URIs are read as
    they are). Messages and printed commands write settings with it, so that they run as printed."""
    value = str(value)
    if not re.search(r"[,\[\]{}()'\"\\$]", value) and value == value.strip():
        return f"{key}={value}"
    quote = '"' if '"' not in value else "'"
    return f"{key}={quote}{value}{quote}"


def nearest(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean <choice>?"`` for the choice closest to ``word``, or ``""``."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def check_choice(problems: list[str], name: str, value: Any, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        problems.append(f"{name}: {value!r} is not one of {', '.join(choices)}{nearest(str(value), choices)}")


def check_at_least(problems: list[str], name: str, value: Any, low: int) -> None:
    if value is not None and value < low:
        problems.append(f"{name}: {value} must be >= {low}")


def refuse(obj: Any) -> None:
    """For ``__post_init__``: a dataclass built directly in code raises on its first problem."""
    found = obj.problems()
    if found:
        raise ValueError("; ".join(found))


def lift_progress(values: Mapping[str, Any], group: str) -> dict[str, Any]:
    """``progress``, the one key every command reads for its progress bars, moved into ``group``
    (``train``, ``export``), where the command's own key has always been (``train.progress``, kept
    as an alias). The top-level key is ``None`` unless given; given, it decides."""
    values = dict(values)
    given = values.pop("progress", None)
    if given is not None:
        values[group] = {**dict(values.get(group) or {}), "progress": given}
    return values


def build(cls: type[T], values: Mapping[str, Any] | None, where: str, problems: list[str], *,
          drop: Iterable[str] = (), rename: Mapping[str, str] | None = None,
          assume: Iterable[str] = (), also_known: Iterable[str] = ()) -> T | None:
    """Dataclass ``cls`` from ``values``; each problem is appended to ``problems`` as
    ``"<where>.<key>: ..."``. Keys in ``drop`` are ignored (they belong to another consumer);
    ``rename`` maps a key as written to its field name; fields in ``assume`` are not reported
    missing (they were built elsewhere and failed there); keys in ``also_known`` belong to another
    dataclass read from the same group (listed among the known keys, never reported). Fields typed as a dataclass accept an
    instance or a mapping (built recursively), and fields typed as a list of a dataclass a list of them. Returns None when anything is wrong."""
    rename = dict(rename or {})
    shown = {field: key for key, field in rename.items()}  # field name -> the key as written
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    drop = tuple(drop)
    values = {rename.get(k, k): v for k, v in (values or {}).items() if k not in set(drop)}
    prefix = f"{where}." if where else ""
    own: list[str] = []

    known = sorted({shown.get(n, n) for n in (*fields, *drop, *also_known)})
    for key in sorted(set(values) - set(fields)):
        written = shown.get(key, key)
        if written not in set(also_known):
            own.append(f"{prefix}{written}: unknown key{nearest(written, known)} (known: {', '.join(known)})")
    for name, f in fields.items():
        if (name not in values and name not in set(assume) and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING):
            own.append(f"{prefix}{shown.get(name, name)}: required")

    good: dict[str, Any] = {}
    mistyped: list[str] = []
    for name in sorted(set(values) & set(fields)):
        value, hint = values[name], hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            value = build(hint, value, f"{prefix}{shown.get(name, name)}", own)
            if value is None:
                continue
        element = _listed_dataclass(hint)
        if element is not None and isinstance(value, (list, tuple)):
            value = [build(element, v, f"{prefix}{shown.get(name, name)}[{i}]", own) if isinstance(v, Mapping) else v
                     for i, v in enumerate(value)]
            if any(v is None for v in value):
                continue
        if _fits(value, hint):
            good[name] = value
        else:
            own.append(f"{prefix}{shown.get(name, name)}: {value!r} is not {_describe(hint)}")
            mistyped.append(name)

    required_missing = any(n not in good and fields[n].default is dataclasses.MISSING
                           and fields[n].default_factory is dataclasses.MISSING for n in fields)
    if not required_missing and hasattr(cls, "problems"):
        for line in _unchecked(cls, good).problems():  # checked before construction: every problem, not the first
            head, sep, text = line.partition(":")
            if any(name in line for name in mistyped):
                continue  # compared with the default standing in for a value of the wrong type
            own.append(f"{prefix}{shown.get(head, head)}{sep}{text}" if head in fields else f"{prefix}{line}")
    problems.extend(own)
    return None if own or required_missing else cls(**good)


def defaults(cls: type, drop: Iterable[str] = (), rename: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The defaults of dataclass ``cls`` as a plain mapping (fields without a default left out,
    dataclass-typed fields as nested mappings), keyed as the config is written."""
    rename = {field: key for key, field in (rename or {}).items()}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in set(drop):
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        out[rename.get(f.name, f.name)] = _as_values(value)
    return out


def _as_values(value: Any) -> Any:
    """A default as a config file writes it: a dataclass instance as the mapping of its own values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_values(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _unchecked(cls: type[T], values: dict[str, Any]) -> T:
    """An instance of ``cls`` with ``values`` and the defaults, without running ``__post_init__``."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()
        object.__setattr__(obj, f.name, value)
    return obj


def _listed_dataclass(hint: Any) -> type | None:
    """``X`` when ``hint`` is ``list[X]`` (or ``list[X] | None``) of a dataclass ``X``: such a field
    takes a list of mappings, each built as an ``X``."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        args = typing.get_args(option)
        if typing.get_origin(option) is list and args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and (not args or all(_fits(v, args[0]) for v in value))
    if origin is dict or hint is dict:
        return isinstance(value, Mapping)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint)
    return True  # a type this checker does not know: the dataclass's own checks decide


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])}" if args else "a list"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
