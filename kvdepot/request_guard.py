"""gRPC requests that are not even protobuf: INVALID_ARGUMENT, not UNKNOWN.

A ``grpc.aio`` server that cannot parse a request reports the parser's
exception as ``UNKNOWN`` ("Unexpected DecodeError"), the code of a server
bug. :class:`MalformedRequestGuard` parses unary requests itself and answers
bytes that do not parse with ``INVALID_ARGUMENT`` and the reason, like any
other bad field, before a handler sees them.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc


class _Malformed:
    """Stands in for a request that did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    """Answers unary requests that do not parse with ``INVALID_ARGUMENT``."""

    def __init__(self) -> None:
        # Per method: the handler as registered and its guarded version.
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler.request_streaming
            or handler.response_streaming
            or handler.request_deserializer is None
            or handler.unary_unary is None
        ):
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is None or cached[0] is not handler:
            cached = (handler, _guard(handler))
            self._guarded[method] = cached
        return cached[1]


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    # The stubs know only synchronous behaviours; a grpc.aio servicer's are coroutines.
    behavior: Callable[..., Any] | None = handler.unary_unary
    assert parse is not None and behavior is not None

    def tolerant_parse(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # protobuf's DecodeError, or whatever a parser raises
            return _Malformed(f"{type(exc).__name__}: {exc}")

    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.reason}"
            )
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return grpc.unary_unary_rpc_method_handler(
        guarded,
        request_deserializer=tolerant_parse,
        response_serializer=handler.response_serializer,
    )
