"""Serving the swarm's state to late joiners: the donor side of the state sync (node/state/sync.py).

Snapshots. After each outer round the node publishes `(meta, tensors)` (`StateDonor.publish`).
Serving reads only published snapshots, so it never blocks or races training. The donor keeps
the newest `keep` (default 2) per key, so a joiner whose download straddles a round boundary can
finish the older one. Digests (the whole state's and each chunk's, for the chunk size a joiner
asks) are computed once per snapshot and chunk size in a worker thread — never on the trainer's
thread; the default size is hashed as soon as a snapshot is published, so the first joiner does
not wait for it.

Lent, not copied (copy-on-write). A snapshot is either handed over (the caller never touches its
tensors again) or, with `publish(..., live=True)`, *lent*: the owner's live tensors (the node's φ
and outer optimizer state, which change only when a round completes), at no memory cost. Before
the owner changes them it awaits `reclaim()` (the outer optimizer's `before_state_change`, so
the trainer waits for it): a lent snapshot that a joiner asked for within `FETCH_IDLE` seconds is
copied then — its download finishes on the copy, under the same digests — and any other stops
being offered (a joiner's next chunk request gets `unknown_state` and it fetches anew). `reclaim`
returns once no hashing pass and no chunk send reads the owner's memory any more. So a peer
holds no state of its own for joiners between rounds, and one copy only while a download
straddles a round; a copy no joiner asked for within `FETCH_IDLE` is dropped at the next reclaim.

Serving. `state/manifest` describes every snapshot offered under the key asked; `state/chunk`
sends bytes `[i·C, (i+1)·C)` of a snapshot the joiner names by digest, as zero-copy slices over
the data plane, announcing the chunk's digest. A chunk request for a snapshot no longer offered
gets `unknown_state` (the joiner fetches it from another donor).

Who is served: the swarm's members only, by the data plane's own rule (`TensorStreams.admits`,
which the node ties to membership). A stranger asking for chunks it never receives would
otherwise hold a donor's send slots (8, 4 per identity) for the send timeout (found by
`scripts/fuzz_protocols.py`); it gets `not-a-member` instead.

Beside the snapshots, a manifest reply for the default key describes this peer's own inner
optimizer (`inner_moments`, optim/inner_moments.py: a mean second moment per parameter tensor and
the step count), which a joiner seeds its fresh inner optimizer with. It is no part of any
snapshot's identity — every donor's differ — and is left out where it would not fit the reply.

Throttling: `StateDonor(upload_limit=bytes/s)` paces a donor's chunk sends (per chunk, across all
joiners), so a volunteer can cap what it donates, and benchmarks can model residential uplinks.

Not here: the wire's names and limits and the flattened state (node/state/sync.py), downloading
(node/state/fetch.py), when to publish and reclaim (the node, node/state/run_state.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from meshtrain.log import get_logger, kv
from meshtrain.node.state.sync import (
    CHUNK_RPC,
    DEFAULT_CHUNK_BYTES,
    FETCH_ID,
    MANIFEST_RPC,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_KEY_CHARS,
    MAX_MANIFEST_BYTES,
    MAX_META_BYTES,
    MAX_PER_DONOR,
    MAX_REQUEST_BYTES,
    MIN_CHUNK_BYTES,
    STATE_FORMAT,
    FlatState,
    chunk_count,
)
from meshtrain.optim.inner_moments import InnerMoments
from meshtrain.transport.framing import packb
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError
from meshtrain.transport.tensor_layout import contiguous_cpu
from meshtrain.transport.tensor_streams import NOT_A_MEMBER, TensorStreams, TransferError
from meshtrain.transport.validate import is_int

log = get_logger(__name__)

KEEP_SNAPSHOTS = 2
MANIFEST_HANDLER_TIMEOUT = 300.0  # a large state is hashed before the first manifest
DONOR_SEND_TIMEOUT = 120.0
MAX_SENDS_PER_PEER = MAX_PER_DONOR  # a joiner asking for more is misbehaving
MAX_CONCURRENT_SENDS = 8  # per donor, over all joiners
FETCH_IDLE = 30.0  # seconds: a lent snapshot a joiner asked for within this is copied at `reclaim`


class _Readers:
    """The chunk sends reading a snapshot's memory now; `drained()` returns once there are none."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = trio.Event()
        self._idle.set()

    @contextmanager
    def reading(self) -> Iterator[None]:
        if self.count == 0:
            self._idle = trio.Event()
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def drained(self) -> None:
        await self._idle.wait()


