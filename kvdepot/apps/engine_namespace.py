"""An engine's namespace from its settings, computed as the vLLM connector
computes it (``kvdepot explain --kv-transfer-config … --model …``).

Builds the engine's ``VllmConfig`` from the same arguments (no engine is
started, no weights are loaded) and runs the connector's own code on it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvdepot.errors import InvalidArgument


def _value(raw: str) -> Any:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def engine_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``--engine-arg block_size=16`` flags as keyword arguments of vLLM's ``EngineArgs``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not name:
            raise InvalidArgument(f"--engine-arg {pair!r}: expected NAME=VALUE, e.g. block_size=16")
        out[name] = _value(raw)
    return out


def engine_namespace(
    kv_transfer_config: str, model: str, pairs: Sequence[str] = ()
) -> tuple[str, dict[str, str]]:
    """(digest in hex, fields) of the namespace an engine run with these
    settings keys its chunks in.

    Raises:
        InvalidArgument: The JSON, an engine argument or the model directory
            is not usable, naming it.
    """
    try:
        kv = json.loads(kv_transfer_config)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"--kv-transfer-config is not JSON: {exc}") from None
    if not isinstance(kv, dict):
        raise InvalidArgument("--kv-transfer-config must be a JSON object")
    try:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        raise InvalidArgument(
            "--kv-transfer-config needs vLLM installed; give --namespace"
        ) from None
    kwargs = {"model": model, "skip_tokenizer_init": True, **engine_args(pairs)}
    try:
        vllm_config = EngineArgs(
            kv_transfer_config=KVTransferConfig(**kv), **kwargs
        ).create_engine_config()
    except (TypeError, ValueError, OSError) as exc:
        raise InvalidArgument(f"the engine's settings (--model {model}): {exc}") from None
    from kvdepot.connector.vllm import check_config
    from kvdepot.connector.vllm.layout import namespace_for
    from kvdepot.connector.vllm.model_identity import model_identity
    from kvdepot.connector.vllm.namespace_report import vllm_namespace_fields

    settings, layout = check_config(vllm_config)
    identity = model_identity(vllm_config, settings.model_id)
    ns = namespace_for(vllm_config, settings, layout, 0, None, identity)
    return ns.digest().hex(), vllm_namespace_fields(ns, settings, identity)
