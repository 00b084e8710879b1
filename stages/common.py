"""The one way every entry point is configured (the stages here, and the lab's ``benchmarks``,
``repro`` and ``mutation``), and what they share: one-line errors, interrupts, logging.

An entry point has a typed schema in code: frozen dataclasses whose defaults are the one place a
default lives, with a ``problems()`` method each (:mod:`pipeline.runtime.config`). :func:`entry_point`
registers the schema's defaults once in Hydra's ConfigStore as ``<config_name>_defaults``, the first
entry of the YAML file's defaults list, so ``conf/<config_name>.yaml`` holds only what differs, and
wraps the entry point's ``main``:

1. before Hydra composes anything, every override on the command line is checked against the
   composed configuration (:func:`override_problems`): a key that does not exist (with or without
   ``+``, with the nearest known key), a preset that does not exist (with the list of presets);
2. the entry point's own ``check`` (its typed config built with :func:`pipeline.runtime.config.build`) runs
   on what remains, so that every mistake is reported in one message, exit status 2;
3. ``main`` runs under :func:`exit_on_user_error`, and SIGINT / SIGTERM / SIGUSR1 end it with one
   line and exit status 130 / 143 / 138 (:func:`interrupts`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.table import Table

from pipeline.runtime.config import ConfigError, Interrupted, UserError, build, handling, nearest, override, raise_if  # noqa: F401  (entry points import them from here)
from pipeline.embedded import tiny_teacher_dir
from pipeline.folders.output_folder import check_writable, storage_error
from pipeline.runtime.quiet import quiet_third_party
from storage_schemas import ContractError, dataset_dir
from storage_schemas import filesystem as sfs
from storage_schemas import store_calls
from storage_schemas.reader import DocumentNotFoundError

T = TypeVar("T")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def _dataset_dir(root: str, corpus: str, teacher: str) -> str:
    folder = dataset_dir(root, corpus, teacher)
    return folder if isinstance(folder, str) else folder.as_posix()  # an object-store URI stays a string


# ``${dataset_dir:<root>,<corpus>,<teacher>}`` in the YAML files: the scored folder's name comes
# from the contract (its schema version), never from a string repeated in configs.
OmegaConf.register_new_resolver("dataset_dir", _dataset_dir, replace=True)


def _preset_stride(window: int, stride: int, *, _parent_) -> int | None:
    """``${preset_stride:<window>,<stride>}`` in a teacher preset: that stride while ``teacher.window``
    is unset or that window; for any other window none, so the stride is half the window."""
    return stride if _parent_.get("window") in (None, window) else None


OmegaConf.register_new_resolver("preset_stride", _preset_stride, replace=True)


def plain(cfg: DictConfig | dict, key: str | None = None) -> dict:
    node = cfg if key is None else cfg[key]
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def register_defaults(name: str, tree: dict) -> None:
    """Make an entry point's defaults (taken from its typed configs) the first entry of its YAML's
    defaults list, so the YAML only overrides and every key can be overridden without ``+``."""

    ConfigStore.instance().store(name=name, node=tree)


# ---------------------------------------------------------------------------------------------
# Errors and interrupts

# The project's own errors about what the user gave. The contract package depends on nothing but
# pyarrow, so its errors (a bad shard, a document id not in the dataset) are named here.
USER_ERRORS = (UserError, ContractError, DocumentNotFoundError, sfs.StoreSettingError)
STORE_UNAVAILABLE = 75  # EX_TEMPFAIL: the object store did not answer; the same command later resumes
# The shells' exit statuses for them (128 + the signal's number). SIGUSR1 is what Slurm's --signal
# sends by default before a time limit; stage 2 saves a checkpoint on it and on SIGTERM first.
INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGUSR1: 138}


@contextlib.contextmanager
def interrupts(received: list[int] | None = None) -> Iterator[None]:
    """SIGTERM and SIGUSR1 behave as SIGINT does: an exception in the main thread
    (:class:`pipeline.runtime.config.Interrupted`); stage 2's training replaces this while it trains
    (:meth:`pipeline.train_student.trainer.GuidedTrainer.saving_on_signals`).
    Each signal is also appended to ``received``: a library waiting in native code when it arrives
    may raise a plain ``KeyboardInterrupt`` instead (``ray.get`` does), which no longer says which."""
    def raise_interrupted(signum, frame):
        if received is not None:
            received.append(signum)
        raise Interrupted(signum)

    with handling(INTERRUPTED, raise_interrupted):
        yield


def exit_on_user_error(fn):
    """The project's user errors (:class:`pipeline.runtime.config.UserError`), and a full, read-only or
    forbidden file system (:func:`pipeline.folders.output_folder.storage_error`), end the entry point with one
    clear line and exit status 2, no traceback (VOCAGNO_TRACEBACK=1 shows it); an interrupt ends it
    with one line and 130 (SIGINT), 143 (SIGTERM) or 138 (SIGUSR1); an object store still failing after the S3
    client's retries (:func:`storage_schemas.filesystem.unavailable`) with one line and 75. Everything
    else (CUDA, NCCL and Ray errors, a bug) propagates with its traceback and another exit status."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        received: list[int] = []
        try:
            with interrupts(received):
                return fn(*args, **kwargs)
        except Exception as exc:
            store = sfs.unavailable(exc)  # first: a user error may carry it (a shard that could not be read)
            storage = storage_error(exc) if isinstance(exc, OSError) else None  # full, read-only, forbidden
            if os.environ.get("VOCAGNO_TRACEBACK") or (store is None and storage is None
                                                       and not isinstance(exc, USER_ERRORS)):
                raise
            if store is None:
                print(f"error: {storage or raised_message(exc)}", file=sys.stderr)
                sys.exit(2)
            mode, attempts = sfs.retry_settings()
            print(f"error: the object store did not answer within {attempts} attempts per request (AWS_MAX_ATTEMPTS, "
                  f"{mode} retry mode): {store}. What finished is kept and marked complete, nothing half-written "
                  "is; run the same command once the store answers", file=sys.stderr)
            sys.exit(STORE_UNAVAILABLE)
        except KeyboardInterrupt as exc:
            signum = exc.signum if isinstance(exc, Interrupted) else received[0] if received else signal.SIGINT
            detail = getattr(exc, "detail", "") or ("stopped; what was finished is kept and marked complete, nothing "
                                                    "half-written is; the same command resumes")
            print(f"interrupted ({signal.Signals(signum).name}): {detail}", file=sys.stderr)
            sys.exit(INTERRUPTED[signum])

    return wrapper


