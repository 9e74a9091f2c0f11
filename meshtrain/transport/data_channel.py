"""Data channels: an authenticated, AES-GCM-sealed byte channel to a peer, beside libp2p.

Why not libp2p streams: py-libp2p's Noise+yamux stream moves ~72 MB/s with a core busy on each side
and resets a stream whose reader stalls for 5 s (shared/LIBP2P-NOTES.md). A peer in the middle of
a forward pass would lose its transfer. So bulk data moves on channels of its own, opened here;
what moves on them (tensor transfers, resume, rendezvous) is tensor_streams.py's.

1. **Session** (once per peer pair, over the authenticated libp2p channel): the sender calls the
   receiver's RPC `/meshtrain/dataplane/1`; the receiver answers with a fresh 256-bit session key,
   a session id and its data-plane TCP port. The key travelled inside Noise, bound to both peer
   ids, so the data plane is exactly as authenticated as the libp2p connection.
2. **Connection** (a plain TCP connection to that port, pooled per peer and reused; `prepare`
   opens one ahead of a transfer): the client sends `MTDP1 | session id | client nonce`, the
   server answers with its own nonce, and both derive per-direction AES-256-GCM keys with
   HKDF(session key, both nonces, both peer ids). A replayed or forged opening fails at the first
   frame: the server's fresh nonce changes the keys.
3. **Frames** `[u32 length][u8 kind][body]`, the body AES-GCM-sealed with a per-direction counter
   nonce and the kind as associated data, so frames cannot be reordered, replayed or retyped.
   `Channel` seals straight from the caller's memory and opens straight into the caller's buffer
   (`encrypt_into`/`decrypt_into`), so a chunk is never copied beyond one frame buffer. A body is
   at most `MAX_CHUNK` (+ 64) bytes, a msgpack control body at most `MAX_CONTROL`. The frame kinds
   (HEADER ... ERROR) are named here as the wire's vocabulary; their order is a transfer's.

**Fallback**: when the receiver's data-plane port cannot be dialled (relay-only pairs, or
`direct=False`), the same frames run unsealed over a libp2p stream `/meshtrain/tensors/1`
(Noise already encrypts it). A peer whose direct dial or handshake failed is reached that way for
the next 60 s.

**Who may use it**: `authorize(peer) -> bool` (constructor keyword, or set `streams.authorize`
later: the node learns membership after it built the data plane) is asked, bounded by
`authorize_timeout`, before a session key is handed out (the RPC answers `RemoteError` code
`not-a-member`), before a direct connection is served (so a session handed out elsewhere, e.g. by
hole punching, or held by a peer that since left, is worthless) and before a fallback stream is
served (it gets one ERROR frame `not-a-member` and is closed; no header is read). A timeout or an
exception in `authorize` refuses too. The sender sees `TransferRefused`, not `PeerGone`: it must
not retry blindly. Unset, everyone is admitted, as before. Refusals are counted by reason in
`refused`: `not-a-member`, `authorize-timeout`, `authorize-error`.

**NAT traversal** (holepunch.py) plugs in through `direct_opener` (open the TCP connection some
other way), `new_session` (hand a session over its own RPC, after `admits`) and
`adopt_connection` (serve a hole-punched connection).

**Failures**: an opening that is not ours or names no session we handed out, and a frame that
fails authentication (`HandshakeError`), end the connection and are counted in
`stats["handshake_failures"]` on the serving side. Session setup that fails over libp2p (the
peer's control plane is in trouble) and a fallback stream that cannot be opened are `PeerGone`;
`not-a-member` is `TransferRefused`. All are `TransferError`s.

Not here: what a channel carries (transfers, resume, rendezvous, the limits on early senders:
tensor_streams.py, whose `TensorStreams` is the one `DataChannels` subclass); who is a member (the
node's `authorize`); revoking a peer's connections that are already open (a member that leaves
keeps its pooled connections until they close; new ones and new session keys are refused); a bound
on concurrent `authorize` calls (each lasts at most `authorize_timeout`; how many streams a peer
may open at once is libp2p's limit, and direct connections are only checked once they name a
session we handed out).
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from meshtrain.errors import MeshtrainError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import FramedStream, MalformedMessage, WireError, packb, unpackb
from meshtrain.transport.host import Host, StreamOpenError
from meshtrain.transport.rpc import RemoteError, RpcError, stream_peer
from meshtrain.transport.validate import require_map

log = get_logger(__name__)

SESSION_RPC = "dataplane"
FALLBACK_PROTOCOL = "/meshtrain/tensors/1"
MAGIC = b"MTDP1"
NONCE_BYTES = 16
SID_BYTES = 16
TAG_BYTES = 16  # AES-GCM tag
MIN_CHUNK, MAX_CHUNK = 1 << 20, 4 << 20
MAX_CONTROL = 4 << 20  # header frames carry specs: 100k tensors fit
# How long `authorize(peer)` may take. The node's answer waits for the peer's membership record to
# replicate (a few seconds for a peer that just joined); this must stay well under the session
# RPC's client timeout (10 s) so that a slow verdict is a refusal, not an RPC timeout.
AUTHORIZE_TIMEOUT = 5.0

# Refusal reasons of admission (the keys of `refused` that `admits` counts; the two authorize-*
# ones tell the peer `not-a-member`). TensorStreams adds the transfers' own.
NOT_A_MEMBER = "not-a-member"
AUTHORIZE_TIMED_OUT = "authorize-timeout"
AUTHORIZE_FAILED = "authorize-error"
ADMISSION_REFUSALS = (NOT_A_MEMBER, AUTHORIZE_TIMED_OUT, AUTHORIZE_FAILED)

# Frame kinds: the wire's vocabulary. Their order within a transfer is tensor_streams.py's.
HEADER, ACCEPT, DATA, TRAILER, ACK, ERROR = 1, 2, 3, 4, 5, 6
_HEAD = struct.Struct(">IB")  # frame length (kind byte + body), kind


class TransferError(MeshtrainError):
    """A tensor transfer failed; the message says which peer and why."""


class PeerGone(TransferError):
    """The other peer disappeared (killed, disconnected) and did not come back in time."""


class TransferRefused(TransferError):
    """The receiver refused the transfer (no matching receive, wrong shapes, too large)."""


class HandshakeError(TransferError):
    """A data-plane connection failed authentication (wrong or replayed key)."""


@dataclass(frozen=True)
class DataPlaneConfig:
    """Settings of the whole data plane: its channels' (handshake, direct, listen address,
    authorize) and its transfers' (chunk size, limits, claim and resume windows)."""

    chunk_bytes: int = 4 << 20  # measured: 4 MiB frames ~1.5x faster than 1 MiB in Python
    max_transfer_bytes: int = 64 << 30
    claim_timeout: float = 120.0  # how long an early sender waits for the matching receive
    resume_window: float = 15.0  # how long a receiver keeps a broken transfer for resumption
    reconnect_attempts: int = 3
    handshake_timeout: float = 10.0
    direct: bool = True  # False: always use the libp2p fallback
    listen_ip: str | None = None  # default: the host's first listen IP
    port: int = 0
    # Early senders waiting for their receive (see "Limits" in tensor_streams.py for why).
    max_pending_per_peer: int = 64
    max_pending: int = 256
    authorize_timeout: float = AUTHORIZE_TIMEOUT

    def __post_init__(self) -> None:
        if not MIN_CHUNK <= self.chunk_bytes <= MAX_CHUNK:
            raise ValueError("chunk_bytes must be between 1 and 4 MiB")
        if not 1 <= self.max_pending_per_peer <= self.max_pending:
            raise ValueError("need 1 <= max_pending_per_peer <= max_pending")
        if not self.authorize_timeout > 0:
            raise ValueError("authorize_timeout must be positive")


