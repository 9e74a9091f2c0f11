"""Request/response over libp2p: one stream per call, one msgpack frame each way.

Every small exchange between peers (data-plane session setup, DHT-adjacent queries, collective
control messages, checkpoint manifests) goes through here, under the protocol id
`/meshtrain/<name>/<version>`.

Wire, per call:  client -> `{"q": request}`;  server -> `{"ok": result}` or `{"err": [code, text]}`.

The stream's protocol is proposed and the request written behind it without waiting for the
peer's answer (host.py, pipelined protocol selection), so a call costs one round trip, not three.

Why one stream per call: yamux streams are cheap, a call's failure stays inside its stream, and
concurrent calls on one connection need no request ids. Limits: a request or response above its
`max_*` size is refused before it is read; the client waits at most `timeout`; the server gives a
request `read_timeout` to arrive and a handler `handler_timeout` to answer, so a slow or hostile
client cannot pin server tasks. Anything malformed from a peer ends that call with a typed error
on the side that received it; it never raises out of a libp2p handler task (which would take the
host down) and never affects other streams.

Handlers are `async def handler(peer_id: str, request) -> response`. To answer with a typed error
raise `RemoteError(code, text)`; a `Malformed` from validate.py's checks is answered as code
`malformed`; any other exception is answered as code `internal` (logged here,
with no traceback sent to the peer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from meshtrain.errors import MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import DEFAULT_MAX_FRAME, FramedStream, WireError
from meshtrain.transport.validate import MALFORMED, Malformed

log = get_logger(__name__)

DEFAULT_CALL_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 10.0
DEFAULT_HANDLER_TIMEOUT = 30.0
DEFAULT_MAX_MESSAGE = 1 << 20  # 1 MiB: RPCs are for control messages, not tensors

Handler = Callable[[str, Any], Awaitable[Any]]


class StreamHost(Protocol):
    """What the RPC layer needs of the host (host.py's `Host`, which builds its `Rpc`)."""

    def set_stream_handler(self, protocol: str, handler: Callable[[Any], Awaitable[None]]) -> None: ...

    async def propose_stream(self, peer: str, protocol: str, timeout: float | None = None) -> Any: ...


class RpcError(MeshtrainError):
    """A call failed. Subclasses say whether it was the peer, the wire or the clock."""


class RemoteError(RpcError):
    """The remote handler answered with an error. Raise it in a handler to send one."""

    def __init__(self, code: str, text: str = "") -> None:
        super().__init__(f"{code}: {text}" if text else code)
        self.code = code
        self.text = text


class RpcTimeout(RpcError):
    pass


class RpcUnavailable(RpcError):
    """No stream could be opened: the peer is gone or does not serve this protocol."""


class RpcProtocolError(RpcError):
    """The peer's reply was malformed, oversized or cut short."""


def protocol_id(name: str, version: int = 1) -> str:
    return f"/meshtrain/{name}/{version}"


class Rpc:
    """The RPC layer of one host: `serve` handlers, `call` peers."""

    def __init__(self, host: StreamHost) -> None:
        self.host = host

    def serve(
        self,
        name: str,
        handler: Handler,
        *,
        version: int = 1,
        max_request: int = DEFAULT_MAX_MESSAGE,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        handler_timeout: float = DEFAULT_HANDLER_TIMEOUT,
    ) -> None:
        proto = protocol_id(name, version)

        async def on_stream(stream: Any) -> None:
            framed = FramedStream(stream, max_frame=max(max_request, DEFAULT_MAX_FRAME))
            peer = "?"
            try:
                peer = stream_peer(stream)
                with trio.fail_after(read_timeout):
                    msg = await framed.read_frame(max_request)
                if not isinstance(msg, dict) or "q" not in msg:
                    raise RemoteError(MALFORMED, "expected {'q': request}")
                with trio.fail_after(handler_timeout):
                    result = await handler(peer, msg["q"])
                reply: dict[str, Any] = {"ok": result}
            except RemoteError as e:
                reply = {"err": [e.code, e.text]}
            except (WireError, Malformed) as e:  # a request that failed validate.py's checks
                reply = {"err": [MALFORMED, str(e)]}
            except trio.TooSlowError:
                reply = {"err": ["timeout", "request or handler exceeded its deadline"]}
            except trio.Cancelled:
                raise
            except Exception as e:  # a handler bug must not crash the host
                log.warning(kv("rpc handler failed", proto=proto, peer=peer, error=repr(e)))
                reply = {"err": ["internal", type(e).__name__]}
            try:
                with trio.fail_after(read_timeout):
                    await framed.write_frame(reply)
                    await stream.close()
            except trio.Cancelled:
                raise
            except Exception as e:  # the client went away: nothing left to do for this call
                log.debug(kv("rpc reply not delivered", proto=proto, peer=peer, error=repr(e)))
                await reset_quietly(stream)

        self.host.set_stream_handler(proto, on_stream)

    async def call(
        self,
        peer: str,
        name: str,
        request: Any,
        *,
        version: int = 1,
        timeout: float = DEFAULT_CALL_TIMEOUT,
        max_response: int = DEFAULT_MAX_MESSAGE,
    ) -> Any:
        proto = protocol_id(name, version)
        stream = None
        try:
            with trio.fail_after(timeout):
                try:
                    proposed = await self.host.propose_stream(peer, proto, timeout=timeout)
                    stream = proposed.stream
                    framed = FramedStream(stream, max_frame=max(max_response, DEFAULT_MAX_FRAME))
                    await framed.write_frame({"q": request})  # behind the proposal: one round trip
                    await proposed.confirm()
                except MeshtrainError as e:  # the host's StreamOpenError: gone, or not serving this
                    if stream is not None:
                        await reset_quietly(stream)
                    raise RpcUnavailable(str(e)) from None
                reply = await framed.read_frame(max_response)
        except trio.TooSlowError:
            if stream is not None:
                await reset_quietly(stream)
            raise RpcTimeout(f"{proto} to {peer} took longer than {timeout:g} s") from None
        except WireError as e:
            if stream is not None:
                await reset_quietly(stream)
            raise RpcProtocolError(f"{proto} to {peer}: {e}") from None
        except RpcError:
            raise
        except trio.Cancelled:
            if stream is not None:
                await reset_quietly(stream)
            raise
        except Exception as e:  # libp2p write errors on a dead connection
            if stream is not None:
                await reset_quietly(stream)
            raise RpcUnavailable(f"{proto} to {peer}: {type(e).__name__}: {e}") from None
        await close_quietly(stream)
        if isinstance(reply, dict) and "ok" in reply:
            return reply["ok"]
        if (
            isinstance(reply, dict)
            and isinstance(reply.get("err"), list)
            and len(reply["err"]) == 2
            and all(isinstance(x, str) for x in reply["err"])
        ):
            raise RemoteError(reply["err"][0], reply["err"][1])
        raise RpcProtocolError(f"{proto} to {peer}: malformed reply")


def stream_peer(stream: Any) -> str:
    """The authenticated peer id at the other end of an incoming libp2p stream."""
    return stream.muxed_conn.peer_id.to_base58()


async def reset_quietly(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1), contextlib.suppress(Exception):
        await stream.reset()


async def close_quietly(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1), contextlib.suppress(Exception):
        await stream.close()