@dataclass
class _Snapshot:
    round: int
    step: int
    meta: dict[str, Any]
    flat: FlatState
    source: Any = None  # what the provider returned, to notice a new one
    live: bool = False  # its tensors are the owner's, lent until `reclaim` (module docstring)
    copied: bool = False  # a lent snapshot copied at `reclaim` for a download in progress
    used_at: float = -math.inf  # trio time of the last manifest or chunk request for it
    readers: _Readers = field(default_factory=_Readers)
    lock: trio.Lock = field(default_factory=trio.Lock)
    _digests: dict[int, tuple[bytes, list[bytes]]] = field(default_factory=dict)

    async def digests(self, chunk_bytes: int) -> tuple[bytes, list[bytes]]:
        async with self.lock:  # one hashing pass per chunk size, however many joiners ask
            if chunk_bytes not in self._digests:
                result = await trio.to_thread.run_sync(self.flat.digests, chunk_bytes)
                if len(self._digests) >= 3:
                    self._digests.pop(next(iter(self._digests)))
                self._digests[chunk_bytes] = result
            return self._digests[chunk_bytes]

    def cached(self, chunk_bytes: int) -> tuple[bytes, list[bytes]] | None:
        """The digests for `chunk_bytes` if a manifest for that size was already made."""
        return self._digests.get(chunk_bytes)

    async def manifest(self, chunk_bytes: int) -> dict[str, Any]:
        digest, chunks = await self.digests(chunk_bytes)
        return {
            "round": self.round,
            "step": self.step,
            "total": self.flat.total,
            "chunk_bytes": chunk_bytes,
            "digest": digest,
            "chunks": chunks,
            "layout": [s.to_wire() for s in self.flat.specs],
            "meta": self.meta,
        }


