"""The data plane's wire: one frame protocol on one connection, sealed or plain.

tensor_streams.py tells the data plane's whole story (sessions, transfers, rendezvous, resume,
limits); this is the layer under it, the part that touches bytes:
- **Frames** `[u32 length][u8 kind][body]` (`FRAME_HEAD`), kinds HEADER, ACCEPT, DATA, TRAILER,
  ACK, ERROR. Control frames (`send_msg`/`recv_msg`) carry msgpack of at most `MAX_CONTROL` bytes;
  DATA bodies are read straight into the receiver's tensors (`recv_body_into`).
- **Sealing** (direct TCP connections): each direction has its own AES-256-GCM key
  (`derive_keys`: HKDF of the session key over both nonces of the MTDP1 opening, bound to both
  peer ids), a counter nonce and the kind byte as associated data, so frames cannot be
  reordered, replayed or retyped; a frame that fails authentication is a `HandshakeError`.
  Encryption reads from the tensors' memory and decryption writes into the receive buffers
  (`encrypt_into`/`decrypt_into`). Plain (inside a libp2p stream, which Noise encrypts), a big
  body goes from the tensor memory to the stream without a copy.
- **Payloads** leave in chunks (`payload_chunks`): slices of tensor memory, or one staging buffer
  where a chunk spans small tensors; `payload_digest` is the blake3 a transfer announces.
- What both sides share: the errors every caller sees (`TransferError` and its kinds), the
  refusal codes (the keys of `TensorStreams.refused`), `DataPlaneConfig` and `Received`.

Not here: sessions, pooling and the send side (tensor_streams.py), the receive side
(tensor_inbox.py).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import blake3
import torch
import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from meshtrain.errors import MeshtrainError
from meshtrain.transport.framing import FramedStream, MalformedMessage, packb, unpackb
from meshtrain.transport.tensor_layout import byte_views, contiguous_cpu

MAGIC = b"MTDP1"
NONCE_BYTES = 16
SID_BYTES = 16
TAG_BYTES = 16  # AES-GCM tag
MIN_CHUNK, MAX_CHUNK = 1 << 20, 4 << 20
MAX_CONTROL = 4 << 20  # header frames carry specs: 100k tensors fit

MAX_TAG_CHARS = 256
# How long `authorize(peer)` may take. The node's answer waits for the peer's membership record to
# replicate (a few seconds for a peer that just joined); this must stay well under the session
# RPC's client timeout (10 s) so that a slow verdict is a refusal, not an RPC timeout.
AUTHORIZE_TIMEOUT = 5.0

# Refusal reasons (also the ERROR / RemoteError codes, except the two authorize-* ones, which
# tell the peer `not-a-member`): the keys of `TensorStreams.refused`.
NOT_A_MEMBER = "not-a-member"
AUTHORIZE_TIMED_OUT = "authorize-timeout"
AUTHORIZE_FAILED = "authorize-error"
TOO_MANY_PENDING = "too-many-pending"
REFUSAL_REASONS = (
    NOT_A_MEMBER,
    AUTHORIZE_TIMED_OUT,
    AUTHORIZE_FAILED,
    TOO_MANY_PENDING,
    "unclaimed",
    "busy",
    "cancelled",
    "layout",
    "digest",
)

HEADER, ACCEPT, DATA, TRAILER, ACK, ERROR = 1, 2, 3, 4, 5, 6
FRAME_HEAD = struct.Struct(">IB")  # frame length (kind byte + body), kind


class TransferError(MeshtrainError):
    """A tensor transfer failed; the message says which peer and why."""


class PeerGone(TransferError):
    """The other peer disappeared (killed, disconnected) and did not come back in time."""


class TransferRefused(TransferError):
    """The receiver refused the transfer (no matching receive, wrong shapes, too large)."""


class DigestMismatch(TransferError):
    """The received payload's digest differs from the one the sender announced."""


class HandshakeError(TransferError):
    """A data-plane connection failed authentication (wrong or replayed key)."""


