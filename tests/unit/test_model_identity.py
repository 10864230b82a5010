"""The model's identity in the key namespace: what the model is, not the path
it was given by (connector/vllm/model_identity.py). Tiny model directories
built here: a config.json and hand-written safetensors files."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector's package imports vLLM")

from kvdepot.connector.vllm import model_identity as mi
from kvdepot.connector.vllm.layout import KVLayout, describe_namespace, namespace_for
from kvdepot.connector.vllm.model_identity import (
    model_identity,
    weight_files,
)
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.errors import InvalidArgument

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "torch_dtype": "float32",
}

# The identity of the fixture below: a change to it is a change of every
# deployment's keys (a new scheme gets a new prefix, see SCHEME).
GOLDEN = "model-v1:3107b853c2c3221492984923219ce665"


def safetensors_bytes(tensors: dict[str, bytes]) -> bytes:
    """A safetensors file of float32 vectors, written by hand (no library
    whose serialization could change under the golden value)."""
    header: dict[str, Any] = {}
    at = 0
    for name, data in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": [len(data) // 4],
            "data_offsets": [at, at + len(data)],
        }
        at += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())


def floats(start: int, n: int) -> bytes:
    return struct.pack(f"<{n}f", *(float(start + i) for i in range(n)))


def tensors() -> dict[str, bytes]:
    return {
        "model.embed_tokens.weight": floats(0, 128),
        "model.layers.0.self_attn.q_proj.weight": floats(1000, 64),
        "model.norm.weight": floats(7, 8),
    }


def build(path: Path, config: dict[str, Any] | None = None, **files: bytes) -> Path:
    """A model directory: config.json and model.safetensors, plus ``files``
    (``name`` with ``__`` for ``.``)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"_name_or_path": str(path), "transformers_version": "4.0", **(config or CONFIG)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "model.safetensors").write_bytes(safetensors_bytes(tensors()))
    for name, data in files.items():
        (path / name.replace("__", ".")).write_bytes(data)
    return path


