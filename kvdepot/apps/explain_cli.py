"""The ``kvdepot namespaces`` and ``kvdepot explain`` commands."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kvdepot.errors import InvalidArgument

ClientFactory = Callable[[argparse.Namespace], AbstractContextManager[Any]]


def cmd_namespaces(args: argparse.Namespace, client: ClientFactory) -> int:
    from kvdepot.apps.namespaces import namespace_to_dict, render_namespaces, with_differences

    with client(args) as c:
        found = with_differences([namespace_to_dict(n) for n in c.namespaces().namespaces])
    print(json.dumps(found) if args.json else render_namespaces(found), flush=True)
    return 0


def prompt_tokens(args: argparse.Namespace) -> list[int]:
    """``--tokens 1,2,3``, or ``--text`` through ``--tokenizer``."""
    if (args.tokens is None) == (args.text is None):
        raise InvalidArgument("give the prompt as --tokens 1,2,3 or as --text with --tokenizer")
    if args.tokens is not None:
        try:
            tokens = [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
        except ValueError:
            raise InvalidArgument("--tokens: a comma-separated list of token ids") from None
        if any(not 0 <= t < 2**32 for t in tokens):
            raise InvalidArgument("--tokens: token ids must be in [0, 2**32)")
        return tokens
    if not args.tokenizer:
        raise InvalidArgument("--text needs --tokenizer (a tokenizer or model directory)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InvalidArgument("--text needs the transformers package; give --tokens") from None
    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"--tokenizer {args.tokenizer}: {exc}") from None
    return [int(t) for t in tok(args.text)["input_ids"]]


def _namespace(args: argparse.Namespace) -> tuple[str, dict[str, str] | None]:
    if args.namespace and args.kv_transfer_config:
        raise InvalidArgument("give --namespace or --kv-transfer-config, not both")
    if args.namespace:
        return args.namespace.strip().lower(), None
    if not args.kv_transfer_config or not args.model:
        raise InvalidArgument(
            "name the engine's namespace: --namespace DIGEST, or --kv-transfer-config JSON "
            "with --model DIR"
        )
    from kvdepot.apps.engine_namespace import engine_namespace

    return engine_namespace(args.kv_transfer_config, args.model, args.engine_arg or [])


def store_describer(c: Any) -> Callable[[str, Any], list[tuple[str, float] | None]]:
    """``Store.DescribeChunks`` of the node a hit is on, reached at the gRPC
    address the cluster's statistics give (with the client's token and TLS);
    a store that cannot answer describes nothing."""
    import grpc

    from kvdepot.proto.gen import store_pb2, store_pb2_grpc
    from kvdepot.rpc.security import channel

    addresses = {n.node_id: n.grpc_address for n in c.stats().nodes}

    def describe(node: str, keys: Any) -> list[tuple[str, float] | None]:
        address = addresses.get(node)
        if not address:
            return [None] * len(keys)
        try:
            with channel(address, c.config.security) as ch:
                reply = store_pb2_grpc.StoreStub(ch).DescribeChunks(
                    store_pb2.DescribeChunksRequest(keys=keys), timeout=c.config.rpc_timeout_s
                )
        except grpc.RpcError:
            return [None] * len(keys)
        return [(d.tier, d.committed_at) if d.held else None for d in reply.chunks]

    return describe


def cmd_explain(args: argparse.Namespace, client: ClientFactory) -> int:
    from kvdepot.apps.explain import (
        explain_prompt,
        explanation_to_json,
        render_explanation,
        with_ages,
    )

    tokens = prompt_tokens(args)
    name, fields = _namespace(args)
    chunk_tokens = int(args.chunk_tokens or 0)
    if chunk_tokens < 0:
        raise InvalidArgument("--chunk-tokens must be positive")
    with client(args) as c:
        e = explain_prompt(c, tokens, name, chunk_tokens=chunk_tokens, fields=fields)
        if any(a.status == "hit" for a in e.chunks):
            e = with_ages(e, store_describer(c))
    print(json.dumps(explanation_to_json(e)) if args.json else render_explanation(e), flush=True)
    return 0


def add_commands(
    sub: Any, add_security_flags: Callable[[argparse.ArgumentParser], None], client: ClientFactory
) -> None:
    ns = sub.add_parser("namespaces", help="the namespaces in use, side by side")
    ns.add_argument("--metadata", help="metadata host:port (default 127.0.0.1:7700)")
    ns.add_argument("--json", action="store_true", help="print a JSON array")
    ns.add_argument("--timeout", help="RPC deadline in seconds (default 5)")
    add_security_flags(ns)
    ns.set_defaults(func=lambda a: cmd_namespaces(a, client))

    ex = sub.add_parser("explain", help="why each chunk of a prompt hits or misses")
    ex.add_argument("--metadata", help="metadata host:port (default 127.0.0.1:7700)")
    ex.add_argument("--tokens", help="the prompt's token ids, comma-separated")
    ex.add_argument("--text", help="the prompt as text (with --tokenizer)")
    ex.add_argument("--tokenizer", help="tokenizer or model directory for --text")
    ex.add_argument("--namespace", help="the engine's namespace digest (kvdepot namespaces)")
    ex.add_argument("--kv-transfer-config", help="the engine's --kv-transfer-config JSON")
    ex.add_argument("--model", help="the engine's model directory (with --kv-transfer-config)")
    ex.add_argument(
        "--engine-arg",
        action="append",
        metavar="FLAG=VALUE",
        help="an engine setting that changes the namespace, e.g. block_size=16 (repeatable)",
    )
    ex.add_argument("--chunk-tokens", help="tokens per chunk of an unregistered --namespace")
    ex.add_argument("--json", action="store_true", help="print a JSON array, one object per chunk")
    ex.add_argument("--timeout", help="RPC deadline in seconds (default 5)")
    add_security_flags(ex)
    ex.set_defaults(func=lambda a: cmd_explain(a, client))
