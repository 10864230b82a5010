"""What model an engine runs, as the key namespace's ``model``: its identity.

Two engines share KV exactly when they compute the same KV for the same token
ids, which is a matter of the model's weights and configuration, not of the
string the engine was given: the same directory given by a relative and an
absolute path, through a symlink, copied elsewhere, or downloaded from the
hub into the local cache is one model; two models that an operator put in
turn under the same path are two.

The identity of a model in a local directory (or a hub snapshot in the local
cache) is a digest of what defines its KV:

* ``config.json`` (and ``params.json``, Mistral's format) as canonical JSON,
  without the fields that name where or with what it was saved
  (``_name_or_path``, ``_commit_hash``, ``transformers_version``);
* the weight files vLLM loads (as vLLM picks them: ``*.safetensors``, only
  those listed in the safetensors index when there is one, else ``*.bin``,
  ``*.pt``, ``*.gguf``): each file's name and size and, for safetensors, its
  header (tensor names, dtypes, shapes, offsets) and 64 bytes at the start,
  middle and end of every tensor; for other files, their first and last
  64 KiB and 14 samples of 4 KiB between. Weight files are never read whole:
  a few reads per tensor, milliseconds for a model whose pages the engine
  just loaded. The samples tell apart two fine-tunes of one base model,
  whose configuration, shapes and file sizes are all alike.

The tokenizer is left out on purpose: keys are chained over token ids, and
the KV of given token ids does not depend on which tokenizer produced them. A
tokenizer that maps text to other ids gives other keys by itself; one that
only changes, say, a chat template must not make every cached prefix a miss.

A hub id that is not in the local cache is ``hf:<id>@<revision>``, with the
commit hash vLLM resolved the revision to when it did. Engine settings that
change the KV of the same weights follow, ``;``-separated: ``hf_overrides``
(a digest of them), ``quantization``, a ``code_revision`` (hub models), and,
when no weight file is read (``load_format`` ``dummy``, whose random weights
are not the files; weights streamed from object storage, ...), the load
format and where the weights came from.

``model_id`` in the connector's settings replaces all of this: engines with
the same ``model_id`` share KV whatever they run, by the operator's word.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from kvdepot.errors import InvalidArgument

logger = logging.getLogger(__name__)

SCHEME = "model-v1"
"""Prefix of a digest identity; a new scheme gets a new prefix."""

_VOLATILE_KEYS = frozenset({"_name_or_path", "_commit_hash", "transformers_version"})
_CONFIG_FILES = ("config.json", "params.json")
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
_TENSOR_SAMPLE = 64
_HEAD_TAIL = 64 << 10
_WINDOW = 4 << 10
_WINDOWS = 14
_MAX_HEADER = 100 << 20


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The namespace's model, and where it came from (for the start-up line).

    Attributes:
        value: What goes into the namespace digest.
        source: How it was derived, for people: the directory digested
            (its path is never part of ``value``), the hub id, the setting.
    """

    value: str
    source: str


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in _VOLATILE_KEYS}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def canonical_json(obj: Any) -> bytes:
    """``obj`` as canonical JSON: sorted keys, no spaces, UTF-8 (what JSON
    cannot hold, by its ``str``)."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    ).encode()


def _config_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    try:
        return canonical_json(_strip(json.loads(raw)))
    except ValueError:
        return raw  # not JSON: its bytes as they are


# ------------------------------------------------------------------ weights
def weight_files(directory: Path, load_format: str = "auto") -> list[Path]:
    """The weight files vLLM loads from ``directory`` (its top level), sorted.

    Mirrors vLLM's default loader: Mistral's ``consolidated*.safetensors``
    when there are any (``auto``), else ``*.safetensors`` filtered by the
    safetensors index when there is one, else ``*.bin``, ``*.pt``, ``*.gguf``
    without training leftovers; none for ``load_format`` ``dummy``.
    """
    if load_format == "dummy":
        return []  # random weights: whatever files lie there are not loaded
    try:
        names = sorted(p.name for p in directory.iterdir() if p.is_file())
    except OSError:
        return []
    index = "model.safetensors.index.json"
    patterns = ["*.safetensors", "*.bin", "*.pt", "*.gguf"]
    consolidated = any(fnmatch(n, "consolidated*.safetensors") for n in names)
    if load_format in ("auto", "mistral") and consolidated:
        patterns, index = ["consolidated*.safetensors"], "consolidated.safetensors.index.json"
    elif load_format in ("safetensors", "fastsafetensors", "instanttensor"):
        patterns = ["*.safetensors"]
    elif load_format == "pt":
        patterns = ["*.pt"]
    elif load_format == "npcache":
        patterns = ["*.bin"]
    elif load_format == "gguf":
        patterns = ["*.gguf"]
    for pattern in patterns:
        found = [n for n in names if fnmatch(n, pattern)]
        if not found:
            continue
        if pattern.endswith(".safetensors"):
            listed = _index_files(directory / index)
            if listed is not None:
                found = [n for n in found if n in listed]
        else:
            found = [n for n in found if not n.endswith(_NOT_WEIGHTS)]
        return [directory / n for n in found]
    return []


def _index_files(path: Path) -> set[str] | None:
    try:
        weight_map = json.loads(path.read_bytes())["weight_map"]
        return {str(v) for v in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _read(fd: int, offset: int, size: int) -> bytes:
    out = b""
    while len(out) < size:
        got = os.pread(fd, size - len(out), offset + len(out))
        if not got:
            break
        out += got
    return out


def _safetensors_spans(fd: int, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """The header of a safetensors file and its tensors' byte spans, or None."""
    if size < 8:
        return None
    (n,) = struct.unpack("<Q", _read(fd, 0, 8))
    if n > min(_MAX_HEADER, size - 8):
        return None
    header = _read(fd, 8, n)
    try:
        meta = json.loads(header)
        spans = [
            (8 + n + int(t["data_offsets"][0]), 8 + n + int(t["data_offsets"][1]))
            for name, t in meta.items()
            if name != "__metadata__"
        ]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    if any(not 8 + n <= b <= e <= size for b, e in spans):
        return None
    return header, sorted(spans)


