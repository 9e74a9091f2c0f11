"""Tensor streams: moving dicts of named tensors between two peers, fast, beside libp2p.

`TensorStreams` is the data plane of one host. Its bytes travel on data channels (data_channel.py:
session keys handed over libp2p, direct TCP connections of AES-256-GCM frames or libp2p streams as
the fallback, pooling, and who is admitted); this module is what runs on a channel.

**Transfer** (one at a time on a channel): HEADER (tag, transfer id, tensor specs, meta, optional
digest) -> ACCEPT (resume offset) -> DATA chunks of 1–4 MiB -> TRAILER (blake3 digest of the
payload) -> ACK; a receiver that turns the transfer down answers ERROR (code, text) instead of
ACCEPT or ACK. Chunks are slices of the tensors' own memory (a staging buffer only where a chunk
spans several small tensors) and land straight in the receive buffers, so memory stays at one
model copy plus a couple of chunk buffers.

Back-pressure is TCP's own: a receiver that stops reading (a long forward pass, SIGSTOP) just
makes the sender's writes wait; there is no stall timeout, only the caller's deadline.

**Resume**: if a connection drops mid-transfer, the receiver keeps what it verified for
`resume_window` seconds; the sender reconnects and re-sends the HEADER with the same transfer id,
and the ACCEPT tells it where to continue. A sender that cannot reconnect raises `PeerGone`; a
receiver whose sender did not come back within the window raises `PeerGone` from `receive`.

**Rendezvous**: `send(peer, tag, tensors)` pairs with `receive(peer, tag)` on the other side. A
sender that arrives first waits (without sending data) until the receiver asks for that tag, up to
`claim_timeout`, or until it hangs up. Tags are the caller's namespace, e.g. `allreduce/17/part3`.

**Limits** on senders that arrive first: each waits holding a server task, a connection and its
parsed header. At most `max_pending_per_peer` (64) such headers per peer and `max_pending` (256)
in all wait at once; one more is refused at once with ERROR `too-many-pending` (the sender sees
`TransferRefused`). A header whose receive is already waiting never counts. An all-reduce round
has at most 2 × `window` (4) tags per peer pair in flight at once (its pipelined reduce-scatter
and all-gather stripes), and posts its receives up front, so 64 per peer leaves room for tens of
concurrent collectives and pipeline hops, and 256 for a round of ~128 peers all early at once.
Every refusal is counted by reason in `streams.refused` (for /metrics): the channels' admission
reasons, then `too-many-pending` and the transfer refusals `unclaimed`, `busy`, `cancelled`,
`layout`, `digest`.

Errors: `DigestMismatch` here; `TransferError`, `PeerGone`, `TransferRefused`, `HandshakeError`
and `DataPlaneConfig` live with the channels and are re-exported (`__all__`), as are the wire
names that callers know from here.

Not here: how a channel is opened, authenticated, pooled and admitted (data_channel.py); a byte
budget for waiting headers (the count bounds it: at most `max_pending` headers of at most 4 MiB
each).
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch
import trio

from meshtrain.log import get_logger, kv
from meshtrain.transport.data_channel import (
    ACCEPT,
    ACK,
    ADMISSION_REFUSALS,
    DATA,
    ERROR,
    FALLBACK_PROTOCOL,
    HEADER,
    MAGIC,
    MAX_CHUNK,
    MIN_CHUNK,
    NOT_A_MEMBER,
    SESSION_RPC,
    TRAILER,
    Channel,
    DataChannels,
    DataPlaneConfig,
    HandshakeError,
    PeerGone,
    TransferError,
    TransferRefused,
)
from meshtrain.transport.framing import MalformedMessage, StreamClosed, WireError
from meshtrain.transport.host import Host
from meshtrain.transport.tensor_layout import (
    LayoutError,
    TensorSpec,
    allocate,
    byte_views,
    check_matches,
    contiguous_cpu,
    specs_of,
    total_bytes,
    validate_specs,
)
from meshtrain.transport.validate import require_map

# The channels' names that callers import from here (they lived here before data_channel.py).
__all__ = [
    "DataPlaneConfig",
    "DigestMismatch",
    "FALLBACK_PROTOCOL",
    "HEADER",
    "HandshakeError",
    "MAGIC",
    "MAX_TAG_CHARS",
    "NOT_A_MEMBER",
    "PeerGone",
    "REFUSAL_REASONS",
    "Received",
    "SESSION_RPC",
    "SendReport",
    "TOO_MANY_PENDING",
    "TRANSFER_REFUSALS",
    "TensorStreams",
    "TransferError",
    "TransferRefused",
    "payload_digest",
]

log = get_logger(__name__)

MAX_TAG_CHARS = 256

# Refusal reasons (also the ERROR / RemoteError codes, except the two authorize-* ones, which
# tell the peer `not-a-member`): the keys of `TensorStreams.refused`, the channels' admission
# reasons first.
TOO_MANY_PENDING = "too-many-pending"
TRANSFER_REFUSALS = (TOO_MANY_PENDING, "unclaimed", "busy", "cancelled", "layout", "digest")
REFUSAL_REASONS = ADMISSION_REFUSALS + TRANSFER_REFUSALS


class DigestMismatch(TransferError):
    """The received payload's digest differs from the one the sender announced."""


