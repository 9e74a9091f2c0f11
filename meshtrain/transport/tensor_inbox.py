"""The receive side of the data plane: where a transfer meets the `receive` that asked for it.

tensor_streams.py tells the data plane's whole story; this is its receiving half, one `Inbox` per
data plane, fed every connection a peer opens to us (`serve_channel`, after the session
handshake or the fallback stream's authorization):
- **Rendezvous.** `receive(peer, tag)` posts a slot and waits. A transfer's HEADER claims the
  slot of its (peer, tag) (`_claim`): at once if the receive is posted, else the sender waits
  (sending nothing) until it is, up to `claim_timeout`, or until it hangs up. Early senders are
  bounded, `max_pending_per_peer` per peer and `max_pending` in all (`waiting`); one more is
  refused with `too-many-pending`. A receive that was cancelled or timed out refuses its sender
  at once (`cancelled`) for `claim_timeout`, rather than let it wait for nobody.
- **Data.** The header's specs are checked against the receive's `into` (or `max_bytes`), ACCEPT
  carries the offset to start from, DATA frames land straight in the tensors (or through one
  staging buffer where a frame spans tensors), hashed as they come; TRAILER's digest (or the
  header's) must match, then ACK.
- **Eager transfers**: their payload follows the header unasked, so a refusal first reads it
  away (bounded by our own `eager_bytes`; more than that ends the connection).
- **Resume.** A transfer whose connection dropped is kept (`partials`) for `resume_window`; a
  HEADER with the same transfer id continues it from where it stopped. Not resumed in time,
  its receive gets `PeerGone`. A HEADER for the same receive with another transfer id replaces
  it at once: the sender started over (restarted, or gave up resuming).
Every refusal is an ERROR frame with a code, counted in the data plane's `refused`.

Not here: sessions, connections and the send side (tensor_streams.py); the wire (data_channel.py).
"""

from __future__ import annotations

import bisect
import time
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch
import trio

from meshtrain.log import get_logger, kv
from meshtrain.transport.data_channel import (
    ACCEPT,
    ACK,
    DATA,
    ERROR,
    HEADER,
    MAX_CHUNK,
    MAX_TAG_CHARS,
    MIN_CHUNK,
    TOO_MANY_PENDING,
    TRAILER,
    DataChannel,
    DataPlaneConfig,
    DigestMismatch,
    HandshakeError,
    PeerGone,
    Received,
    TransferError,
    TransferRefused,
)
from meshtrain.transport.framing import MalformedMessage, StreamClosed, WireError
from meshtrain.transport.tensor_layout import (
    LayoutError,
    TensorSpec,
    allocate,
    byte_views,
    check_matches,
    total_bytes,
    validate_specs,
)
from meshtrain.transport.validate import require_map

log = get_logger(__name__)