class _Pacer:
    """Paces sends to `rate` bytes/s on average: a send of n bytes reserves the next n/rate
    seconds of the uplink, starts when its slot starts and is not reported done before it ends
    (so a chunk takes max(n/rate, the time it really took))."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0

    async def pace(self, n: int, send: Callable[[], Any]) -> Any:
        now = trio.current_time()
        start = max(now, self._free_at)
        self._free_at = start + n / self.rate
        await trio.sleep_until(start)
        result = await send()
        await trio.sleep_until(start + n / self.rate)
        return result


ProviderFn = Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]] | None]


class StateDonor:
    """Serves this node's published state to late joiners (RPCs `state/manifest`, `state/chunk`).

    host, streams: our libp2p host and data plane; the RPC handlers are registered at once.
    provider: optional `() -> (meta, tensors) | None`, called on the trio thread at each manifest
        request; a result that is not the one seen last time is published. It must return a
        frozen snapshot taken at a round boundary, cheaply. Alternatively (what the node does)
        call `publish` after each outer round.
    upload_limit: bytes/s this donor sends in total (None: unlimited) — a volunteer's cap.
    keep: how many snapshots to keep serving (the newest; 2 lets a download straddle a round).
    send_timeout: how long one chunk send may take before the donor gives up on that joiner.

    Contract: the donor only reads published tensors; the caller must not modify them after
    `publish` (hand over copies), or for a lent snapshot (`publish(..., live=True)`) before
    `await reclaim()` returned. Malformed or hostile requests get `RemoteError` with codes
    `bad_request`, `no_state`, `unknown_state`, `busy`, `send_failed`; nothing a peer sends can
    raise out of a handler. `stats` and `bytes_served_to` count what was sent (and `stats`
    what lent state was copied).
    """

    def __init__(
        self,
        host: Host,
        streams: TensorStreams,
        provider: ProviderFn | None = None,
        *,
        upload_limit: float | None = None,
        keep: int = KEEP_SNAPSHOTS,
        send_timeout: float = DONOR_SEND_TIMEOUT,
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.host = host
        self.streams = streams
        self.provider = provider
        self.keep = keep
        self.send_timeout = send_timeout
        self._snapshots: list[_Snapshot] = []  # key "": newest first; replaced, never mutated in place
        self._keyed: dict[str, list[_Snapshot]] = {}  # other keys, the same way
        self._published = 0
        # Our own inner optimizer's moments (optim/inner_moments.py), set by the node with each
        # publish: described beside the snapshots of the default key, no part of their identity.
        self.inner_moments: InnerMoments | None = None
        self._sending: dict[str, int] = {}
        self._limiter = trio.CapacityLimiter(MAX_CONCURRENT_SENDS)
        self._pacer: _Pacer | None = None
        self.upload_limit = upload_limit
        self.stats = {
            "manifests_served": 0,
            "chunks_served": 0,
            "bytes_served": 0,
            "requests_refused": 0,
            "sends_failed": 0,
            "bytes_copied": 0,  # lent state copied at `reclaim` for a download straddling a round
        }
        self.bytes_served_to: dict[str, int] = {}
        # peer -> the step of the newest of our states it asked for (a manifest: it is fetching
        # the swarm's state) or fetched a chunk of (node/state/parity.py `BesideAlone`: a peer
        # that carries, or is fetching, our state is no lineage beside ours)
        self.states_taken: dict[str, int] = {}
        host.rpc.serve(
            MANIFEST_RPC, self._serve_manifest, max_request=MAX_REQUEST_BYTES, handler_timeout=MANIFEST_HANDLER_TIMEOUT
        )
        host.rpc.serve(CHUNK_RPC, self._serve_chunk, max_request=MAX_REQUEST_BYTES, handler_timeout=send_timeout + 10)

    @property
    def upload_limit(self) -> float | None:
        return self._pacer.rate if self._pacer else None

    @upload_limit.setter
    def upload_limit(self, rate: float | None) -> None:
        if rate is not None and not rate > 0:
            raise ValueError("upload_limit must be a positive number of bytes per second, or None")
        self._pacer = _Pacer(float(rate)) if rate else None

    @property
    def rounds(self) -> list[int]:
        """Rounds currently offered, newest first."""
        return [s.round for s in self._snapshots]

    def publish(
        self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], *, key: str = "", live: bool = False
    ) -> None:
        """Offer a new snapshot. `meta` (msgpack-able, at most 1 MiB packed) may carry `round`
        and `step` (ints; otherwise a publish counter and 0). Tensors are taken as they are
        (no copy when already contiguous CPU) and must not change afterwards — or, with `live`,
        not before the owner awaited `reclaim()` (module docstring, "Lent, not copied"). `key`:
        which of this donor's states it is (node/state/sync.py, Keys)."""
        self._publish(meta, tensors, source=None, key=key, live=live)

    async def reclaim(self) -> None:
        """The owner of the lent snapshots is about to change their tensors (trio thread): copy
        each one a joiner asked for within `FETCH_IDLE` seconds, stop offering the others (and
        copies no joiner asked for since), and return once nothing reads the owner's memory."""
        now = trio.current_time()
        lent: list[tuple[_Snapshot, bool]] = []
        for key in ["", *self._keyed]:
            offered = self._offered(key)
            if not any(s.live or s.copied for s in offered):
                continue
            kept = []
            for snap in offered:
                fetched = now - snap.used_at < FETCH_IDLE
                if snap.live:
                    lent.append((snap, fetched))
                if fetched or not (snap.live or snap.copied):
                    kept.append(snap)
            # At once, before any await: no new request finds what is no longer offered.
            if key:
                self._keyed[key] = kept
            else:
                self._snapshots = kept
        for snap, fetched in lent:
            readers = snap.readers
            async with snap.lock:  # a hashing pass over the owner's memory ends first
                if fetched:
                    copy = await trio.to_thread.run_sync(snap.flat.copy)
                    snap.flat, snap.readers = copy, _Readers()  # sends from now on read the copy
                    self.stats["bytes_copied"] += copy.total
                snap.live, snap.copied = False, fetched
            await readers.drained()  # sends that took slices of the owner's memory
            log.info(kv("lent state reclaimed", round=snap.round, copied=fetched))

    def keyed_rounds(self, key: str) -> list[int]:
        """Rounds offered under `key`, newest first."""
        return [s.round for s in self._offered(key)]

    def withdraw(self, key: str) -> None:
        """Stop offering every snapshot under `key` (a non-empty key: the default state is never
        withdrawn); a download of one of them in progress fails over to its other donors."""
        if key:
            self._keyed.pop(key, None)

    def _offered(self, key: str) -> list[_Snapshot]:
        return self._snapshots if not key else self._keyed.get(key, [])

    def _publish(
        self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], source: Any, key: str = "", live: bool = False
    ) -> None:
        if not isinstance(meta, dict):
            raise TypeError("meta must be a dict")
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise ValueError(f"key must be a string of at most {MAX_KEY_CHARS} characters")
        packed = packb(meta)
        if len(packed) > MAX_META_BYTES:
            raise ValueError(f"meta packs to {len(packed)} bytes; the limit is {MAX_META_BYTES}")
        self._published += 1
        rnd, step = meta.get("round"), meta.get("step", 0)
        rnd = rnd if is_int(rnd) and rnd >= 0 else self._published
        step = step if is_int(step) and step >= 0 else 0
        ordered = contiguous_cpu({k: tensors[k] for k in sorted(tensors)})
        snap = _Snapshot(rnd, step, meta, FlatState(ordered), source, live=live)
        keep = [s for s in self._offered(key) if s.round != rnd][: self.keep - 1]
        if key:
            self._keyed[key] = [snap, *keep]
        else:
            self._snapshots = [snap, *keep]
        log.info(kv("state published", round=rnd, step=step, bytes=snap.flat.total))
        # Hash now, in a worker thread, so the first joiner does not wait for it.
        nursery = self.host.nursery
        if nursery is not None and _in_trio_thread():
            nursery.start_soon(self._prepare, snap)

    async def _prepare(self, snap: _Snapshot) -> None:
        try:
            await snap.digests(DEFAULT_CHUNK_BYTES)
        except Exception as e:  # a background task must never take the host down
            log.warning(kv("hashing a published state failed", round=snap.round, error=repr(e)))

    def _poll_provider(self) -> None:
        if self.provider is None:
            return
        got = self.provider()
        if got is None:
            return
        meta, tensors = got
        if self._snapshots and self._snapshots[0].source is tensors:
            return
        self._publish(meta, tensors, source=tensors)

    async def _require_member(self, peer: str) -> None:
        """State is served to the swarm's members only — the data plane's own rule
        (`TensorStreams.admits`): a stranger must not hold a donor's send slots for the send
        timeout with chunks it never receives."""
        if not await self.streams.admits(peer):
            raise self._refuse(NOT_A_MEMBER, "state is served to members of this swarm only")

    async def _serve_manifest(self, peer: str, request: Any) -> dict[str, Any]:
        await self._require_member(peer)
        if not isinstance(request, dict):
            raise self._refuse("bad_request", "expected a map {chunk_bytes, key?}")
        cb, key = request.get("chunk_bytes"), request.get("key", "")
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise self._refuse("bad_request", f"key must be a string of at most {MAX_KEY_CHARS} characters")
        if not (is_int(cb) and MIN_CHUNK_BYTES <= cb <= MAX_CHUNK_BYTES):
            raise self._refuse(
                "bad_request", f"chunk_bytes must be an integer in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]"
            )
        if not key:
            self._poll_provider()
        snaps = self._offered(key)
        if not snaps:
            raise self._refuse("no_state", f"this peer has not published a state{f' under {key!r}' if key else ''} yet")
        offers = []
        for snap in snaps:
            if chunk_count(snap.flat.total, cb) > MAX_CHUNKS:
                raise self._refuse(
                    "bad_request",
                    f"chunk_bytes {cb} makes more than {MAX_CHUNKS} "
                    f"chunks of a {snap.flat.total}-byte state; use larger chunks",
                )
            snap.used_at = trio.current_time()  # a joiner may fetch it now: keep it across a round
            offers.append(await snap.manifest(cb))
        reply: dict[str, Any] = {"format": STATE_FORMAT, "snapshots": offers}
        if len(packb(reply)) > MAX_MANIFEST_BYTES:
            raise self._refuse("bad_request", "the manifest is too large for one reply; use larger chunks")
        if not key and self.inner_moments is not None:
            described = {**reply, "inner_moments": self.inner_moments.to_wire()}
            if len(packb(described)) <= MAX_MANIFEST_BYTES:  # else the joiner's inner state starts fresh
                reply = described
        self.stats["manifests_served"] += 1
        self._took(peer, max(snap.step for snap in snaps))
        return reply

    async def _serve_chunk(self, peer: str, request: Any) -> dict[str, Any]:
        await self._require_member(peer)
        if not isinstance(request, dict):
            raise self._refuse("bad_request", "expected a map {digest, chunk_bytes, index, fetch}")
        digest, cb, index, fetch = (request.get(k) for k in ("digest", "chunk_bytes", "index", "fetch"))
        if not (
            isinstance(digest, bytes)
            and len(digest) == 32
            and is_int(cb)
            and MIN_CHUNK_BYTES <= cb <= MAX_CHUNK_BYTES
            and is_int(index)
            and isinstance(fetch, str)
            and FETCH_ID.match(fetch)
        ):
            raise self._refuse(
                "bad_request", "chunk request needs digest (32 bytes), chunk_bytes, index (ints) and fetch (hex id)"
            )
        offered = itertools.chain(self._snapshots, *self._keyed.values())
        snap = next((s for s in offered if (s.cached(cb) or (b"",))[0] == digest), None)
        digests = snap.cached(cb) if snap is not None else None
        if snap is None or digests is None:
            raise self._refuse(
                "unknown_state",
                "this peer no longer offers that state (or never did for that chunk size); fetch the manifest again",
            )
        n_chunks = chunk_count(snap.flat.total, cb)
        if not 0 <= index < n_chunks:
            raise self._refuse("bad_request", f"chunk index must be in [0, {n_chunks})")
        if self._sending.get(peer, 0) >= MAX_SENDS_PER_PEER:
            raise self._refuse("busy", f"at most {MAX_SENDS_PER_PEER} chunks in flight per joiner")
        start, end = index * cb, min((index + 1) * cb, snap.flat.total)
        chunk_digest = digests[1][index]
        tag = f"state/{snap.round}/{index}/{fetch}"
        snap.used_at = trio.current_time()

        async def send() -> None:
            # The readers of the memory the slices are taken from (`_send_chunk` takes them
            # before its first await), so that `reclaim` waits for this send.
            with snap.readers.reading():
                await self._send_chunk(peer, tag, snap, start, end, chunk_digest)

        self._sending[peer] = self._sending.get(peer, 0) + 1
        try:
            async with self._limiter:
                if self._pacer is not None:
                    await self._pacer.pace(end - start, send)
                else:
                    await send()
        except TransferError as e:
            self.stats["sends_failed"] += 1
            raise RemoteError("send_failed", str(e)[:200]) from None
        finally:
            self._sending[peer] -= 1
            if not self._sending[peer]:
                del self._sending[peer]
        self.stats["chunks_served"] += 1
        self.stats["bytes_served"] += end - start
        self.bytes_served_to[peer] = self.bytes_served_to.get(peer, 0) + end - start
        self._took(peer, snap.step)
        return {"sent": end - start}

    def _took(self, peer: str, step: int) -> None:
        self.states_taken[peer] = max(self.states_taken.get(peer, -1), step)

    async def _send_chunk(
        self, peer: str, tag: str, snap: _Snapshot, start: int, end: int, chunk_digest: bytes
    ) -> None:
        """Send bytes `[start, end)` of `snap` to `peer` under `tag` (tests override this to
        inject a donor that corrupts what it serves)."""
        await self.streams.send(peer, tag, snap.flat.slices(start, end), digest=chunk_digest, timeout=self.send_timeout)

    def _refuse(self, code: str, text: str) -> RemoteError:
        self.stats["requests_refused"] += 1
        return RemoteError(code, text)


def _in_trio_thread() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


__all__ = ["StateDonor"]