# --------------------------------------------------------------------------------------------
# Channels: one frame protocol, sealed (direct TCP) or plain (inside a Noise libp2p stream)


class Channel:
    """One data-plane connection: frames `[u32 length][u8 kind][body]`, AES-GCM-sealed with
    `keys` (ours, theirs) on a direct TCP connection, plain (keys None) inside a libp2p stream."""

    def __init__(self, framed: FramedStream, path: str, keys: tuple[bytes, bytes] | None) -> None:
        self.framed = framed
        self.path = path
        self._send_aead = AESGCM(keys[0]) if keys else None
        self._recv_aead = AESGCM(keys[1]) if keys else None
        self._send_ctr = 0
        self._recv_ctr = 0
        self._out = bytearray()
        self._in = bytearray()
        self.broken = False

    @property
    def overhead(self) -> int:
        return TAG_BYTES if self._send_aead else 0

    def _nonce(self, ctr: int) -> bytes:
        return b"\0\0\0\0" + ctr.to_bytes(8, "big")

    async def send(self, kind: int, body: bytes | memoryview) -> None:
        n = len(body) + self.overhead
        need = _HEAD.size + n
        if len(self._out) < need:
            self._out = bytearray(max(need, len(self._out) * 2 if self._out else need))
        out = memoryview(self._out)
        _HEAD.pack_into(out, 0, n + 1, kind)
        if self._send_aead is not None:
            self._send_aead.encrypt_into(self._nonce(self._send_ctr), body, bytes([kind]), out[_HEAD.size : need])
            self._send_ctr += 1
            await self.framed.write(out[:need])
        elif len(body) < 65536:
            out[_HEAD.size : need] = body
            await self.framed.write(out[:need])
        else:  # plain and big: header, then the tensor memory itself
            await self.framed.write(out[: _HEAD.size])
            await self.framed.write(body)

    async def send_msg(self, kind: int, value: Any) -> None:
        await self.send(kind, packb(value))

    async def recv_head(self) -> tuple[int, int]:
        """(kind, body length without the AEAD tag)."""
        length, kind = _HEAD.unpack(await self.framed.read_exactly(_HEAD.size))
        body = length - 1 - self.overhead
        if body < 0:
            raise MalformedMessage("frame shorter than its seal")
        return kind, body

    async def recv_body_into(self, kind: int, dest: memoryview) -> None:
        """Receive a body of exactly len(dest) bytes and write its plaintext into `dest`."""
        if self._recv_aead is None:
            await self.framed.read_exactly_into(dest)
            return
        n = len(dest) + TAG_BYTES
        if len(self._in) < n:
            self._in = bytearray(n)
        ct = memoryview(self._in)[:n]
        await self.framed.read_exactly_into(ct)
        try:
            self._recv_aead.decrypt_into(self._nonce(self._recv_ctr), ct, bytes([kind]), dest)
        except InvalidTag:
            raise HandshakeError("a data-plane frame failed authentication") from None
        self._recv_ctr += 1

    async def recv_msg(self, *kinds: int) -> tuple[int, Any]:
        kind, body = await self.recv_head()
        if kind not in kinds:
            raise MalformedMessage(f"unexpected frame kind {kind}, wanted {kinds}")
        if body > MAX_CONTROL:
            raise MalformedMessage(f"control frame of {body} bytes")
        buf = bytearray(body)
        await self.recv_body_into(kind, memoryview(buf))
        return kind, unpackb(bytes(buf), max_size=MAX_CONTROL)

    async def aclose(self) -> None:
        self.broken = True
        stream = self.framed.stream
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            try:
                if isinstance(stream, trio.abc.Stream):
                    await stream.aclose()
                else:
                    await stream.reset()
            except Exception:
                pass


