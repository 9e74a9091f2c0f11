"""The one wire codec: msgpack values in length-prefixed frames, with hard size limits.

Every protocol in meshtrain (RPC, the tensor data plane, DHT records, CRDT deltas) encodes its
messages with `packb`/`unpackb` and moves them with `FramedStream`. A frame is a 4-byte big-endian
length followed by that many bytes. The reader refuses a declared length above its limit *before*
reading the body, so a hostile peer cannot make us allocate more than the limit, and a stream that
ends mid-frame is a `TruncatedFrame`, never a hang or a partial value.

Checking the decoded value's shape is validate.py's job (`require_map`, `require_int`, ...).

`FramedStream` wraps either a py-libp2p stream or a trio stream (anything with `read`/`write` or
`receive_some`/`send_all`) and buffers reads, because a libp2p `read(n)` may return fewer bytes.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import trio
from libp2p.exceptions import BaseLibp2pError

from meshtrain.errors import MeshtrainError
from meshtrain.transport.validate import Malformed

LENGTH = struct.Struct(">I")
DEFAULT_MAX_FRAME = 4 << 20  # 4 MiB: the largest control message we ever accept
_READ_CHUNK = 1 << 20
_MIN_READ = 16 << 10
_COALESCE = 64 << 10
_STREAM_ENDED = (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, BaseLibp2pError)


class WireError(MeshtrainError):
    """A peer sent bytes that are not a valid message; the stream is unusable after it."""


class FrameTooLarge(WireError):
    pass


class TruncatedFrame(WireError):
    """The stream ended (or was reset) in the middle of a frame."""


class MalformedMessage(WireError, Malformed):
    """The frame's body is not the msgpack value the protocol expects."""


class StreamClosed(WireError):
    """The stream ended cleanly at a frame boundary."""


def _no_ext(code: int, data: bytes) -> Any:
    raise MalformedMessage(f"msgpack extension type {code} is not allowed")


def packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def canonical(value: Any) -> Any:
    """The same value with every map's keys sorted, so equal values pack to equal bytes."""
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value, key=_sort_key)}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    return value


def _sort_key(k: Any) -> tuple[int, Any]:
    return (0, k) if isinstance(k, int) else (1, k.encode() if isinstance(k, str) else bytes(k))


def packb_canonical(value: Any) -> bytes:
    """Deterministic encoding: what gets signed and digested."""
    return packb(canonical(value))


def unpackb(data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_FRAME) -> Any:
    """Decode one msgpack value from untrusted bytes; any defect is a `MalformedMessage`."""
    if len(data) > max_size:
        raise FrameTooLarge(f"message of {len(data)} bytes exceeds the {max_size}-byte limit")
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False, ext_hook=_no_ext)
    except MalformedMessage:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise MalformedMessage(f"undecodable message: {type(e).__name__}: {e}") from None


class FramedStream:
    """Buffered, frame-aware reader/writer over a libp2p stream or a trio stream."""

    def __init__(self, stream: Any, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.stream = stream
        self.max_frame = max_frame
        self._buf = bytearray()
        self._eof = False
        if hasattr(stream, "receive_some"):
            self._recv, self._send = stream.receive_some, stream.send_all
        else:
            self._recv, self._send = stream.read, stream.write

    async def _fill(self, hint: int = _READ_CHUNK) -> bool:
        """Read more bytes (about `hint`) into the buffer; False at end of stream.

        Reading no more than needed keeps big payloads out of the buffer, so that
        `read_exactly_into` can receive them straight into their destination."""
        if self._eof:
            return False
        try:
            data = await self._recv(min(max(hint, _MIN_READ), _READ_CHUNK))
        except _STREAM_ENDED:  # EOF, reset and a dead connection all end the stream for us
            data = b""
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def at_eof(self) -> bool:
        """True if the stream ended cleanly here (nothing buffered, nothing more to read)."""
        return not self._buf and not await self._fill(_MIN_READ)

    async def read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not await self._fill(n - len(self._buf)):
                raise TruncatedFrame(f"stream ended after {len(self._buf)} of {n} bytes")
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def read_exactly_into(self, view: memoryview) -> None:
        """Fill `view` completely; big reads bypass the buffer for trio streams (zero-copy)."""
        n = len(view)
        have = min(n, len(self._buf))
        view[:have] = self._buf[:have]
        del self._buf[:have]
        pos = have
        sock = self.stream.socket if isinstance(self.stream, trio.SocketStream) else None
        while pos < n:
            if sock is not None and not self._eof:
                got = await sock.recv_into(view[pos:], n - pos)
                if got == 0:
                    self._eof = True
                    raise TruncatedFrame(f"stream ended after {pos} of {n} bytes")
                pos += got
                continue
            if not await self._fill(n - pos):
                raise TruncatedFrame(f"stream ended after {pos} of {n} bytes")
            take = min(n - pos, len(self._buf))
            view[pos : pos + take] = self._buf[:take]
            del self._buf[:take]
            pos += take

    async def read_frame_bytes(self, max_size: int | None = None) -> bytes:
        limit = self.max_frame if max_size is None else max_size
        if not self._buf and not await self._fill():
            raise StreamClosed("stream closed")
        (length,) = LENGTH.unpack(await self.read_exactly(LENGTH.size))
        if length > limit:
            raise FrameTooLarge(f"peer announced a {length}-byte frame; the limit is {limit}")
        return await self.read_exactly(length)

    async def read_frame(self, max_size: int | None = None) -> Any:
        return unpackb(await self.read_frame_bytes(max_size), max_size=max_size or self.max_frame)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._send(data)
        except _STREAM_ENDED as e:  # callers see one error type whatever the stream is
            raise StreamClosed(f"stream closed while writing ({type(e).__name__})") from None

    async def write_frame_bytes(self, body: bytes | bytearray | memoryview) -> None:
        if len(body) > self.max_frame:
            raise FrameTooLarge(f"refusing to send a {len(body)}-byte frame (limit {self.max_frame})")
        if len(body) < _COALESCE:  # one write for small frames; two (no copy) for big ones
            await self.write(LENGTH.pack(len(body)) + bytes(body))
        else:
            await self.write(LENGTH.pack(len(body)))
            await self.write(body)

    async def write_frame(self, value: Any) -> None:
        await self.write_frame_bytes(packb(value))
