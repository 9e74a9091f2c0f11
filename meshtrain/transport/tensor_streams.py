"""Tensor streams: moving dicts of named tensors between two peers, fast, beside libp2p.

Why not libp2p streams: py-libp2p's Noise+yamux stream moves ~72 MB/s with a core busy on each side
and resets a stream whose reader stalls for 5 s (docs/libp2p-notes.md). A peer in the middle of
a forward pass would lose its transfer. So tensors move on a *data plane*:

1. **Session** (once per peer pair, over the authenticated libp2p channel): the sender calls the
   receiver's RPC `/meshtrain/dataplane/1`; the receiver answers with a fresh 256-bit session key,
   a session id and its data-plane TCP port. The key travelled inside Noise, bound to both peer
   ids, so the data plane is exactly as authenticated as the libp2p connection.
2. **Connection** (a plain TCP connection to that port, pooled and reused): the client sends
   `MTDP1 | session id | client nonce`, the server answers with its own nonce, and both derive
   per-direction AES-256-GCM keys with HKDF(session key, both nonces, both peer ids). A replayed
   or forged opening fails at the first frame: the server's fresh nonce changes the keys.
3. **Transfer** (frames `[u32 length][u8 kind][body]`, body AES-GCM-sealed with a per-direction
   counter nonce and the kind as associated data, so frames cannot be reordered, replayed or
   retyped): HEADER (tag, transfer id, tensor specs, meta, optional digest) -> ACCEPT (resume
   offset) -> DATA chunks of 1–4 MiB -> TRAILER (blake3 digest of the payload) -> ACK.
   **Eager transfers**: a first attempt of at most `eager_bytes` (256 KiB) marks its header
   `eager` and sends its DATA and TRAILER right behind it, without waiting for ACCEPT (MPI's eager
   protocol beside its rendezvous): over a WAN path the wait is a round trip, the whole cost of a
   small transfer (a Streaming DiLoCo fragment's part, a pipeline hop). The receiver reads the
   header, waits for the matching receive as for any early sender (the payload waits meanwhile in
   the sockets' buffers), answers ACCEPT (offset 0) and reads on as usual. Refusing an eager
   transfer, it first reads and discards the payload up to its TRAILER (bounded by its own
   `eager_bytes`), so the ERROR leaves the connection in step and poolable; an eager header
   announcing more than that, or a payload that does not end where its specs say, ends the
   connection. A resumed attempt is never eager (its ACCEPT carries the offset to go on from). A
   receiver that predates eager headers ignores the flag and reads the payload after its ACCEPT,
   as it always did.
   Encryption reads straight from the tensors' memory and decryption writes straight into the
   receive buffers (`encrypt_into`/`decrypt_into`), so memory stays at one model copy plus a
   couple of chunk buffers.

**Bulk connections**: connections are pooled per peer and reused, which saves the two round trips
of opening one (TCP, then MTDP1). But a connection also keeps the congestion state it learned:
cubic's ssthresh after the losses of a many-flow all-reduce, or BBR's estimate of its share of
the link among 14 flows. A long transfer alone on such a connection creeps up to the link rate
(BBR probes 25 % higher every 8 round trips): over 100 ms of RTT, 100 MB moved at 62–82 % of
100 Mbit/s in the WAN lab (scripts/bench/bench_wan.py), where a connection that had carried a transfer alone moves it
at ~94 %. So transfers of at least `bulk_bytes` (32 MiB) have a pool of their own per peer: the
first opens a connection (which probes the path afresh: ~88 %, its handshakes and ramp
included), the next ones reuse it, and an all-reduce's 2 MiB stripes never touch it.

Back-pressure is TCP's own: a receiver that stops reading (a long forward pass, SIGSTOP) just
makes the sender's writes wait; there is no stall timeout, only the caller's deadline.

**Resume**: if a connection drops mid-transfer, the receiver keeps what it verified for
`resume_window` seconds; the sender reconnects and re-sends the HEADER with the same transfer id,
and the ACCEPT tells it where to continue. A sender that cannot reconnect raises `PeerGone`; a
receiver whose sender did not come back within the window raises `PeerGone` from `receive`.

**Fallback**: when the receiver's data-plane port cannot be dialled (relay-only pairs, or
`direct=False`), the same frame protocol runs unsealed over a libp2p stream
`/meshtrain/tensors/1` (Noise already encrypts it).

**Rendezvous**: `send(peer, tag, tensors)` pairs with `receive(peer, tag)` on the other side. A
sender that arrives first waits (without sending data) until the receiver asks for that tag, up to
`claim_timeout`, or until it hangs up. Tags are the caller's namespace, e.g. `allreduce/17/part3`.

**Who may use it**: `authorize(peer) -> bool` (constructor keyword, or set `streams.authorize`
later: the node learns membership after it built the data plane) is asked, bounded by
`authorize_timeout`, before a session key is handed out (the RPC answers `RemoteError` code
`not-a-member`), before a direct connection is served (so a session handed out elsewhere, e.g. by
hole punching, or held by a peer that since left, is worthless) and before a fallback stream is
served (it gets one ERROR frame `not-a-member` and is closed; no header is read). A timeout or an
exception in `authorize` refuses too. The sender sees `TransferRefused`, not `PeerGone`: it must
not retry blindly. Unset, everyone is admitted, as before.

**Limits** on senders that arrive first: each waits holding a server task, a connection and its
parsed header. At most `max_pending_per_peer` (64) such headers per peer and `max_pending` (256)
in all wait at once; one more is refused at once with ERROR `too-many-pending` (the sender sees
`TransferRefused`). A header whose receive is already waiting never counts. An all-reduce round
has at most 2 × `window` (4) tags per peer pair in flight at once (its pipelined reduce-scatter
and all-gather stripes), and posts its receives up front, so 64 per peer leaves room for tens of concurrent collectives and pipeline hops, and 256
for a round of ~128 peers all early at once. Every refusal is counted by reason in
`streams.refused` (for /metrics): `not-a-member`, `authorize-timeout`, `authorize-error`,
`too-many-pending`, and the transfer refusals `unclaimed`, `busy`, `cancelled`, `layout`, `digest`.

**Where the parts live.** This file: sessions, connections (pooled, bulk, hole-punched, the
fallback), the send side with its retries and resumes, and `TensorStreams` itself. The receive
side — rendezvous, the limits on early senders, eager refusals, resume — is tensor_inbox.py
(`Inbox`, `streams.inbox`); the frames, their sealing, and the errors, refusal codes and config
both sides share are data_channel.py.

Not here: who is a member (the node's `authorize`); revoking a peer's connections that are already
open (a member that leaves keeps its pooled connections until they close; new ones and new session
keys are refused); a byte budget for waiting headers (the count bounds it: at most `max_pending`
headers of at most 4 MiB each); a bound on concurrent `authorize` calls (each lasts at most
`authorize_timeout`; how many streams a peer may open at once is libp2p's limit, and direct
connections are only checked once they name a session we handed out).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import blake3
import torch
import trio

from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.data_channel import (
    ACCEPT,
    ACK,
    AUTHORIZE_FAILED,
    AUTHORIZE_TIMED_OUT,
    DATA,
    ERROR,
    HEADER,
    MAGIC,
    MAX_CHUNK,
    MAX_TAG_CHARS,
    NONCE_BYTES,
    NOT_A_MEMBER,
    REFUSAL_REASONS,
    SID_BYTES,
    TRAILER,
    DataChannel,
    DataPlaneConfig,
    DigestMismatch,
    HandshakeError,
    PeerGone,
    Received,
    TransferError,
    TransferRefused,
    derive_keys,
    payload_chunks,
)
from meshtrain.transport.framing import (
    FramedStream,
    MalformedMessage,
    WireError,
)
from meshtrain.transport.host import Host, StreamOpenError, addr_ips
from meshtrain.transport.rpc import RemoteError, RpcError, stream_peer
from meshtrain.transport.tensor_inbox import Inbox
from meshtrain.transport.tensor_layout import (
    byte_views,
    contiguous_cpu,
    specs_of,
    total_bytes,
)
from meshtrain.transport.validate import require_map

log = get_logger(__name__)

SESSION_RPC = "dataplane"
FALLBACK_PROTOCOL = "/meshtrain/tensors/1"


@dataclass(frozen=True)
class SendReport:
    peer: str
    tag: str
    nbytes: int
    digest: bytes
    path: str
    seconds: float
    resumes: int


# --------------------------------------------------------------------------------------------
# Receive side state


@dataclass
class _Session:
    peer: str
    key: bytes
    created: float


class TensorStreams(Service):
    """The data plane of one host. Use inside the host: `async with TensorStreams(host) as ts:`.

    host: the libp2p host whose identity authenticates sessions and whose streams carry the
      session RPC and the fallback.
    config: limits and timeouts (`DataPlaneConfig`).
    authorize: `async (peer id) -> bool`, whether that peer may open sessions and send us tensors;
      None admits everyone. May be set (or replaced) later as `streams.authorize`. It is called
      under `config.authorize_timeout`; a timeout or an exception counts as "no".
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
        self.paths: dict[str, str] = {}  # peer -> the path of the newest connection we dialled to it
        self._idle: dict[str, list[DataChannel]] = {}
        self._bulk: dict[str, list[DataChannel]] = {}  # idle connections of transfers >= bulk_bytes
        self._nursery: trio.Nursery | None = None
        self._listeners: Sequence[trio.SocketListener] = []
        self.port: int | None = None
        self.active: set[DataChannel] = set()  # connections currently carrying a transfer
        # NAT traversal hook (meshtrain.transport.holepunch): given a peer, open a TCP connection to
        # its data plane some other way than dialling its port (a coordinated TCP simultaneous
        # open through both NATs) and return it with the session (sid, key) it belongs to; or
        # return None to dial the port as usual. Unset: the plain dial below, as before.
        self.direct_opener: Callable[[str], Awaitable[tuple[trio.SocketStream, bytes, bytes] | None]] | None = None
        # connections_opened: connections we dialled (direct or libp2p fallback), for either pool
        self.stats = {
            "bytes_sent": 0,
            "bytes_received": 0,
            "handshake_failures": 0,
            "resumes": 0,
            "connections_opened": 0,
        }
        # reason -> how many sessions, connections or transfers we turned down for it
        self.refused: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        self.inbox = Inbox(self.config, self.refused, self.stats, self.active)  # the receive side

    # -- lifecycle -----------------------------------------------------------------------------

    async def _start(self, stack: AsyncExitStack) -> None:
        # The listener first: if it cannot open, nothing else has started.
        # One port on every IP the host listens on (IPv4 and IPv6 alike): the peer dials the IP its
        # libp2p connection to us goes to.
        ips = [self.config.listen_ip] if self.config.listen_ip else listen_ips(self.host.config.listen)
        stack.push_async_callback(self._close_listeners)
        port = self.config.port
        for ip in ips:
            self._listeners = [*self._listeners, *await trio.open_tcp_listeners(port, host=ip)]
            port = self._listeners[0].socket.getsockname()[1]
        self.port = port
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self.inbox.nursery = self._nursery
        self._nursery.start_soon(trio.serve_listeners, self._serve_tcp, self._listeners)
        self.host.rpc.serve(SESSION_RPC, self._open_session)
        self.host.set_stream_handler(FALLBACK_PROTOCOL, self._serve_fallback)
        log.info(kv("data plane listening", ips=",".join(ips), port=self.port))

    async def _stop(self) -> None:
        assert self._nursery is not None  # lifecycle misuse, not peer input
        self._nursery.cancel_scope.cancel()  # transfers stop before their connections close
        for pool in (self._idle, self._bulk):
            for chans in pool.values():
                for ch in chans:
                    await ch.aclose()
            pool.clear()
        self.inbox.close()

    async def _close_listeners(self) -> None:
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                await listener.aclose()

    # -- public API ----------------------------------------------------------------------------

    async def send(
        self,
        peer: str,
        tag: str,
        tensors: dict[str, torch.Tensor],
        *,
        meta: dict[str, Any] | None = None,
        digest: bytes | None = None,
        timeout: float | None = None,
    ) -> SendReport:
        """Send `tensors` to `peer`, which must `receive(our id, tag)`. Returns when it verified them.

        `digest`, if the caller already knows it (see `payload_digest`), travels in the header;
        otherwise it is computed while sending and travels in the trailer.
        """
        if len(tag) > MAX_TAG_CHARS:
            raise TransferError("tag too long")
        tensors = contiguous_cpu(tensors)
        specs = specs_of(tensors)
        views = byte_views(tensors)
        total = total_bytes(specs)
        xfer = os.urandom(16)
        header = {
            "tag": tag,
            "xfer": xfer,
            "specs": [s.to_wire() for s in specs],
            "meta": meta or {},
            "digest": digest,
            "eager": total <= self.config.eager_bytes,
        }
        try:
            return await self._send_with_retries(peer, tag, header, views, total, timeout)
        except trio.TooSlowError:
            raise TransferError(f"sending {tag!r} to {peer} took longer than {timeout:g} s") from None

    async def _send_with_retries(
        self, peer: str, tag: str, header: dict, views: list[memoryview], total: int, timeout: float | None
    ) -> SendReport:
        t0 = time.perf_counter()
        resumes = 0
        bulk = 0 < self.config.bulk_bytes <= total
        with trio.fail_after(timeout) if timeout else nullcontext():
            attempt = 0
            while True:
                ch = None
                try:
                    ch = await self._channel(peer, bulk=bulk)
                    final = await self._send_on(ch, header, views, total)
                    self._release(peer, ch, bulk=bulk)
                    return SendReport(peer, tag, total, final, ch.path, time.perf_counter() - t0, resumes)
                except (TransferRefused, DigestMismatch):
                    if ch is not None:
                        await ch.aclose()
                    raise
                except (WireError, HandshakeError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    if ch is not None:
                        await ch.aclose()
                    attempt += 1
                    if attempt > self.config.reconnect_attempts:
                        raise PeerGone(f"sending {tag!r} to {peer}: connection lost ({e})") from None
                    resumes += 1
                    self.stats["resumes"] += 1
                    log.info(kv("transfer interrupted, resuming", peer=peer, tag=tag, error=repr(e)))
                    header["eager"] = False  # a resumed attempt learns its offset from ACCEPT
                    await trio.sleep(0.05 * attempt)
                except trio.Cancelled:
                    if ch is not None:
                        await ch.aclose()
                    raise

    async def receive(
        self,
        peer: str,
        tag: str,
        *,
        into: dict[str, torch.Tensor] | None = None,
        max_bytes: int | None = None,
        timeout: float | None = None,
    ) -> Received:
        """Wait for `peer` to send under `tag`. With `into`, data lands in those tensors (which
        must match the sender's names, dtypes and shapes exactly, be contiguous and on CPU)."""
        return await self.inbox.receive(peer, tag, into=into, max_bytes=max_bytes, timeout=timeout)

    async def prepare(self, peer: str) -> str:
        """Open (and pool) a connection to `peer` ahead of a transfer; returns its path.

        Collectives call this for their group before a round so that session setup and the TCP
        handshake are not on the critical path."""
        ch = await self._channel(peer)
        self._release(peer, ch)
        return ch.path

    # -- send side -----------------------------------------------------------------------------

    async def _send_on(self, ch: DataChannel, header: dict, views: list[memoryview], total: int) -> bytes:
        self.active.add(ch)
        try:
            return await self._send_frames(ch, header, views, total)
        finally:
            self.active.discard(ch)

    async def _send_frames(self, ch: DataChannel, header: dict, views: list[memoryview], total: int) -> bytes:
        await ch.send_msg(HEADER, header)
        if header["eager"]:  # the payload goes at once; ACCEPT must then say offset 0
            digest = await self._send_payload(ch, header, views, 0)
            if await self._accepted_offset(ch, header, total) != 0:
                raise MalformedMessage("an eager transfer was accepted at a resume offset")
        else:
            digest = await self._send_payload(ch, header, views, await self._accepted_offset(ch, header, total))
        kind, msg = await ch.recv_msg(ACK, ERROR)
        if kind == ERROR:
            text = _error_text(msg)
            if text.startswith("digest"):
                raise DigestMismatch(f"{header['tag']!r}: receiver reports {text}")
            raise TransferRefused(f"{header['tag']!r} refused: {text}")
        return digest

    @staticmethod
    async def _accepted_offset(ch: DataChannel, header: dict, total: int) -> int:
        kind, msg = await ch.recv_msg(ACCEPT, ERROR)
        if kind == ERROR:
            raise TransferRefused(f"{header['tag']!r} refused: {_error_text(msg)}")
        offset = require_map(msg, "offset", error=MalformedMessage)["offset"]
        if not isinstance(offset, int) or not 0 <= offset <= total:
            raise MalformedMessage("bad resume offset")
        return offset

    async def _send_payload(self, ch: DataChannel, header: dict, views: list[memoryview], offset: int) -> bytes:
        """DATA from `offset` on, then the TRAILER; returns the payload's digest."""
        hasher = blake3.blake3() if header["digest"] is None else None
        if hasher is not None and offset:
            for v in _prefix(views, offset):
                hasher.update(v)
        staging = bytearray(self.config.chunk_bytes)
        for piece in payload_chunks(views, offset, self.config.chunk_bytes, staging):
            await ch.send(DATA, piece)
            if hasher is not None:
                hasher.update(piece)
            self.stats["bytes_sent"] += len(piece)
        digest = header["digest"] if hasher is None else hasher.digest()
        await ch.send_msg(TRAILER, {"digest": digest})
        return digest

    async def _channel(self, peer: str, *, bulk: bool = False) -> DataChannel:
        """A connection to `peer`: an idle one from the pool (`bulk`: the bulk transfers'), else a
        new one."""
        idle = (self._bulk if bulk else self._idle).get(peer)
        while idle:
            ch = idle.pop()
            if not ch.broken:
                return ch
        self.stats["connections_opened"] += 1
        if self.config.direct and self._no_direct_until.get(peer, 0) < time.monotonic():
            try:
                ch = await self._dial_direct(peer)
                self.paths[peer] = ch.path
                return ch
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
        self.paths[peer] = "libp2p"
        return DataChannel(FramedStream(stream, max_frame=MAX_CHUNK + 64), "libp2p", None)

    async def _dial_direct(self, peer: str) -> DataChannel:
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

    async def _client_handshake(self, peer: str, stream: trio.SocketStream, sid: bytes, key: bytes) -> DataChannel:
        """Open a data-plane connection as the client on an already connected TCP stream."""
        cnonce = os.urandom(NONCE_BYTES)
        await stream.send_all(MAGIC + sid + cnonce)
        framed = FramedStream(stream, max_frame=MAX_CHUNK + 64)
        snonce = await framed.read_exactly(NONCE_BYTES)
        stream.setsockopt(6, 1, 1)  # TCP_NODELAY: frames are already large
        keys = derive_keys(key, cnonce, snonce, self.host.peer_id, peer)
        return DataChannel(framed, "direct", keys)

    def _release(self, peer: str, ch: DataChannel, *, bulk: bool = False) -> None:
        if not ch.broken:
            (self._bulk if bulk else self._idle).setdefault(peer, []).append(ch)

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
        c2s, s2c = derive_keys(session.key, cnonce, snonce, session.peer, self.host.peer_id)
        await self.inbox.serve_channel(DataChannel(framed, "direct", (s2c, c2s)), session.peer)

    async def _serve_fallback(self, stream: Any) -> None:
        try:
            peer = stream_peer(stream)
        except Exception:
            return
        ch = DataChannel(FramedStream(stream, max_frame=MAX_CHUNK + 64), "libp2p", None)
        if not await self.admits(peer):
            await self._turn_away(ch, NOT_A_MEMBER, "this peer does not serve its data plane to you")
            return
        await self.inbox.serve_channel(ch, peer)

    async def _turn_away(self, ch: DataChannel, code: str, text: str) -> None:
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


def _prefix(views: list[memoryview], n: int) -> Iterator[memoryview]:
    for v in views:
        if n <= 0:
            return
        yield v[: min(n, len(v))]
        n -= len(v)


def _error_text(msg: Any) -> str:
    if isinstance(msg, dict):
        return f"{msg.get('code', '?')!s:.40}: {msg.get('text', '')!s:.200}"
    return "malformed error"


def listen_ips(listen: Any) -> list[str]:
    """The distinct IPs of the /ip4 and /ip6 addresses among `listen`, in order; loopback if none."""
    return addr_ips(listen) or ["127.0.0.1"]