def raised_message(exc: BaseException) -> str:
    """The message of ``exc`` as it was raised: a data-loader worker's error reaches the training
    process re-raised by torch, its message then ``Caught <type> in DataLoader worker process <n>``
    and the worker's whole traceback, which ends with the original message."""
    text = str(exc)
    cls = type(exc)
    raised_as = f"{cls.__module__}.{cls.__qualname__}: "
    if text.startswith(f"Caught {cls.__name__} in DataLoader worker") and raised_as in text:
        return text.rsplit(raised_as, 1)[1].strip()
    return text


def with_problems(extra: list[str], make: Callable[[], T]) -> T:
    """``make()`` (a typed config builder raising :class:`ConfigError`), with ``extra`` problems
    the entry point found itself reported in the same message."""
    try:
        built = make()
    except ConfigError as exc:
        raise_if(exc.problems + [p for p in extra if p not in exc.problems])
    raise_if(extra)
    return built


def same_path(a: str, b: str | os.PathLike) -> bool:
    """Whether two local paths, as the command line gives them, name the same place."""
    return Path(to_absolute_path(str(a))).resolve() == Path(to_absolute_path(str(b))).resolve()


def python_command() -> str:
    """This interpreter as a user types it in the project folder (``.venv/bin/python``), so a
    printed command runs with the project's packages."""
    exe = Path(sys.executable)
    try:
        return shlex.quote(str(exe.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(exe))


# ---------------------------------------------------------------------------------------------
# Printed commands, quoted so that they run as printed (a path with a space, a comma, a quote)


def make_command(target: str, *overrides: str) -> str:
    """``make <target> ARGS="..."`` with ``overrides`` (:func:`pipeline.runtime.config.override`) passed whole: the
    recipe's shell splits ARGS into words, so each is shell-quoted inside the double quotes."""
    inner = " ".join(shlex.quote(o) for o in overrides)
    return f'make {target} ARGS="' + re.sub(r'(["\\$`])', r"\\\1", inner) + '"'


def expand_home(args: list[str]) -> list[str]:
    """``~`` at the start of a path in an override's value (``student.model=~/x``,
    ``'data.files=[~/a/*.parquet]'``) becomes the home folder: Hydra's parser refuses it unquoted
    and keeps it as is quoted."""
    home = os.path.expanduser("~")
    return [a if "=" not in a or a.startswith("~") else a.split("=", 1)[0] + "=" +
            re.sub(r"(^|[\[,'\"\s])~(?=/|$|[\],'\"\s])", lambda m: m.group(1) + home, a.split("=", 1)[1])
            for a in args]


def store_row(counts: dict) -> list[tuple[str, str]]:
    """The summary's row on the object store: requests and the S3 client's retries, when there were any."""
    return [("object store", store_calls.describe(counts))] if counts.get("requests") else []


def show_summary(title: str, rows: list[tuple[str, str]], lines: list[tuple[str, str]],
                 console: Console | None = None) -> None:
    """A stage's end summary: short facts in a table, then paths and commands one per line,
    whole (never cut or wrapped by the terminal's width), so they can be copied as they are."""
    console = console or Console()
    table = Table(title=title, show_header=False, title_justify="left")
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    for label, text in lines:
        console.print(f"{label}:", markup=False, highlight=False)
        console.print(f"  {text}", markup=False, highlight=False, soft_wrap=True)


def quiet_libraries() -> None:
    for name in ("transformers", "datasets", "ray", "filelock", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_third_party()


# ---------------------------------------------------------------------------------------------
# The entry point


def entry_point(config_name: str, defaults: dict | None, check: Callable[[DictConfig], Any],
                config_dir: Path = CONF_DIR):
    """Decorate an entry point's ``main(cfg)``: register ``defaults`` (its typed schema's, see
    :func:`pipeline.runtime.config.defaults`) once as ``<config_name>_defaults``; on the command line, check
    every override and the whole config (``check`` raises :class:`ConfigError`) before Hydra runs
    ``main``, and report every problem at once (module docstring)."""

    if defaults is not None:
        register_defaults(f"{config_name}_defaults", defaults)

    def decorate(main: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir), config_name=config_name)(
            exit_on_user_error(main))

        @functools.wraps(main)
        def run() -> Any:
            args = expand_home(sys.argv[1:])
            sys.argv[1:] = exit_on_user_error(check_command_line)(config_dir, config_name, args, check)
            exit_on_user_error(check_writable)({"hydra.run.dir": log_dir(config_dir, config_name, sys.argv[1:])})
            return hydra_main()

        run.check = check
        return run

    return decorate


def log_dir(config_dir: Path, config_name: str, args: list[str]) -> str | None:
    """The part of Hydra's log folder (``hydra.run.dir``, given or the YAML's) that is known before
    Hydra runs: up to its first interpolation (``outputs/logs/score_teacher`` of
    ``outputs/logs/score_teacher/${now:...}``); None for Hydra's own modes (``-m``, ``--cfg``)."""
    if any(a.startswith("-") for a in args):
        return None
    given = [a.split("=", 1)[1] for a in args if a.split("=", 1)[0].lstrip("+") == "hydra.run.dir" and "=" in a]
    if given:
        text = given[-1]
    else:
        try:  # as written: ${now:...} is Hydra's, unknown until it runs
            tree = OmegaConf.to_container(OmegaConf.load(config_dir / f"{config_name}.yaml"), resolve=False)
        except (OSError, OmegaConfBaseException):
            return None
        text = ((tree.get("hydra") or {}).get("run") or {}).get("dir") if isinstance(tree, dict) else None
    if not isinstance(text, str):
        return None
    known = text.split("${", 1)[0]
    return known if "${" not in text else known.rsplit("/", 1)[0] if "/" in known else None


def check_command_line(config_dir: Path, config_name: str, args: list[str], check: Callable[[DictConfig], Any]) -> list[str]:
    """Raise one :class:`ConfigError` listing every problem of the command line's overrides and of
    the configuration they compose (``check``'s), or return the arguments for Hydra: a mapping given
    whole to a key that holds one (``ray.env_vars={HF_HOME: /x}``) replaces it."""
    if any(a.startswith("-") for a in args):
        return args  # Hydra's own modes and flags (--cfg, --help, -m ...): left to Hydra
    problems, cfg, replaced = override_problems(config_dir, config_name, args)
    if not problems:
        return [replaced.get(a, a) for a in args]  # the entry point checks the config itself, files included
    if cfg is not None:
        try:
            check(cfg)
        except ConfigError as exc:
            problems += [p for p in exc.problems if p not in problems]
    raise_if(problems)


def override_problems(config_dir: Path, config_name: str,
                      overrides: list[str]) -> tuple[list[str], DictConfig | None, dict[str, str]]:
    """Problems of ``overrides`` against the config they change, the config composed from the
    overrides that have none (None when even that fails to compose), and the overrides rewritten
    for Hydra (a whole mapping for a mapping key: ``++``, which Hydra lets add keys)."""

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        hint = ("; quote a value that holds ~, a comma, brackets or quotes: key='value'"
                if any(ch in "".join(overrides) for ch in "~,[]'\"") else "")
        return [f"command line: {str(exc).splitlines()[0]}{hint}"], None, {}
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        groups = set(loader.list_groups("")) - {"hydra"}
        problems: list[str] = []
        kept_groups = []
        for o in parsed:
            if o.key_or_group.startswith("hydra") or o.key_or_group not in groups:
                continue
            options = loader.get_group_options(o.key_or_group)
            value = o.value()
            if o.is_delete() or value is None or value in options:
                kept_groups.append(o.input_line)
            else:
                problems.append(f"{o.key_or_group}: {value!r} is not a preset{nearest(str(value), options)} "
                                f"(presets: {', '.join(options)}, in {config_dir.name}/{o.key_or_group}/)")
        try:
            base = compose(config_name=config_name, overrides=kept_groups)
        except (HydraException, OmegaConfBaseException) as exc:
            return problems + [f"config: {_first_line(exc)}"], None, {}
        kept = list(kept_groups)
        replaced: dict[str, str] = {}
        for o in parsed:
            if o.key_or_group.startswith("hydra") or o.key_or_group in groups:
                continue
            exists = OmegaConf.select(base, o.key_or_group, default=_ABSENT, throw_on_resolution_failure=False) is not _ABSENT
            node = OmegaConf.select(base, o.key_or_group, default=None, throw_on_resolution_failure=False)
            if o.is_add() and exists:
                replaced[o.input_line] = o.input_line[1:]  # Hydra refuses + on a key that exists: set it
                kept.append(replaced[o.input_line])
            elif exists and isinstance(node, DictConfig) and isinstance(o.value(), dict) and not o.is_force_add():
                replaced[o.input_line] = "++" + o.input_line  # a whole mapping: Hydra adds its keys
                kept.append(replaced[o.input_line])
            elif not exists and not o.is_add() and not o.is_force_add() and not o.is_delete():
                problems.append(unknown_key(base, o.key_or_group))
            else:
                kept.append(o.input_line)
        try:
            cfg = compose(config_name=config_name, overrides=kept)
        except (HydraException, OmegaConfBaseException) as exc:
            return problems + [f"command line: {_first_line(exc)}"], None, replaced
    GlobalHydra.instance().clear()
    return problems, cfg, replaced


_ABSENT = object()


def unknown_key(cfg: DictConfig, key: str) -> str:
    """``<key>: unknown key`` with the nearest key at its level and every key there."""
    parts = key.split(".")
    node, depth = cfg, 0
    while depth < len(parts) - 1 and isinstance(node, DictConfig) and parts[depth] in node:
        node, depth = node[parts[depth]], depth + 1
    where = ".".join(parts[:depth])
    known = sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []
    shown = [f"{where}.{k}" if where else k for k in known]
    text = f"{key}: unknown key{nearest(key, shown)}"
    return text + (f" (known{' in ' + where if where else ''}: {', '.join(shown)})" if shown else "")


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# A teacher of your own

TINY_NAME = "tiny"  # the embedded tiny teacher's teacher.name (conf/teacher/tiny.yaml)


def named_teacher(cfg: DictConfig, say: bool = False) -> DictConfig:
    """``cfg`` with a teacher of your own that still bears the tiny teacher's name named after its
    file or folder (:func:`teacher_slug`), so that its dataset is never filed or carded as the tiny
    teacher's: a GGUF file (``teacher.model=x.gguf``: never the embedded teacher, so
    ``teacher.embedded`` is false too), or any other model with ``teacher.embedded=false``. A name
    given (``teacher.name=...``) is kept. ``say``: print the name chosen on stderr."""
    t = cfg.get("teacher") or {}
    model = t.get("model")
    if t.get("name") != TINY_NAME or not isinstance(model, str) or not model:
        return cfg
    built = t.get("build") and tiny_teacher_dir(cfg.artifacts_dir, t.build.corpus_docs, t.build.seed)
    if not model.endswith(".gguf") and (t.get("embedded") or (built and same_path(model, built))):
        return cfg  # the tiny teacher itself, or refused by the stage with what to add
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.teacher.name, cfg.teacher.embedded = teacher_slug(model), False
    if say:
        print(f"teacher.name not given: this teacher is filed as {cfg.teacher.name!r}, after {model} "
              "(teacher.name=<a name> to choose another)", file=sys.stderr)
    return cfg


def teacher_slug(model: str) -> str:
    """A teacher's name from its model: a file's name without ``.gguf``, a folder's name, a hub id's
    last part; lower case, other characters than letters, digits, ``.``, ``_`` and ``-`` as ``-``."""
    name = Path(model.rstrip("/")).name
    name = name[: -len(".gguf")] if name.endswith(".gguf") else name
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "teacher"


def duration(seconds: float) -> str:
    """``seconds`` in the unit that reads best: s, min or h (the bills' wall times)."""
    if seconds < 120:
        return f"{seconds:,.0f} s"
    return f"{seconds / 60:,.1f} min" if seconds < 7200 else f"{seconds / 3600:,.1f} h"