def _derive_keys(key: bytes, cnonce: bytes, snonce: bytes, client: str, server: str) -> tuple[bytes, bytes]:
    okm = HKDF(
        algorithm=hashes.SHA256(),
        length=64,
        salt=cnonce + snonce,
        info=b"meshtrain/dataplane/1|" + client.encode() + b"|" + server.encode(),
    ).derive(key)
    return okm[:32], okm[32:]  # client->server, server->client


@dataclass
class _Session:
    peer: str
    key: bytes
    created: float


class DataChannels(Service):
    """The data channels of one host: its listener, the sessions it handed out and holds, the
    pooled connections to each peer, and admission. A subclass says what a served channel
    carries by implementing `_serve_channel` (`TensorStreams`: transfers).

    host, config, authorize: as documented on `TensorStreams`.
    """

    def __init__(
        self,
        host: Host,
        config: DataPlaneConfig | None = None,
        *,
        authorize: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.host = host
        self.config = config or DataPlaneConfig()
        self.authorize = authorize
        self._sessions: dict[bytes, _Session] = {}  # server side: sid -> session
        self._client_sessions: dict[str, tuple[bytes, bytes, str, int]] = {}  # peer -> sid, key, ip, port
        self._no_direct_until: dict[str, float] = {}
        self._idle: dict[str, list[Channel]] = {}
        self._nursery: trio.Nursery | None = None
        self._listeners: list[trio.SocketListener] = []
        self.port: int | None = None
        # NAT traversal hook (meshtrain.transport.holepunch): given a peer, open a TCP connection to
        # its data plane some other way than dialling its port (a coordinated TCP simultaneous
        # open through both NATs) and return it with the session (sid, key) it belongs to; or
        # return None to dial the port as usual. Unset: the plain dial below, as before.
        self.direct_opener: Callable[[str], Awaitable[tuple[trio.SocketStream, bytes, bytes] | None]] | None = None
        self.stats: dict[str, int] = {"handshake_failures": 0}  # TensorStreams adds its own
        # reason -> how many sessions, connections or transfers we turned down for it
        self.refused: dict[str, int] = dict.fromkeys(ADMISSION_REFUSALS, 0)

    # -- lifecycle -----------------------------------------------------------------------------

    async def _start(self, stack: AsyncExitStack) -> None:
        # The listener first: if it cannot open, nothing else has started.
        ip = self.config.listen_ip or _first_ip(self.host.config.listen)
        self._listeners = await trio.open_tcp_listeners(self.config.port, host=ip)
        stack.push_async_callback(self._close_listeners)
        self.port = self._listeners[0].socket.getsockname()[1]
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(trio.serve_listeners, self._serve_tcp, self._listeners)
        self.host.rpc.serve(SESSION_RPC, self._open_session)
        self.host.set_stream_handler(FALLBACK_PROTOCOL, self._serve_fallback)
        log.info(kv("data plane listening", ip=ip, port=self.port))

    async def _stop(self) -> None:
        assert self._nursery is not None  # lifecycle misuse, not peer input
        self._nursery.cancel_scope.cancel()  # transfers stop before their connections close
        for chans in self._idle.values():
            for ch in chans:
                await ch.aclose()
        self._idle.clear()

    async def _close_listeners(self) -> None:
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                await listener.aclose()

    # -- client side ---------------------------------------------------------------------------

    async def prepare(self, peer: str) -> str:
        """Open (and pool) a connection to `peer` ahead of a transfer; returns its path.

        Collectives call this for their group before a round so that session setup and the TCP
        handshake are not on the critical path."""
        ch = await self._channel(peer)
        self._release(peer, ch)
        return ch.path

    async def _channel(self, peer: str) -> Channel:
        idle = self._idle.get(peer)
        while idle:
            ch = idle.pop()
            if not ch.broken:
                return ch
        if self.config.direct and self._no_direct_until.get(peer, 0) < time.monotonic():
            try:
                return await self._dial_direct(peer)
            except RpcError as e:
                if isinstance(e, RemoteError) and e.code == NOT_A_MEMBER:
                    raise TransferRefused(f"{peer} does not admit us to its data plane: {e}") from None
                # otherwise the control plane itself fails: the peer is in trouble
                raise PeerGone(f"{peer}: data-plane session setup failed: {e}") from None
            except (HandshakeError, OSError, trio.TooSlowError) as e:  # no direct path to it
                log.info(kv("no direct data path, using libp2p", peer=peer, error=repr(e)))
                self._client_sessions.pop(peer, None)
                self._no_direct_until[peer] = time.monotonic() + 60
        try:
            stream = await self.host.open_stream(peer, FALLBACK_PROTOCOL)
        except StreamOpenError as e:
            raise PeerGone(str(e)) from None
        return Channel(FramedStream(stream, max_frame=MAX_CHUNK + 64), "libp2p", None)

    async def _dial_direct(self, peer: str) -> Channel:
        if self.direct_opener is not None:
            opened = await self.direct_opener(peer)
            if opened is not None:
                stream, sid, key = opened
                try:
                    with trio.fail_after(self.config.handshake_timeout):
                        return await self._client_handshake(peer, stream, sid, key)
                except (WireError, OSError, trio.BrokenResourceError, trio.TooSlowError) as e:
                    await stream.aclose()
                    raise HandshakeError(f"data-plane handshake with {peer} failed: {e}") from None
        for fresh in (False, True):
            sess = None if fresh else self._client_sessions.get(peer)
            if sess is None:
                reply = await self.host.rpc.call(peer, SESSION_RPC, {"op": "open"}, timeout=10)
                reply = require_map(reply, "sid", "key", "port", error=MalformedMessage)
                ip = self.host.remote_ip(peer)
                if ip is None:
                    raise OSError("no live libp2p connection to learn the peer's address from")
                sess = (reply["sid"], reply["key"], ip, int(reply["port"]))
                if not (
                    isinstance(sess[0], bytes)
                    and len(sess[0]) == SID_BYTES
                    and isinstance(sess[1], bytes)
                    and len(sess[1]) == 32
                ):
                    raise HandshakeError("malformed session reply")
                self._client_sessions[peer] = sess
            sid, key, ip, port = sess
            with trio.fail_after(self.config.handshake_timeout):
                stream = await trio.open_tcp_stream(ip, port)
                try:
                    return await self._client_handshake(peer, stream, sid, key)
                except (WireError, OSError, trio.BrokenResourceError) as e:
                    await stream.aclose()
                    if not fresh:  # the server forgot our session (it restarted): open a new one
                        self._client_sessions.pop(peer, None)
                        continue
                    raise HandshakeError(f"data-plane handshake with {peer} failed: {e}") from None
        raise HandshakeError(f"data-plane handshake with {peer} failed")

    async def _client_handshake(self, peer: str, stream: trio.SocketStream, sid: bytes, key: bytes) -> Channel:
        """Open a data-plane connection as the client on an already connected TCP stream."""
        cnonce = os.urandom(NONCE_BYTES)
        await stream.send_all(MAGIC + sid + cnonce)
        framed = FramedStream(stream, max_frame=MAX_CHUNK + 64)
        snonce = await framed.read_exactly(NONCE_BYTES)
        stream.setsockopt(6, 1, 1)  # TCP_NODELAY: frames are already large
        keys = _derive_keys(key, cnonce, snonce, self.host.peer_id, peer)
        return Channel(framed, "direct", keys)

    def _release(self, peer: str, ch: Channel) -> None:
        if not ch.broken:
            self._idle.setdefault(peer, []).append(ch)

    # -- serve side ----------------------------------------------------------------------------

    async def admits(self, peer: str) -> bool:
        """Whether `peer` may use our data plane: `authorize(peer)`, bounded by
        `config.authorize_timeout`. A "no", a timeout or an exception is counted in `refused` and
        forgets the sessions we handed `peer`. True for everyone while `authorize` is None.

        Public for protocols that hand out sessions over their own RPC (`new_session`)."""
        authorize = self.authorize
        if authorize is None:
            return True
        verdict: object = False
        reason = NOT_A_MEMBER
        try:
            with trio.move_on_after(self.config.authorize_timeout) as scope:
                verdict = await authorize(peer)
            if scope.cancelled_caught:
                reason = AUTHORIZE_TIMED_OUT
        except Exception as e:  # a bug in the hook must fail closed, not take the handler down
            log.warning(kv("data-plane authorize failed", peer=peer, error=repr(e)))
            verdict, reason = False, AUTHORIZE_FAILED
        if verdict is True:
            return True
        self.refused[reason] += 1
        for sid in [sid for sid, s in self._sessions.items() if s.peer == peer]:
            del self._sessions[sid]
        log.info(kv("data plane refused a peer", peer=peer, reason=reason))
        return False

    async def _open_session(self, peer: str, request: Any) -> dict:
        require_map(request, "op", error=MalformedMessage)
        if request["op"] != "open":
            raise RemoteError("bad_request", "unknown op")
        if not await self.admits(peer):
            raise RemoteError(NOT_A_MEMBER, "this peer does not serve its data plane to you")
        sid, key = self.new_session(peer)
        return {"sid": sid, "key": key, "port": self.port}

    def new_session(self, peer: str) -> tuple[bytes, bytes]:
        """A fresh (session id, key) that `peer` may open data-plane connections with.

        Public for NAT traversal, which hands the session over its own RPC. It does not ask
        `authorize` (it cannot wait): such a caller should check `await admits(peer)` first.
        Connections on the session are checked anyway, so a stranger's key opens nothing."""
        # Bound the sessions one peer can hold: old ones are dropped first.
        mine = sorted((s.created, sid) for sid, s in self._sessions.items() if s.peer == peer)
        for _, sid in mine[:-7]:
            del self._sessions[sid]
        sid, key = os.urandom(SID_BYTES), os.urandom(32)
        self._sessions[sid] = _Session(peer, key, time.monotonic())
        return sid, key

    def adopt_connection(self, stream: trio.SocketStream) -> None:
        """Serve a TCP connection that reached our data plane other than through our listener
        (a hole-punched simultaneous open): it must open with the usual session handshake."""
        if self._nursery is None:
            raise TransferError("the data plane is not running")
        self._nursery.start_soon(self._serve_tcp, stream)

    async def _serve_tcp(self, stream: trio.SocketStream) -> None:
        framed = FramedStream(stream, max_frame=MAX_CHUNK + 64)
        try:
            with trio.fail_after(self.config.handshake_timeout):
                opening = await framed.read_exactly(len(MAGIC) + SID_BYTES + NONCE_BYTES)
                if not opening.startswith(MAGIC):
                    raise HandshakeError("not a meshtrain data-plane connection")
                sid = opening[len(MAGIC) : len(MAGIC) + SID_BYTES]
                cnonce = opening[len(MAGIC) + SID_BYTES :]
                session = self._sessions.get(sid)
                if session is None:
                    raise HandshakeError("unknown session")
            # Before our nonce: a refused client sees the connection end and asks for a fresh
            # session, which the RPC then refuses with `not-a-member`.
            if not await self.admits(session.peer):
                await stream.aclose()
                return
            with trio.fail_after(self.config.handshake_timeout):
                snonce = os.urandom(NONCE_BYTES)
                await stream.send_all(snonce)
        except (HandshakeError, WireError, trio.TooSlowError, OSError, trio.BrokenResourceError) as e:
            self.stats["handshake_failures"] += 1
            log.info(kv("data-plane connection refused", reason=repr(e)))
            await stream.aclose()
            return
        stream.setsockopt(6, 1, 1)
        c2s, s2c = _derive_keys(session.key, cnonce, snonce, session.peer, self.host.peer_id)
        await self._serve_channel(Channel(framed, "direct", (s2c, c2s)), session.peer)

    async def _serve_fallback(self, stream: Any) -> None:
        try:
            peer = stream_peer(stream)
        except Exception:
            return
        ch = Channel(FramedStream(stream, max_frame=MAX_CHUNK + 64), "libp2p", None)
        if not await self.admits(peer):
            await self._turn_away(ch, NOT_A_MEMBER, "this peer does not serve its data plane to you")
            return
        await self._serve_channel(ch, peer)

    async def _turn_away(self, ch: Channel, code: str, text: str) -> None:
        """Answer a stream we will not serve with one ERROR frame (without reading anything from
        it), then close it: gracefully, so the frame arrives before the end of the stream."""
        with trio.move_on_after(1):
            try:
                await ch.send_msg(ERROR, {"code": code, "text": text})
                await ch.framed.stream.close()
                ch.broken = True
                return
            except Exception:  # the stream is already gone: reset whatever is left
                pass
        await ch.aclose()

    async def _serve_channel(self, ch: Channel, peer: str) -> None:
        """Serve what `peer`, admitted, sends on `ch` until the channel ends; close it then."""
        raise NotImplementedError


def _first_ip(listen: Any) -> str:
    for a in listen:
        parts = str(a).split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            return parts[2]
    return "127.0.0.1"