def _tensor_samples(spans: Iterable[tuple[int, int]]) -> Iterable[tuple[int, int]]:
    """(offset, size) of the bytes sampled of each tensor: start, middle, end."""
    for b, e in spans:
        seen: set[int] = set()
        mid = b + (e - b) // 2 // _TENSOR_SAMPLE * _TENSOR_SAMPLE
        for at in (b, mid, max(b, e - _TENSOR_SAMPLE)):
            if at not in seen and at < e:
                seen.add(at)
                yield at, min(_TENSOR_SAMPLE, e - at)


def _file_samples(size: int) -> Iterable[tuple[int, int]]:
    """(offset, size) of the bytes sampled of a file of another format."""
    if size <= 2 * _HEAD_TAIL + _WINDOWS * _WINDOW:
        yield 0, size
        return
    yield 0, _HEAD_TAIL
    for i in range(1, _WINDOWS + 1):
        yield size * i // (_WINDOWS + 1), _WINDOW
    yield size - _HEAD_TAIL, _HEAD_TAIL


def _digest_weight_file(h: Any, path: Path, name: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            # A few small reads far apart: no read-ahead of megabytes around each.
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        h.update(_field(name.encode()) + struct.pack("<Q", size))
        parsed = _safetensors_spans(fd, size) if path.suffix == ".safetensors" else None
        if parsed is not None:
            header, spans = parsed
            h.update(b"safetensors" + _field(header) + struct.pack("<Q", len(spans)))
            samples: Iterable[tuple[int, int]] = _tensor_samples(spans)
        else:
            h.update(b"file")
            samples = _file_samples(size)
        for at, n in samples:
            h.update(_read(fd, at, n))
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class DirectoryDigest:
    """The digest of a model's files, and what went into it."""

    hex: str
    configs: tuple[str, ...]
    weights: int


def directory_digest(
    config_dir: Path, weights_dir: Path | None = None, load_format: str = "auto"
) -> DirectoryDigest:
    """The digest of the model in ``config_dir`` (weights in ``weights_dir``,
    by default the same): its configuration and its weight files' names,
    sizes, headers and samples (see the module's docstring).

    Raises:
        OSError: A file could not be read.
    """
    wdir = weights_dir if weights_dir is not None else config_dir
    h = hashlib.sha256(SCHEME.encode())
    configs = []
    for name in _CONFIG_FILES:
        path = config_dir / name
        if path.is_file():
            configs.append(name)
            h.update(_field(name.encode()) + _field(_config_bytes(path)))
    # A single-file model (GGUF) is its own weights, whatever its name.
    single = wdir.is_file() and load_format != "dummy"
    files = [wdir] if single else weight_files(wdir, load_format)
    h.update(struct.pack("<Q", len(files)))
    for path in files:
        _digest_weight_file(h, path, "" if single else path.name)
    return DirectoryDigest(h.hexdigest()[:32], tuple(configs), len(files))


# ---------------------------------------------------------------------- hub
def hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None = None) -> Path | None:
    """The snapshot directory of ``repo_id`` at ``revision`` in the local hub
    cache (``cache_dir``, else the default one), or None: no network."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        base = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(
            repo_id=repo_id, repo_type="model"
        )
        ref = str(getattr(revision, "resolved", None) or revision or "main")
        ref_file = base / "refs" / ref
        if ref_file.is_file():
            ref = ref_file.read_text().strip()
        snap = base / "snapshots" / ref
        return snap if ref and snap.is_dir() else None
    except (ImportError, OSError, ValueError):
        return None


def _pinned(revision: Any) -> str:
    """A revision as the commit it was resolved to, when vLLM resolved it."""
    resolved = getattr(revision, "resolved", None)
    return str(resolved or revision or "")


# ------------------------------------------------------------------ engines
def _load_format(vllm_config: Any) -> str:
    fmt = getattr(getattr(vllm_config, "load_config", None), "load_format", None) or "auto"
    return str(getattr(fmt, "value", fmt))


def _modifiers(model_config: Any, load_format: str, digested: DirectoryDigest | None) -> list[str]:
    """The engine settings that change the KV of the same files."""
    out = []
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        name = f"{overrides.__module__}.{overrides.__qualname__}"
        out.append(f"hf_overrides={hashlib.sha256(name.encode()).hexdigest()[:12]}")
    elif overrides:
        blob = canonical_json(overrides)
        out.append(f"hf_overrides={hashlib.sha256(blob).hexdigest()[:12]}")
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        out.append(f"quantization={quantization}")
    if digested is not None and digested.weights == 0:
        out.append(f"load_format={load_format}")
        remote = getattr(model_config, "model_weights", "")
        if remote:
            out.append(f"weights={remote}")
    return out


def _config_source(model_config: Any, model: str) -> Path | str | None:
    """Where the configuration is read from when not beside the weights:
    a local directory, a hub id not in the cache (``id@revision``), or None."""
    path = getattr(model_config, "hf_config_path", None)
    if not path or path == model:
        return None
    if os.path.isdir(path):
        return Path(path)
    revision = getattr(model_config, "_hf_config_revision", None) or getattr(
        model_config, "revision", None
    )
    snap = hub_snapshot(str(path), revision)
    return snap if snap is not None else f"{path}@{_pinned(revision)}"


def model_identity(vllm_config: Any, model_id: str = "") -> ModelIdentity:
    """The identity of the model ``vllm_config`` runs (see the module's docstring).

    Args:
        vllm_config: The engine's ``VllmConfig``.
        model_id: The connector's ``model_id`` setting: when set, the identity.

    Raises:
        InvalidArgument: A file of the model could not be read.
    """
    if model_id:
        return ModelIdentity(model_id, "the model_id setting")
    t0 = time.perf_counter()
    mc = vllm_config.model_config
    model = str(mc.model)
    load_format = _load_format(vllm_config)
    config_from = _config_source(mc, model)
    extra: list[str] = []
    if os.path.exists(model):
        config_dir: Path | None = Path(model)
        weights_dir: Path | None = Path(model)
        where = str(Path(model).resolve())
    else:
        config_dir, weights_dir, where = _hub_dirs(vllm_config, model, load_format)
        code = getattr(mc, "code_revision", None)
        if code:
            extra.append(f"code_revision={_pinned(code)}")
    digested: DirectoryDigest | None = None
    if weights_dir is None or config_dir is None:
        revision = _pinned(getattr(mc, "revision", None))
        value = f"hf:{model}" + (f"@{revision}" if revision else "")
        source = f"hub id {model}, not in the local cache: not digested"
    else:
        if isinstance(config_from, Path):
            config_dir = config_from
        try:
            digested = directory_digest(config_dir, weights_dir, load_format)
        except OSError as exc:
            raise InvalidArgument(
                f"kvdepot cannot read the files of {model} for the model's identity ({exc}); "
                "set model_id in kv_connector_extra_config to name the model"
            ) from exc
        value = f"{SCHEME}:{digested.hex}"
        n = digested.weights
        source = (
            f"{where}: {' + '.join(digested.configs) or 'no config file'}, "
            f"{n} weight file{'' if n == 1 else 's'}"
        )
    if isinstance(config_from, str):
        extra.append(f"config={config_from}")
    mods = [*extra, *_modifiers(mc, load_format, digested)]
    if digested is not None and digested.weights == 0 and load_format != "dummy":
        logger.warning(
            "kvdepot: no weight file of %s could be read for the model's identity: its "
            "KV is keyed by its configuration and %s; set model_id to name its weights",
            model,
            ", ".join(mods),
        )
    ms = (time.perf_counter() - t0) * 1e3
    return ModelIdentity(";".join([value, *mods]), f"{source}; {ms:.0f} ms")


def _hub_dirs(
    vllm_config: Any, model: str, load_format: str
) -> tuple[Path | None, Path | None, str]:
    """A hub model's config and weights directories in the local cache (the
    weights in vLLM's ``download_dir`` first), and how to name them."""
    mc = vllm_config.model_config
    revision = getattr(mc, "revision", None)
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    for cache_dir in (download_dir, None) if download_dir else (None,):
        weights = hub_snapshot(model, revision, cache_dir)
        if weights is None or not weight_files(weights, load_format):
            continue
        config = weights
        if not any((weights / n).is_file() for n in _CONFIG_FILES):
            # vLLM reads the config into the default cache, the weights into download_dir.
            default = hub_snapshot(model, revision)
            if default is not None and any((default / n).is_file() for n in _CONFIG_FILES):
                config = default
        return config, weights, f"hub {model} (cached snapshot {weights})"
    return None, None, ""