@dataclass(frozen=True)
class DataPlaneConfig:
    chunk_bytes: int = 4 << 20  # measured: 4 MiB frames ~1.5x faster than 1 MiB in Python
    max_transfer_bytes: int = 64 << 30
    claim_timeout: float = 120.0  # how long an early sender waits for the matching receive
    resume_window: float = 15.0  # how long a receiver keeps a broken transfer for resumption
    reconnect_attempts: int = 3
    handshake_timeout: float = 10.0
    direct: bool = True  # False: always use the libp2p fallback
    listen_ip: str | None = None  # default: every IP the host listens on (IPv4 and IPv6), one port
    port: int = 0
    # Early senders waiting for their receive (see "Limits" above for why these numbers).
    max_pending_per_peer: int = 64
    max_pending: int = 256
    authorize_timeout: float = AUTHORIZE_TIMEOUT
    # Transfers of at most this many bytes go with their header, without waiting for ACCEPT
    # (module docstring: eager transfers); 0: never.
    eager_bytes: int = 256 << 10
    # Transfers of at least this many bytes go on connections kept apart from the others' pool
    # (module docstring: bulk connections); 0: one pool for all.
    bulk_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if not MIN_CHUNK <= self.chunk_bytes <= MAX_CHUNK:
            raise ValueError("chunk_bytes must be between 1 and 4 MiB")
        if not 1 <= self.max_pending_per_peer <= self.max_pending:
            raise ValueError("need 1 <= max_pending_per_peer <= max_pending")
        if not self.authorize_timeout > 0:
            raise ValueError("authorize_timeout must be positive")
        if not 0 <= self.eager_bytes <= MAX_CHUNK:
            raise ValueError("eager_bytes must be between 0 and 4 MiB")
        if self.bulk_bytes < 0:
            raise ValueError("bulk_bytes must be >= 0 (0: one connection pool for all transfers)")


@dataclass(frozen=True)
class Received:
    peer: str
    tag: str
    tensors: dict[str, torch.Tensor]
    digest: bytes
    meta: dict[str, Any]
    nbytes: int
    path: str  # "direct" or "libp2p"


def payload_digest(tensors: dict[str, torch.Tensor]) -> bytes:
    """blake3 of the concatenated tensor bytes — the digest a transfer announces."""
    h = blake3.blake3()
    for v in byte_views(contiguous_cpu(tensors)):
        h.update(v)
    return h.digest()


class DataChannel:
    """One connection of the data plane, framed; sealed with per-direction AES-GCM keys (direct
    TCP) or plain (`keys` None: inside a libp2p stream, which Noise already encrypts)."""

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
        need = FRAME_HEAD.size + n
        if len(self._out) < need:
            self._out = bytearray(max(need, len(self._out) * 2 if self._out else need))
        out = memoryview(self._out)
        FRAME_HEAD.pack_into(out, 0, n + 1, kind)
        if self._send_aead is not None:
            self._send_aead.encrypt_into(self._nonce(self._send_ctr), body, bytes([kind]), out[FRAME_HEAD.size : need])
            self._send_ctr += 1
            await self.framed.write(out[:need])
        elif len(body) < 65536:
            out[FRAME_HEAD.size : need] = body
            await self.framed.write(out[:need])
        else:  # plain and big: header, then the tensor memory itself
            await self.framed.write(out[: FRAME_HEAD.size])
            await self.framed.write(body)

    async def send_msg(self, kind: int, value: Any) -> None:
        await self.send(kind, packb(value))

    async def recv_head(self) -> tuple[int, int]:
        """(kind, body length without the AEAD tag)."""
        length, kind = FRAME_HEAD.unpack(await self.framed.read_exactly(FRAME_HEAD.size))
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


def derive_keys(key: bytes, cnonce: bytes, snonce: bytes, client: str, server: str) -> tuple[bytes, bytes]:
    """The client->server and server->client AES-256 keys of one direct connection: HKDF of the
    session key over both nonces, bound to both peer ids."""
    okm = HKDF(
        algorithm=hashes.SHA256(),
        length=64,
        salt=cnonce + snonce,
        info=b"meshtrain/dataplane/1|" + client.encode() + b"|" + server.encode(),
    ).derive(key)
    return okm[:32], okm[32:]  # client->server, server->client


def payload_chunks(views: list[memoryview], start: int, chunk: int, staging: bytearray) -> Iterator[memoryview]:
    """Yield the payload from byte `start` in chunks: slices of tensor memory, or a filled staging
    buffer where a chunk spans several (small) tensors."""
    seg_start = 0
    segs = []
    for v in views:
        segs.append((seg_start, v))
        seg_start += len(v)
    total = seg_start
    pos = start
    i = 0
    while i < len(segs) and segs[i][0] + len(segs[i][1]) <= pos:
        i += 1
    while pos < total:
        end = min(pos + chunk, total)
        s0, v = segs[i]
        if end <= s0 + len(v):
            yield v[pos - s0 : end - s0]
        else:
            n = end - pos
            out = memoryview(staging)[:n]
            filled = 0
            while filled < n:
                s0, v = segs[i]
                take = min(n - filled, s0 + len(v) - (pos + filled))
                off = pos + filled - s0
                out[filled : filled + take] = v[off : off + take]
                filled += take
                if pos + filled >= s0 + len(v):
                    i += 1
            yield out
        pos = end
        while i < len(segs) and segs[i][0] + len(segs[i][1]) <= pos:
            i += 1