# What ends a data-plane connection under a handler: the peer went, or the stream broke.
CONNECTION_ENDED = (WireError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class _Abandoned(Exception):
    """Internal: the receive this transfer was feeding was cancelled."""


class _Refusal(Exception):
    """Internal: turn this transfer down with an ERROR frame carrying `code`."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


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


class Inbox:
    """The receive side of one data plane.

    config: the data plane's limits and timeouts. refused / stats / active: the data plane's
    counters (`refused` by code, `stats["bytes_received"]` and `["handshake_failures"]`) and its
    set of connections carrying a transfer, shared with its send side. `nursery` (set when the
    data plane starts) runs the expiry of broken transfers. `slots`: posted receives and early
    senders by (peer, tag); `partials`: transfers in progress by (peer, transfer id); `waiting`:
    per peer, early senders now waiting for their receive."""

    def __init__(
        self, config: DataPlaneConfig, refused: dict[str, int], stats: dict[str, int], active: set[DataChannel]
    ) -> None:
        self.config = config
        self.refused = refused
        self.stats = stats
        self.active = active
        self.nursery: trio.Nursery | None = None
        self.slots: dict[tuple[str, str], _Slot] = {}
        self.partials: dict[tuple[str, bytes], _Partial] = {}
        # (peer, tag) whose receive was cancelled -> until when a sender is refused at once
        self.abandoned: dict[tuple[str, str], float] = {}
        self.waiting: dict[str, int] = {}

    def close(self) -> None:
        """Fail every receive still posted (the data plane is stopping)."""
        for slot in self.slots.values():
            slot.finish(error=TransferError("data plane closed"))

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
        slot = self.slots.get(key)
        if slot is not None and (slot.registered.is_set() or slot.claimed and slot.into is not None):
            raise TransferError(f"already receiving {tag!r} from {peer}")
        if slot is None:
            slot = _Slot(peer, tag)
            self.slots[key] = slot
        self.abandoned.pop(key, None)
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
            if self.slots.get(key) is slot:
                del self.slots[key]
        if slot.error is not None:
            raise slot.error
        assert slot.result is not None  # set together with done
        return slot.result

    async def serve_channel(self, ch: DataChannel, peer: str) -> None:
        """Receive transfers from `peer` on one connection until it closes."""
        try:
            while not await ch.framed.at_eof():  # a clean close between transfers ends the loop
                _, header = await ch.recv_msg(HEADER)
                await self._receive_one(ch, peer, header)
        except HandshakeError as e:
            self.stats["handshake_failures"] += 1
            log.info(kv("data-plane frame rejected", peer=peer, reason=str(e)))
        except _Abandoned:
            # Tell the sender now rather than let it retry — unless its connection is gone too:
            # raised here, past the handlers below, a broken write ended the whole node (a
            # 30-minute soak's woken coordinator, "stream closed while writing", just after it
            # aborted the round whose receives it abandoned).
            with trio.move_on_after(1), suppress(*CONNECTION_ENDED):
                await self._refuse_transfer(ch, "cancelled", "the receiver gave up")
        except (LayoutError, *CONNECTION_ENDED) as e:
            log.info(kv("data-plane connection ended", peer=peer, reason=repr(e)))
        except Exception as e:  # a connection handler must never take the node down
            log.warning(kv("data-plane handler failed", peer=peer, error=repr(e)))
        finally:
            await ch.aclose()

    async def _receive_one(self, ch: DataChannel, peer: str, header: Any) -> None:
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
        eager = header.get("eager", False)
        if not isinstance(eager, bool):
            raise MalformedMessage("bad transfer header")
        # An eager payload follows its header unasked: a refusal must first read it away.
        sent = self._eager_total(header["specs"]) if eager else None
        part = self.partials.get((peer, xfer))
        if part is not None and eager:  # resuming is never eager: its offset comes from ACCEPT
            await self._refuse_transfer(ch, "busy", "an eager header reuses a transfer id", sent=sent)
            return
        if part is not None and part.slot.cancelled:
            del self.partials[(peer, xfer)]
            await self._refuse_transfer(ch, "cancelled", "the receiver gave up")
            return
        if part is not None and (part.active or part.slot.done.is_set()):
            await self._refuse_transfer(ch, "busy", "transfer already in progress")
            return
        if part is None:
            try:
                slot = await self._claim(ch, peer, tag)
            except _Refusal as e:
                await self._refuse_transfer(ch, e.code, e.text, sent=sent)
                return
            if slot is None:
                await self._refuse_transfer(ch, "unclaimed", f"nobody is receiving {tag!r}", sent=sent)
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
                await self._refuse_transfer(ch, "layout", str(e), sent=sent)
                return
            part = _Partial(slot, specs, tensors, views, total_bytes(specs), hdigest, meta)
            self.partials[(peer, xfer)] = part
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
                assert self.nursery is not None  # set when the data plane starts
                self.nursery.start_soon(self._expire_partial, peer, xfer, part)
            raise
        self.active.discard(ch)
        del self.partials[(peer, xfer)]
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

    async def _refuse_transfer(self, ch: DataChannel, code: str, text: str, *, sent: int | None = None) -> None:
        """Answer ERROR; `sent`: the bytes of an eager payload that follows, read away first."""
        if sent is not None:
            await self._discard_payload(ch, sent)
        self.refused[code] = self.refused.get(code, 0) + 1
        await ch.send_msg(ERROR, {"code": code, "text": text})

    def _eager_total(self, raw_specs: Any) -> int:
        """The size of an eager header's payload; a payload past our own eager limit (or specs we
        cannot read) would have to be read to refuse it: the connection ends instead."""
        try:
            return total_bytes(validate_specs(raw_specs, max_bytes=self.config.eager_bytes))
        except LayoutError as e:
            raise MalformedMessage(f"eager transfer refused: {e}") from None

    @staticmethod
    async def _discard_payload(ch: DataChannel, total: int) -> None:
        """Read and drop an eager payload of `total` bytes and its TRAILER."""
        got = 0
        while got < total:
            kind, n = await ch.recv_head()
            if kind != DATA or n == 0 or got + n > total:
                raise MalformedMessage(f"bad eager data frame (kind {kind}, {n} bytes)")
            await ch.recv_body_into(DATA, memoryview(bytearray(n)))
            got += n
        await ch.recv_msg(TRAILER)

    async def _receive_data(self, ch: DataChannel, part: _Partial) -> None:
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
        self.abandoned = {k: t for k, t in self.abandoned.items() if t > now}
        self.abandoned[(slot.peer, slot.tag)] = now + self.config.claim_timeout

    async def _claim(self, ch: DataChannel, peer: str, tag: str) -> _Slot | None:
        """The receive this header feeds: at once if it is waiting, else after waiting for it
        (bounded by `claim_timeout`, the pending limits, and the sender hanging up). None if
        there is none to feed; `_Refusal` if the sender may not wait."""
        key = (peer, tag)
        if self.abandoned.get(key, 0) > time.monotonic():
            return None
        slot = self.slots.get(key)
        if slot is not None and slot.claimed and not self._release_interrupted(peer, tag):
            return None
        if slot is None:  # an early sender: it must wait, if there is room
            waiting = self.waiting.get(peer, 0)
            if waiting >= self.config.max_pending_per_peer:
                raise _Refusal(TOO_MANY_PENDING, f"{waiting} of your transfers already wait for their receive here")
            if sum(self.waiting.values()) >= self.config.max_pending:
                raise _Refusal(TOO_MANY_PENDING, "too many transfers already wait for their receive here")
            slot = _Slot(peer, tag)
            self.slots[key] = slot
        slot.claimed = True
        if not slot.registered.is_set():
            hung_up = await self._wait_for_receive(ch, peer, slot)
            if not slot.registered.is_set() and self.slots.get(key) is slot:
                del self.slots[key]
            if hung_up:
                raise StreamClosed("the sender hung up while waiting for its receive")
        if not slot.registered.is_set() or slot.cancelled:
            return None
        return slot

    def _release_interrupted(self, peer: str, tag: str) -> bool:
        """A new transfer (another transfer id) for a receive that an interrupted one still holds
        — its connection dropped, it is kept for `resume_window` — means the sender started over:
        it restarted, or gave up resuming. The new transfer takes the receive; without this a
        restarted peer's payload was refused as unclaimed while its old self's transfer held the
        receive, and the round waited out its deadline (seen in CI). True if one was released."""
        stale = [k for k, part in self.partials.items() if k[0] == peer and part.slot.tag == tag and not part.active]
        for k in stale:
            del self.partials[k]
        return bool(stale)

    async def _wait_for_receive(self, ch: DataChannel, peer: str, slot: _Slot) -> bool:
        """Wait up to `claim_timeout` for `slot` to be registered, counted in `_waiting`.
        Returns whether the sender hung up first: then its place is freed at once, not after
        `claim_timeout` (a sender whose own deadline passed closes its connection)."""
        hung_up = False

        async def watch_sender(done: trio.CancelScope) -> None:
            nonlocal hung_up
            # An honest sender sends nothing until ACCEPT, so this reads only the end — unless it is
            # eager: then its payload is there, and a hang-up is noticed only at the claim.
            try:
                hung_up = await ch.framed.at_eof()
            except Exception:
                hung_up = True
            if hung_up:
                done.cancel()

        self.waiting[peer] = self.waiting.get(peer, 0) + 1
        try:
            with trio.move_on_after(self.config.claim_timeout):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_sender, nursery.cancel_scope)
                    await slot.registered.wait()
                    nursery.cancel_scope.cancel()
        finally:
            self.waiting[peer] -= 1
            if not self.waiting[peer]:
                del self.waiting[peer]
        return hung_up and not slot.registered.is_set()

    async def _expire_partial(self, peer: str, xfer: bytes, part: _Partial) -> None:
        resumed = part.resumed
        with trio.move_on_after(self.config.resume_window):
            await resumed.wait()
            return
        if self.partials.get((peer, xfer)) is part and not part.active:
            del self.partials[(peer, xfer)]
            part.slot.finish(
                error=PeerGone(
                    f"{part.slot.tag!r} from {peer}: sender vanished after {part.done} of {part.total} bytes"
                )
            )


def _segment_of(seg_ends: list[int], offset: int) -> int:
    return bisect.bisect_right(seg_ends, offset)