class _Abandoned(Exception):
    """Internal: the receive this transfer was feeding was cancelled."""


class _Refusal(Exception):
    """Internal: turn this transfer down with an ERROR frame carrying `code`."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


@dataclass(frozen=True)
class Received:
    peer: str
    tag: str
    tensors: dict[str, torch.Tensor]
    digest: bytes
    meta: dict[str, Any]
    nbytes: int
    path: str  # "direct" or "libp2p"


@dataclass(frozen=True)
class SendReport:
    peer: str
    tag: str
    nbytes: int
    digest: bytes
    path: str
    seconds: float
    resumes: int


def payload_digest(tensors: dict[str, torch.Tensor]) -> bytes:
    """blake3 of the concatenated tensor bytes — the digest a transfer announces."""
    h = blake3.blake3()
    for v in byte_views(contiguous_cpu(tensors)):
        h.update(v)
    return h.digest()


# --------------------------------------------------------------------------------------------
# Payload chunks: slices of tensor memory, the unit of a DATA frame


def _chunks(views: list[memoryview], start: int, chunk: int, staging: bytearray) -> Iterator[memoryview]:
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


# --------------------------------------------------------------------------------------------
# Receive side state


@dataclass
class _Slot:
    """One `receive` call (or a sender waiting for one)."""

    peer: str
    tag: str
    into: dict[str, torch.Tensor] | None = None
    max_bytes: int | None = None
    registered: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    claimed: bool = False
    cancelled: bool = False
    result: Received | None = None
    error: Exception | None = None

    def finish(self, result: Received | None = None, error: Exception | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()


@dataclass
class _Partial:
    """A transfer in progress on the receive side (survives a dropped connection)."""

    slot: _Slot
    specs: list[TensorSpec]
    tensors: dict[str, torch.Tensor]
    views: list[memoryview]
    total: int
    header_digest: bytes | None
    meta: dict[str, Any]
    done: int = 0
    hasher: Any = field(default_factory=blake3.blake3)
    resumed: trio.Event = field(default_factory=trio.Event)
    active: bool = True


class TensorStreams(DataChannels):
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
        super().__init__(host, config, authorize=authorize)
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._partials: dict[tuple[str, bytes], _Partial] = {}
        # (peer, tag) whose receive was cancelled -> until when a sender is refused at once
        self._abandoned: dict[tuple[str, str], float] = {}
        self.active: set[Channel] = set()  # connections currently carrying a transfer
        self.stats.update(bytes_sent=0, bytes_received=0, resumes=0)
        self.refused.update(dict.fromkeys(TRANSFER_REFUSALS, 0))
        # peer -> headers of early senders now waiting in `_claim` for their receive
        self._waiting: dict[str, int] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    async def _stop(self) -> None:
        await super()._stop()
        for slot in self._slots.values():
            slot.finish(error=TransferError("data plane closed"))

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
        with trio.fail_after(timeout) if timeout else nullcontext():
            attempt = 0
            while True:
                ch = None
                try:
                    ch = await self._channel(peer)
                    final = await self._send_on(ch, header, views, total)
                    self._release(peer, ch)
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
        key = (peer, tag)
        slot = self._slots.get(key)
        if slot is not None and (slot.registered.is_set() or slot.claimed and slot.into is not None):
            raise TransferError(f"already receiving {tag!r} from {peer}")
        if slot is None:
            slot = _Slot(peer, tag)
            self._slots[key] = slot
        self._abandoned.pop(key, None)
        slot.into = into
        slot.max_bytes = max_bytes
        slot.registered.set()
        try:
            with trio.fail_after(timeout) if timeout else nullcontext():
                await slot.done.wait()
        except trio.TooSlowError:
            self._abandon(slot)
            raise TransferError(f"no tensors {tag!r} from {peer} within {timeout:g} s") from None
        except BaseException:
            self._abandon(slot)
            raise
        finally:
            if self._slots.get(key) is slot:
                del self._slots[key]
        if slot.error is not None:
            raise slot.error
        assert slot.result is not None  # set together with done
        return slot.result

    # -- send side -----------------------------------------------------------------------------

    async def _send_on(self, ch: Channel, header: dict, views: list[memoryview], total: int) -> bytes:
        self.active.add(ch)
        try:
            return await self._send_frames(ch, header, views, total)
        finally:
            self.active.discard(ch)

    async def _send_frames(self, ch: Channel, header: dict, views: list[memoryview], total: int) -> bytes:
        await ch.send_msg(HEADER, header)
        kind, msg = await ch.recv_msg(ACCEPT, ERROR)
        if kind == ERROR:
            raise TransferRefused(f"{header['tag']!r} refused: {_error_text(msg)}")
        offset = require_map(msg, "offset", error=MalformedMessage)["offset"]
        if not isinstance(offset, int) or not 0 <= offset <= total:
            raise MalformedMessage("bad resume offset")
        hasher = blake3.blake3() if header["digest"] is None else None
        if hasher is not None and offset:
            for v in _prefix(views, offset):
                hasher.update(v)
        staging = bytearray(self.config.chunk_bytes)
        for piece in _chunks(views, offset, self.config.chunk_bytes, staging):
            await ch.send(DATA, piece)
            if hasher is not None:
                hasher.update(piece)
            self.stats["bytes_sent"] += len(piece)
        digest = header["digest"] if hasher is None else hasher.digest()
        await ch.send_msg(TRAILER, {"digest": digest})
        kind, msg = await ch.recv_msg(ACK, ERROR)
        if kind == ERROR:
            text = _error_text(msg)
            if text.startswith("digest"):
                raise DigestMismatch(f"{header['tag']!r}: receiver reports {text}")
            raise TransferRefused(f"{header['tag']!r} refused: {text}")
        return digest

    # -- serve side ----------------------------------------------------------------------------
    async def _serve_channel(self, ch: Channel, peer: str) -> None:
        """Receive transfers from `peer` on one connection until it closes."""
        try:
            while not await ch.framed.at_eof():  # a clean close between transfers ends the loop
                _, header = await ch.recv_msg(HEADER)
                await self._receive_one(ch, peer, header)
        except HandshakeError as e:
            self.stats["handshake_failures"] += 1
            log.info(kv("data-plane frame rejected", peer=peer, reason=str(e)))
        except _Abandoned:
            with trio.move_on_after(1):  # tell the sender now rather than let it retry
                await self._refuse_transfer(ch, "cancelled", "the receiver gave up")
        except (WireError, LayoutError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            log.info(kv("data-plane connection ended", peer=peer, reason=repr(e)))
        except Exception as e:  # a connection handler must never take the node down
            log.warning(kv("data-plane handler failed", peer=peer, error=repr(e)))
        finally:
            await ch.aclose()

    async def _receive_one(self, ch: Channel, peer: str, header: Any) -> None:
        header = require_map(header, "tag", "xfer", "specs", "meta", "digest", error=MalformedMessage)
        tag, xfer, meta, hdigest = header["tag"], header["xfer"], header["meta"], header["digest"]
        if not (
            isinstance(tag, str)
            and len(tag) <= MAX_TAG_CHARS
            and isinstance(xfer, bytes)
            and len(xfer) == 16
            and isinstance(meta, dict)
            and (hdigest is None or isinstance(hdigest, bytes) and len(hdigest) == 32)
        ):
            raise MalformedMessage("bad transfer header")
        part = self._partials.get((peer, xfer))
        if part is not None and part.slot.cancelled:
            del self._partials[(peer, xfer)]
            await self._refuse_transfer(ch, "cancelled", "the receiver gave up")
            return
        if part is not None and (part.active or part.slot.done.is_set()):
            await self._refuse_transfer(ch, "busy", "transfer already in progress")
            return
        if part is None:
            try:
                slot = await self._claim(ch, peer, tag)
            except _Refusal as e:
                await self._refuse_transfer(ch, e.code, e.text)
                return
            if slot is None:
                await self._refuse_transfer(ch, "unclaimed", f"nobody is receiving {tag!r}")
                return
            limit = min(self.config.max_transfer_bytes, slot.max_bytes or self.config.max_transfer_bytes)
            try:
                specs = validate_specs(header["specs"], max_bytes=limit)
                if slot.into is not None:
                    check_matches(specs, slot.into)
                    tensors = slot.into
                else:
                    tensors = allocate(specs)
                views = byte_views(tensors)
            except LayoutError as e:
                slot.finish(error=TransferRefused(f"{tag!r} from {peer}: {e}"))
                await self._refuse_transfer(ch, "layout", str(e))
                return
            part = _Partial(slot, specs, tensors, views, total_bytes(specs), hdigest, meta)
            self._partials[(peer, xfer)] = part
        else:
            part.active = True
            part.resumed.set()
            part.resumed = trio.Event()
        self.active.add(ch)
        try:
            await ch.send_msg(ACCEPT, {"offset": part.done})
            await self._receive_data(ch, part)
            _, trailer = await ch.recv_msg(TRAILER)
        except BaseException:
            self.active.discard(ch)
            part.active = False
            if not part.slot.done.is_set():
                assert self._nursery is not None  # set in _start
                self._nursery.start_soon(self._expire_partial, peer, xfer, part)
            raise
        self.active.discard(ch)
        del self._partials[(peer, xfer)]
        tdigest = require_map(trailer, "digest", error=MalformedMessage)["digest"]
        mine = part.hasher.digest()
        expected = part.header_digest or tdigest
        if mine != expected:
            part.slot.finish(error=DigestMismatch(f"{tag!r} from {peer}: payload digest mismatch"))
            await self._refuse_transfer(ch, "digest", "digest mismatch")
            return
        await ch.send_msg(ACK, {})
        self.stats["bytes_received"] += part.total
        part.slot.finish(Received(peer, tag, part.tensors, mine, meta, part.total, ch.path))

    async def _refuse_transfer(self, ch: Channel, code: str, text: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1
        await ch.send_msg(ERROR, {"code": code, "text": text})

    async def _receive_data(self, ch: Channel, part: _Partial) -> None:
        seg_ends = []
        acc = 0
        for v in part.views:
            acc += len(v)
            seg_ends.append(acc)
        staging = bytearray(0)
        while part.done < part.total:
            kind, n = await ch.recv_head()
            if kind != DATA or n == 0 or n > MAX_CHUNK or part.done + n > part.total:
                raise MalformedMessage(f"bad data frame (kind {kind}, {n} bytes)")
            if part.slot.cancelled:
                raise _Abandoned
            start, end = part.done, part.done + n
            i = _segment_of(seg_ends, start)
            seg_start = seg_ends[i] - len(part.views[i])
            if end <= seg_ends[i]:  # within one tensor: decrypt straight into it
                dest = part.views[i][start - seg_start : end - seg_start]
                await ch.recv_body_into(DATA, dest)
                part.hasher.update(dest)
            else:
                if len(staging) < n:
                    staging = bytearray(max(n, MIN_CHUNK))
                buf = memoryview(staging)[:n]
                await ch.recv_body_into(DATA, buf)
                part.hasher.update(buf)
                pos = 0
                while pos < n:
                    seg_start = seg_ends[i] - len(part.views[i])
                    off = start + pos - seg_start
                    take = min(n - pos, len(part.views[i]) - off)
                    part.views[i][off : off + take] = buf[pos : pos + take]
                    pos += take
                    i += 1
            part.done = end

    def _abandon(self, slot: _Slot) -> None:
        slot.cancelled = True
        now = time.monotonic()
        self._abandoned = {k: t for k, t in self._abandoned.items() if t > now}
        self._abandoned[(slot.peer, slot.tag)] = now + self.config.claim_timeout

    async def _claim(self, ch: Channel, peer: str, tag: str) -> _Slot | None:
        """The receive this header feeds: at once if it is waiting, else after waiting for it
        (bounded by `claim_timeout`, the pending limits, and the sender hanging up). None if
        there is none to feed; `_Refusal` if the sender may not wait."""
        key = (peer, tag)
        if self._abandoned.get(key, 0) > time.monotonic():
            return None
        slot = self._slots.get(key)
        if slot is not None and slot.claimed:
            return None
        if slot is None:  # an early sender: it must wait, if there is room
            waiting = self._waiting.get(peer, 0)
            if waiting >= self.config.max_pending_per_peer:
                raise _Refusal(TOO_MANY_PENDING, f"{waiting} of your transfers already wait for their receive here")
            if sum(self._waiting.values()) >= self.config.max_pending:
                raise _Refusal(TOO_MANY_PENDING, "too many transfers already wait for their receive here")
            slot = _Slot(peer, tag)
            self._slots[key] = slot
        slot.claimed = True
        if not slot.registered.is_set():
            hung_up = await self._wait_for_receive(ch, peer, slot)
            if not slot.registered.is_set() and self._slots.get(key) is slot:
                del self._slots[key]
            if hung_up:
                raise StreamClosed("the sender hung up while waiting for its receive")
        if not slot.registered.is_set() or slot.cancelled:
            return None
        return slot

    async def _wait_for_receive(self, ch: Channel, peer: str, slot: _Slot) -> bool:
        """Wait up to `claim_timeout` for `slot` to be registered, counted in `_waiting`.
        Returns whether the sender hung up first: then its place is freed at once, not after
        `claim_timeout` (a sender whose own deadline passed closes its connection)."""
        hung_up = False

        async def watch_sender(done: trio.CancelScope) -> None:
            nonlocal hung_up
            try:  # an honest sender sends nothing until ACCEPT, so this reads only the end
                hung_up = await ch.framed.at_eof()
            except Exception:
                hung_up = True
            if hung_up:
                done.cancel()

        self._waiting[peer] = self._waiting.get(peer, 0) + 1
        try:
            with trio.move_on_after(self.config.claim_timeout):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_sender, nursery.cancel_scope)
                    await slot.registered.wait()
                    nursery.cancel_scope.cancel()
        finally:
            self._waiting[peer] -= 1
            if not self._waiting[peer]:
                del self._waiting[peer]
        return hung_up and not slot.registered.is_set()

    async def _expire_partial(self, peer: str, xfer: bytes, part: _Partial) -> None:
        resumed = part.resumed
        with trio.move_on_after(self.config.resume_window):
            await resumed.wait()
            return
        if self._partials.get((peer, xfer)) is part and not part.active:
            del self._partials[(peer, xfer)]
            part.slot.finish(
                error=PeerGone(
                    f"{part.slot.tag!r} from {peer}: sender vanished after {part.done} of {part.total} bytes"
                )
            )


def _segment_of(seg_ends: list[int], offset: int) -> int:
    return bisect.bisect_right(seg_ends, offset)


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
