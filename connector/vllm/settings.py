"""The connector's settings: ``kv_connector_extra_config``, validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvdepot.connector.codec import CodecSpec, check_codec_name
from kvdepot.connector.transport import available_transports
from kvdepot.errors import InvalidArgument
from kvdepot.rpc.security_config import PluginSecurity


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings(PluginSecurity):
    """The connector's ``kv_connector_extra_config``: the fields below and the
    token and TLS settings of :class:`~kvdepot.rpc.security.PluginSecurity`
    (``auth_token_file``, ``tls_*``; ``KVDEPOT_AUTH_TOKEN`` and ``KVDEPOT_TLS_*``
    in the engine's environment work too).

    Attributes:
        metadata: Metadata service address(es), ``host:port[,host:port]``.
        chunk_tokens: Tokens per chunk; a multiple of the engine's block size.
        node_id: The store node on this host (local-first puts and reads).
        transport: Data-plane transport: ``auto`` (the client's default: shm
            on this host, nixl where RDMA devices exist, tcp otherwise),
            ``tcp``, ``shm`` or ``nixl``.
        model_id: The model's identity in the namespace, verbatim, in place of
            the one derived from the model's files (a digest of its config and
            weights, or the hub id and revision: see ``model_identity``).
            Engines with the same ``model_id`` share KV whatever they run.
        cache_salt: Extra namespace salt (tenant, LoRA, …).
        force_recompute_on_load_error: Make vLLM recompute blocks whose load
            failed instead of failing the request (the connector's contract:
            a failed read is a miss).
        kv_codec: How chunks store KV: ``none`` (the cache's bytes) or
            ``fp8_e4m3`` (about half the bytes of bf16, dequantized on load;
            lossy). Part of the namespace.
        kv_codec_block: Values sharing one scale, for codecs with scales.
        lookup_timeout_s: The least deadline of the scheduler's lookup of a
            new request (and the first one's). The deadline follows the
            lookups' measured latency (three times their 90th percentile)
            up to ``lookup_timeout_max_s``. A lookup that misses it is a miss.
        lookup_timeout_max_s: The longest the scheduler ever waits for a
            lookup, however slow the host (never less than
            ``lookup_timeout_s``: a larger ``lookup_timeout_s`` raises it).
        lookup_breaker_s: After ``lookup_breaker_after`` failed lookups in a
            row, new requests skip kvdepot (a miss, no call) for this long;
            each further failure doubles it, up to 16 times; the first
            success closes the breaker.
        lookup_breaker_after: Failed lookups in a row that open the breaker
            (one slow call does not).
        load_timeout_s: Deadline of one request's load, from when the worker
            starts it: a load not done by then is given up and its tokens
            are recomputed.
        sync_load_max_tokens: Which loads run inside the engine step, layer
            by layer beside the forward pass, instead of asynchronously (the
            request waits while the batch runs). ``"auto"``: those expected
            to take less than a step, from the step and load times measured
            so far (an in-step load then gets two steps before it is given
            up and recomputed). A number: loads of at most that many tokens
            (0: every load is asynchronous).
        cost_gate: Load a hit only when that is expected to be faster than
            computing its tokens: the engine's steps and the loads are timed,
            and a load expected to take more than a step and more than twice
            the compute of its tokens is declined (counted in
            ``loads_declined``, reason ``slower_than_compute``); after 10 s
            of declines one load measures the store afresh (then after 20 s,
            40 s, ... up to 320 s while it stays slow). Off: every hit is loaded.
        io_timeout_s: Deadline of a stalled data-plane transfer.
        rpc_timeout_s: Deadline of each metadata call of the workers (loads
            and publishing, all off the engine's thread).
        save_decode: Publish chunks completed while decoding, so the next
            turn of a conversation hits its whole history. Default: on for
            ``kv_both``, off for ``kv_producer``.
        save_tail: Publish the whole engine blocks after a prompt's last
            whole chunk, block by block, so the same prompt (the decode of a
            disaggregated pair, a retry) loads all but its last partial block.
        save_buffer_bytes: Staging memory for KV copied out of the engine
            and not yet published. When it is full, new saves are dropped
            (and counted), never waited for.
        pd_wait: A consumer given a prefill's ``kv_transfer_params`` waits
            (inside its asynchronous load, up to ``load_timeout_s``) for the
            prefill's chunks to be committed instead of missing them.
    """

    metadata: str = "127.0.0.1:7700"
    chunk_tokens: int = 256
    node_id: str = ""
    transport: str = "auto"
    model_id: str = ""
    cache_salt: str = ""
    force_recompute_on_load_error: bool = True
    kv_codec: str = "none"
    kv_codec_block: int = 128
    lookup_timeout_s: float = 0.05
    lookup_timeout_max_s: float = 0.5
    lookup_breaker_s: float = 1.0
    lookup_breaker_after: int = 3
    load_timeout_s: float = 5.0
    sync_load_max_tokens: int | str = "auto"
    cost_gate: bool = True
    io_timeout_s: float = 5.0
    rpc_timeout_s: float = 2.0
    save_decode: bool | None = None
    save_tail: bool = True
    save_buffer_bytes: int = 512 << 20
    pd_wait: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int):
            raise InvalidArgument("chunk_tokens must be an integer")
        if self.chunk_tokens < 1:
            raise InvalidArgument("chunk_tokens must be positive")
        if self.transport not in available_transports():
            raise InvalidArgument(
                f"transport must be one of {', '.join(available_transports())}, "
                f"got {self.transport!r}"
            )
        for name in (
            "lookup_timeout_s",
            "lookup_timeout_max_s",
            "load_timeout_s",
            "io_timeout_s",
            "rpc_timeout_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive number of seconds")
        if not isinstance(self.lookup_breaker_s, int | float) or self.lookup_breaker_s < 0:
            raise InvalidArgument("lookup_breaker_s must not be negative")
        after = self.lookup_breaker_after
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise InvalidArgument("lookup_breaker_after must be a positive integer")
        if self.sync_load_max_tokens != "auto":
            value = self.sync_load_max_tokens
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(
                    'sync_load_max_tokens must be "auto" or a non-negative integer'
                )
        if not isinstance(self.cost_gate, bool):
            raise InvalidArgument("cost_gate must be true or false")
        value = self.save_buffer_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument("save_buffer_bytes must be a non-negative integer")
        check_codec_name(self.kv_codec)
        self.codec_spec()  # validates the block size

    def lookup_ceiling_s(self) -> float:
        """The longest a scheduler lookup may take."""
        return max(self.lookup_timeout_s, self.lookup_timeout_max_s)

    def sync_load_tokens(self) -> int | None:
        """The fixed in-step load threshold, or None for ``"auto"``."""
        value = self.sync_load_max_tokens
        return None if value == "auto" else int(value)

    def codec_spec(self) -> CodecSpec:
        return CodecSpec(self.kv_codec, self.kv_codec_block)

    def saves_decode(self, kv_role: str) -> bool:
        """Whether chunks completed while decoding are published."""
        if self.save_decode is None:
            return kv_role == "kv_both"
        return bool(self.save_decode)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        """Settings from ``kv_connector_extra_config``; unknown keys are an error."""
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise InvalidArgument(
                f"unknown kv_connector_extra_config keys: {', '.join(sorted(unknown))}"
            )
        try:
            return cls(**extra)
        except TypeError as exc:
            raise InvalidArgument(f"kv_connector_extra_config: {exc}") from None
