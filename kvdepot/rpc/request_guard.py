"""gRPC requests that are not even protobuf: INVALID_ARGUMENT, not UNKNOWN.

A ``grpc.aio`` server that cannot parse a request reports the parser's
exception as ``UNKNOWN`` ("Unexpected DecodeError"), the code of a server
bug. :class:`MalformedRequestGuard` parses unary requests itself and answers
bytes that do not parse with ``INVALID_ARGUMENT`` and the reason, like any
other bad field, before a handler sees them.

A handler's :class:`~kvdepot.errors.KVDepotError` becomes its status here too:
:func:`abort_with` answers with the class's code, the error's message and the
class's name in the trailing metadata, so the client raises the same class
(:func:`kvdepot.rpc.errors.from_grpc`). One that escapes a handler is answered
the same way instead of as ``UNKNOWN`` with a traceback in the service's log.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvdepot.errors import KVDepotError
from kvdepot.rpc.errors import error_metadata, status_code


class _Malformed:
    """Stands in for a request that did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


async def abort_with(
    context: grpc.aio.ServicerContext,
    exc: KVDepotError,
    trailing: tuple[tuple[str, str], ...] = (),
) -> None:
    """End the call with ``exc``'s status; ``trailing`` adds metadata of its own.

    Raises what ``context.abort`` raises, as it does.
    """
    # Called from a handler's ``except`` block, where ``exc`` stays bound
    # while abort raises: exc -> traceback -> handler frame -> exc is a cycle
    # that keeps the request (megabytes for a big one) until a full garbage
    # collection. Dropping the traceback lets it go at once.
    exc.__traceback__ = None
    await context.abort(
        status_code(exc), str(exc), trailing_metadata=(*error_metadata(exc), *trailing)
    )


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
        try:
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except KVDepotError as exc:
            await abort_with(context, exc)

    return grpc.unary_unary_rpc_method_handler(
        guarded,
        request_deserializer=tolerant_parse,
        response_serializer=handler.response_serializer,
    )