def engine(model: str, **model_config: Any) -> SimpleNamespace:
    """The parts of a VllmConfig the identity reads."""
    load_format = model_config.pop("load_format", "auto")
    mc = SimpleNamespace(
        **{"model": model, "revision": None, "code_revision": None, **model_config}
    )
    return SimpleNamespace(
        model_config=mc,
        load_config=SimpleNamespace(load_format=load_format),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def ident(model: str | Path, **model_config: Any) -> str:
    return model_identity(engine(str(model), **model_config)).value


# ------------------------------------------------------------- local paths
def test_the_fixture_has_a_pinned_identity(tmp_path: Path) -> None:
    assert ident(build(tmp_path / "m")) == GOLDEN
    # The same files elsewhere, saved from elsewhere with another transformers
    # (_name_or_path, transformers_version) and another JSON layout: the same.
    other = build(tmp_path / "elsewhere" / "copy")
    (other / "config.json").write_text(json.dumps(dict(reversed(list(CONFIG.items())))))
    assert ident(other) == GOLDEN


def test_relative_and_absolute_paths_are_one_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build(tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    relative = ident("models/tiny")
    assert relative == ident("./models/../models/tiny") == ident(tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path / "models")
    assert ident("tiny") == ident("../models/tiny/") == relative


def test_a_symlinked_or_copied_directory_is_the_same_model(tmp_path: Path) -> None:
    real = build(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    # Files that are links (a hub snapshot's are) count by their content.
    linked_files = tmp_path / "files"
    linked_files.mkdir()
    for f in real.iterdir():
        (linked_files / f.name).symlink_to(f)
    copy = Path(shutil.copytree(real, tmp_path / "copy"))
    assert ident(real) == ident(link) == ident(linked_files) == ident(copy)


def test_another_model_under_the_same_path_is_another_identity(tmp_path: Path) -> None:
    path = tmp_path / "current"
    seen = {ident(build(path))}
    for change in ({"num_hidden_layers": 3}, {"vocab_size": 32}, {"rope_parameters": {}}):
        shutil.rmtree(path)
        seen.add(ident(build(path, {**CONFIG, **change})))
    assert len(seen) == 4


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_fine_tune_of_the_same_shapes_is_another_identity(tmp_path: Path, where: str) -> None:
    """Same config, shapes and sizes (the header is alike too): only the
    sampled values tell two fine-tunes apart."""
    base = ident(build(tmp_path / "base"))
    tuned = build(tmp_path / "tuned")
    data = bytearray((tuned / "model.safetensors").read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    start = 8 + n + 128 * 4  # q_proj: 64 floats after the embedding
    at = {"first": start, "middle": start + 128, "last": start + 63 * 4}[where]
    data[at : at + 4] = struct.pack("<f", 0.5)
    (tuned / "model.safetensors").write_bytes(bytes(data))
    assert ident(tuned) != base


def test_files_that_do_not_change_the_kv_do_not_count(tmp_path: Path) -> None:
    """Tokenizer (keys are over token ids), generation config, docs, code."""
    base = ident(build(tmp_path / "a"))
    assert base == ident(
        build(
            tmp_path / "b",
            tokenizer__json=b'{"model": {"vocab": {"a": 0}}}',
            tokenizer_config__json=b'{"chat_template": "{{ x }}"}',
            generation_config__json=b'{"temperature": 0.7}',
            README__md=b"# tiny",
            training_args__bin=b"\0" * 64,
        )
    )


def test_the_weights_are_the_files_vllm_loads(tmp_path: Path) -> None:
    st = safetensors_bytes(tensors())
    index = json.dumps({"weight_map": {"x": "model.safetensors"}}).encode()
    plain = build(tmp_path / "plain")
    # A safetensors index: vLLM loads only the files it lists.
    indexed = build(
        tmp_path / "indexed", model__safetensors__index__json=index, extra__safetensors=st
    )
    assert [p.name for p in weight_files(indexed)] == ["model.safetensors"]
    # .bin copies beside the safetensors are not loaded.
    assert [p.name for p in weight_files(build(tmp_path / "both", pytorch_model__bin=b"x"))] == [
        "model.safetensors"
    ]
    assert ident(tmp_path / "both") == ident(plain)
    # The stray file is not loaded: the same weights, the same model.
    assert ident(indexed) == ident(plain)
    # Mistral's consolidated files take precedence, as in vLLM's loader.
    mistral = build(tmp_path / "mistral", consolidated__safetensors=st)
    assert [p.name for p in weight_files(mistral)] == ["consolidated.safetensors"]
    assert [p.name for p in weight_files(mistral, "safetensors")] == [
        "consolidated.safetensors",
        "model.safetensors",
    ]


def test_weights_are_sampled_never_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4 GiB (sparse) safetensors file and a 4 GiB .bin: a few KiB read."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(CONFIG))
    size = 1 << 30
    header: dict[str, Any] = {
        f"t{i}": {"dtype": "F32", "shape": [size // 4], "data_offsets": [i * size, (i + 1) * size]}
        for i in range(4)
    }
    raw = json.dumps(header).encode()
    with open(big / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 4 * size)
    read = []
    real_pread = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        read.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(mi.os, "pread", counting)
    first = ident(big)
    assert sum(read) < 16 << 10, sum(read)
    (big / "model.safetensors").rename(big / "pytorch_model.bin")
    read.clear()
    assert ident(big) != first
    assert sum(read) < 256 << 10, sum(read)


def test_a_single_file_model_is_its_content(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    (tmp_path / "b.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    (tmp_path / "c.gguf").write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 4)
    assert ident(tmp_path / "a.gguf") == ident(tmp_path / "b.gguf") != ident(tmp_path / "c.gguf")


def test_engine_settings_that_change_the_kv_are_part_of_it(tmp_path: Path) -> None:
    path = build(tmp_path / "m")
    assert ident(path, hf_overrides={}, quantization=None) == GOLDEN
    rope = ident(path, hf_overrides={"rope_parameters": {"factor": 2.0}})
    assert rope.startswith(GOLDEN + ";hf_overrides=")
    assert rope != ident(path, hf_overrides={"rope_parameters": {"factor": 4.0}})
    assert ident(path, quantization="fp8") == GOLDEN + ";quantization=fp8"
    assert ";hf_overrides=" in ident(path, hf_overrides={"odd": {1, 2}})  # not JSON: by str
    # Random weights: the files beside them are not what the engine runs.
    dummy = ident(path, load_format="dummy")
    assert dummy.endswith(";load_format=dummy") and not dummy.startswith(GOLDEN)
    # No weights to read: the configuration, and how the weights were loaded.
    (path / "model.safetensors").unlink()
    assert ident(path, load_format="dummy") == dummy
    streamed = ident(path, load_format="runai_streamer", model_weights="s3://bucket/m")
    assert streamed.endswith(";load_format=runai_streamer;weights=s3://bucket/m")


def test_a_config_from_elsewhere_is_the_one_digested(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = build(tmp_path / "m")
    other = tmp_path / "cfg"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 3}))
    (path / "copy").mkdir()
    shutil.copy(path / "config.json", path / "copy" / "config.json")
    assert ident(path, hf_config_path=str(path / "copy")) == GOLDEN
    assert ident(path, hf_config_path=str(other)) != GOLDEN
    _empty_hub_cache(monkeypatch, tmp_path / "empty-cache")
    elsewhere = ident(path, hf_config_path="org/cfg", revision="v1")
    assert elsewhere == GOLDEN + ";config=org/cfg@v1"


def test_unreadable_weights_stop_the_engine_naming_model_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = build(tmp_path / "m")

    def denied(*args: Any, **kwargs: Any) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(mi.os, "open", denied)
    with pytest.raises(InvalidArgument, match="set model_id"):
        ident(path)


# --------------------------------------------------------------------- hub
class Resolved(str):
    """Like huggingface_hub's ResolvedRevision: the requested revision, and
    the commit it resolved to."""

    resolved: str

    def __new__(cls, initial: str, resolved: str) -> Resolved:
        out = super().__new__(cls, initial)
        out.resolved = resolved
        return out


def test_a_hub_id_not_in_the_cache_is_the_id_and_its_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no such directory here
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    _empty_hub_cache(monkeypatch, tmp_path / "empty-cache")
    assert ident("org/tiny") == "hf:org/tiny"
    assert ident("org/tiny", revision="v2") == "hf:org/tiny@v2"
    sha = "a" * 40
    assert ident("org/tiny", revision=Resolved("main", sha)) == f"hf:org/tiny@{sha}"
    assert ident("org/tiny", revision="v2", code_revision="c1") == (
        "hf:org/tiny@v2;code_revision=c1"
    )
    assert len({ident("org/tiny", revision=r) for r in (None, "v1", "v2")}) == 3


def _empty_hub_cache(monkeypatch: pytest.MonkeyPatch, where: Path) -> Path:
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(where))
    return where


def fake_hub_cache(cache: Path, model: Path, repo: str, sha: str, files: list[str]) -> Path:
    """``model``'s ``files`` as huggingface_hub caches them: blobs, a snapshot
    of links to them, and refs/main naming the snapshot."""
    base = cache / ("models--" + repo.replace("/", "--"))
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(sha)
    snap = base / "snapshots" / sha
    snap.mkdir(parents=True)
    for i, name in enumerate(files):
        blob = base / "blobs" / f"{sha[:8]}{i}"
        shutil.copyfile(model / name, blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_a_cached_hub_snapshot_is_its_directorys_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _empty_hub_cache(monkeypatch, tmp_path / "hub")
    local = build(tmp_path / "local")
    sha = "b" * 40
    snap = fake_hub_cache(cache, local, "org/tiny", sha, ["config.json", "model.safetensors"])
    monkeypatch.chdir(tmp_path)
    assert ident("org/tiny") == GOLDEN == ident(snap)
    assert ident("org/tiny", revision="main") == GOLDEN
    assert ident("org/tiny", revision=Resolved("main", sha)) == GOLDEN
    assert ident("org/tiny", revision=sha) == GOLDEN
    # A revision that is not cached is not the cached one.
    assert ident("org/tiny", revision="v9") == "hf:org/tiny@v9"
    assert ident("org/tiny", code_revision="c1") == GOLDEN + ";code_revision=c1"


def test_weights_in_vllms_download_dir_and_config_in_the_default_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _empty_hub_cache(monkeypatch, tmp_path / "hub")
    local = build(tmp_path / "local")
    sha = "c" * 40
    fake_hub_cache(cache, local, "org/tiny", sha, ["config.json"])
    fake_hub_cache(tmp_path / "downloads", local, "org/tiny", sha, ["model.safetensors"])
    monkeypatch.chdir(tmp_path)
    cfg = engine("org/tiny")
    cfg.load_config.download_dir = str(tmp_path / "downloads")
    assert model_identity(cfg).value == GOLDEN


# ------------------------------------------------------------- namespace
LAYOUT = KVLayout("cpu", "bfloat16", 128, 2, 2, 32, "cpu-avx2", 128)


def test_the_namespace_keys_the_identity_and_model_id_overrides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    settings = ConnectorSettings(chunk_tokens=128)
    rel = namespace_for(engine("m"), settings, LAYOUT, 0)
    absolute = namespace_for(engine(str(tmp_path / "m")), settings, LAYOUT, 0)
    assert rel == absolute and rel.model == GOLDEN
    named = ConnectorSettings(chunk_tokens=128, model_id="llama-3-8b@prod")
    ns = namespace_for(engine("m", quantization="fp8"), named, LAYOUT, 0)
    assert ns.model == "llama-3-8b@prod"  # verbatim: keys stored under it stay valid
    assert namespace_for(engine("/nowhere"), named, LAYOUT, 0).digest() == ns.digest()


def test_the_start_up_line_names_every_field_and_hides_the_salt(tmp_path: Path) -> None:
    path = build(tmp_path / "m")
    settings = ConnectorSettings(chunk_tokens=128, cache_salt="tenant-secret")
    identity = model_identity(engine(str(path)))
    ns = namespace_for(engine(str(path)), settings, LAYOUT, 0, identity=identity)
    line = describe_namespace(ns, identity, settings.cache_salt)
    assert line.startswith(f"namespace {ns.digest().hex()} = model {GOLDEN} ({path.resolve()}: ")
    assert "config.json, 1 weight file; " in line
    assert "kv dtype bfloat16, layout " + LAYOUT.signature() in line
    assert "tp rank 0/1, 128-token chunks, extra: cache_salt sha256:" in line
    assert "tenant-secret" not in line and "\n" not in line
