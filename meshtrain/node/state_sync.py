"""Late joiners: download the swarm's current state from several peers at once, verified.

The problem. A peer joining a running swarm needs φ (the outer parameters) and the outer
optimizer's state — 200 MB for a 25M-parameter model with Nesterov momentum, gigabytes for real
models. hivemind's `load_state_from_peers` picks the one peer that advertises the highest
priority in the DHT (a number the peer reports about itself) and streams everything from it; the
join is as slow as that volunteer's uplink, a failure restarts from zero with the next peer, and
nothing checks what arrives, so one peer announcing a high priority hands every joiner its own
tensors. This module replaces that with one protocol:

1. **Snapshots** (`StateDonor.publish`). After each outer round the node publishes `(meta,
   tensors)`: an immutable snapshot (the caller hands over tensors it will not touch again;
   `OuterOptimizer.state_dict` already returns copies). Serving reads only published snapshots,
   so it never blocks or races training. The donor keeps the newest `keep` (default 2), so a
   joiner whose download straddles a round boundary can finish the older one. Digests are
   computed once per snapshot in a worker thread — never on the trainer's thread.
2. **Flattened state.** The tensors sorted by name, their raw bytes concatenated: the state's
   digest is blake3 over that (= `payload_digest` of the sorted dict). A chunk is a fixed byte
   range `[i·C, min((i+1)·C, total))` of it — it may cut through or span tensors — with its own
   blake3 digest. The joiner chooses C (default 8 MiB); every donor answers for that C.
3. **Manifests and the vote** (RPC `state/manifest`). The joiner asks every donor for its
   offered snapshots: round, step, layout (names, dtypes, shapes), meta (small msgpack values),
   digest, chunk digests. A snapshot's identity is the blake3 of its canonical encoding; the
   joiner takes the newest round whose identical manifest is offered by a majority of the
   donors that answered. A lone liar (or any minority) cannot choose the state — it is simply
   not asked for chunks. With one donor there is nobody to outvote it: that is trust, not proof.
4. **Chunks** (RPC `state/chunk` + the data plane). Each agreeing donor gets `per_donor` workers
   (default 2 outstanding chunks) that pull chunk indices from one shared queue, so a fast donor
   takes more (work stealing). For chunk i the joiner opens `streams.receive(donor,
   "state/<round>/<i>/<attempt>")` and calls `state/chunk`; the donor `send`s zero-copy slices of
   its snapshot. The data plane hashes the payload as it arrives; that digest must equal the
   agreed chunk digest, or the donor is banned for this download and the chunk goes back to the
   queue. A donor that vanishes, errs or times out is banned the same way, and so is one that
   delivers no chunk for `STALL_SECONDS` (or three median chunk times) while another donor
   delivers (SIGSTOPped, a dead link): its chunks in flight are re-queued at once rather than
   after the 60 s chunk timeout. When the queue is empty an idle worker may duplicate a chunk
   that has been in flight far longer than usual (end game: one slow donor cannot hold the
   join hostage); the first verified copy wins. At the end the whole state's digest is checked
   against the agreed one.
   **Fallback.** If every donor of the chosen state is banned before it completes (a donor that
   answered the manifest and then failed every chunk because it was leaving), the download
   starts over on the next state in the vote's order (newest round, then most donors) that a
   donor not yet banned offers — among the states the vote agreed on, so a quorum still vouches
   for whatever is accepted. The vote is not taken again. `FetchReport.round` is the round
   downloaded, `FetchReport.abandoned` the rounds given up on.
5. **Entering** is the node's job: it unflattens `meta["skeleton"]` and calls
   `OuterOptimizer.join(state, at_step=...)`, which enters at the swarm's next round boundary.

Why chunks land in fresh buffers and are then copied, rather than received straight into the
destination: a cancelled or stalled transfer (a loser of the end game, a donor that resumes
after SIGSTOP) may still write one more frame into the buffers it was given. Into a buffer that
nobody reads any more that is harmless; into the destination it would silently corrupt a chunk
that another donor already delivered and we verified. The copy costs one memcpy per byte.

Who is served: the swarm's members only, by the data plane's own rule (`TensorStreams.admits`,
which the node ties to membership). A stranger asking for chunks it never receives would
otherwise hold a donor's send slots (8, 4 per identity) for the send timeout (found by
`scripts/fuzz_protocols.py`); it gets `not-a-member` instead.

Throttling: `StateDonor(upload_limit=bytes/s)` paces a donor's chunk sends (per chunk, across all
joiners), so a volunteer can cap what it donates, and benchmarks can model residential uplinks.

Keys: a donor may serve several states side by side, each under a key (`publish(..., key=)`,
`fetch_state(..., key=)`; the manifest request names it, "" by default). A pipeline peer offers
its stage's state under the stage's key (node/pipeline_peer.py): a joiner that asks the replicas
of stage 2 for `"pipeline/stage2"` is never offered another stage's weights by a peer that has
moved meanwhile — that peer answers `no_state`. Each key keeps its own newest `keep` snapshots;
`withdraw(key)` drops them all (a pipeline peer's backup of a stage it no longer backs).

Not here: choosing donors (the node passes live trainers from membership), unflattening, join.
Limits: a majority of *identities* is not a majority of people (a Sybil with many peer ids can
outvote honest donors; membership admission is the defence); a manifest must fit in one RPC
reply (4 MiB: about 100k tensors or 65k chunks).
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch
import trio

from meshtrain.errors import MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import packb, packb_canonical
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcError
from meshtrain.transport.tensor_layout import (
    LayoutError,
    TensorSpec,
    allocate,
    byte_views,
    contiguous_cpu,
    specs_of,
    total_bytes,
    validate_specs,
)
from meshtrain.transport.tensor_streams import NOT_A_MEMBER, TensorStreams, TransferError
from meshtrain.transport.validate import is_int

log = get_logger(__name__)

STATE_FORMAT = "meshtrain.state/1"
MANIFEST_RPC = "state/manifest"
CHUNK_RPC = "state/chunk"

DEFAULT_CHUNK_BYTES = 8 << 20  # 25 chunks for a 25M-param DiLoCo state: enough to spread
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 64 << 20
MAX_CHUNKS = 1 << 16
MAX_MANIFEST_BYTES = (4 << 20) - 4096  # must fit one RPC frame (framing.DEFAULT_MAX_FRAME)
MAX_META_BYTES = 1 << 20
MAX_REQUEST_BYTES = 4096
MAX_KEY_CHARS = 128
KEEP_SNAPSHOTS = 2
DEFAULT_MAX_STATE_BYTES = 64 << 30

DEFAULT_FETCH_TIMEOUT = 600.0
MANIFEST_TIMEOUT = 60.0  # a donor may have to hash a large state first
MANIFEST_HANDLER_TIMEOUT = 300.0
CHUNK_TIMEOUT = 60.0
DONOR_SEND_TIMEOUT = 120.0
DEFAULT_PER_DONOR = 2
MAX_PER_DONOR = 4
MAX_SENDS_PER_PEER = MAX_PER_DONOR  # a joiner asking for more is misbehaving
MAX_CONCURRENT_SENDS = 8  # per donor, over all joiners
VOTE_GRACE_SECONDS = 2.0  # wait for late manifests once a majority of donors answered
STEAL_FACTOR = 3.0  # end game: duplicate a chunk in flight this many median chunk times
STEAL_MIN_SECONDS = 0.5
# A donor that has had chunks in flight this long without delivering one, while another donor
# delivered in that time, is dropped (stalled: SIGSTOPped, a dead link) and its chunks go to the
# others — before the end game and without waiting for the chunk timeout. The interval grows to
# STEAL_FACTOR median chunk times, so a donor that is merely slow (a paced uplink) is kept.
STALL_SECONDS = 5.0
STALL_CHECK_SECONDS = 0.1
_FETCH_ID = re.compile(r"^[0-9a-f]{1,32}(\.[0-9]{1,9})?$")


class StateSyncError(MeshtrainError):
    """The state could not be downloaded; the message says why and what to try."""


class NoDonors(StateSyncError):
    """Nobody to download from: the list was empty, or no donor answered or offered a state."""


class NoAgreement(StateSyncError):
    """No snapshot is offered identically by a majority of the donors that answered."""


class DonorsExhausted(StateSyncError):
    """Every agreeing donor failed (vanished, lied, timed out) before the download completed."""


class StateCorrupt(StateSyncError):
    """The assembled state does not match the agreed digest."""


# --------------------------------------------------------------------------------------------
# The flattened state: byte ranges over a dict of tensors


def chunk_ranges(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The chunks of a `total`-byte flattened state: `[start, end)` ranges, in order."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    return [(s, min(s + chunk_bytes, total)) for s in range(0, total, chunk_bytes)]


def chunk_count(total: int, chunk_bytes: int) -> int:
    return -(-total // chunk_bytes)


class FlatState:
    """A dict of tensors seen as one byte string: their bytes concatenated in dict order.

    tensors: contiguous CPU tensors, in the order that defines the flattened state (the donor
        sorts by name; the joiner allocates in the agreed layout's order). Not copied: writes
        go into these tensors and `slices` are views of them.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.specs = specs_of(tensors)
        self.views = byte_views(tensors)
        self.sizes = [len(v) for v in self.views]
        self.ends = list(itertools.accumulate(self.sizes))
        self.total = self.ends[-1] if self.ends else 0

    def pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """`(tensor index, byte offset in it, length)` of the non-empty pieces of `[start, end)`."""
        if not 0 <= start <= end <= self.total:
            raise ValueError(f"range [{start}, {end}) outside the state's {self.total} bytes")
        out = []
        i = bisect.bisect_right(self.ends, start)
        pos = start
        while pos < end:
            take = min(end, self.ends[i]) - pos
            if take > 0:
                out.append((i, pos - (self.ends[i] - self.sizes[i]), take))
                pos += take
            i += 1
        return out

    def slices(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """`[start, end)` as uint8 tensors that share memory with the state (for `send`)."""
        return {
            str(k): torch.frombuffer(self.views[i][off : off + n], dtype=torch.uint8)
            for k, (i, off, n) in enumerate(self.pieces(start, end))
        }

    def write(self, start: int, source: Sequence[memoryview]) -> None:
        """Copy the concatenation of `source` into the state at byte `start`."""
        end = start + sum(len(s) for s in source)
        src = iter(s for s in source if len(s))
        cur = next(src, None)
        at = 0
        for i, off, n in self.pieces(start, end):
            dst = self.views[i]
            pos = 0
            while pos < n:
                assert cur is not None  # lengths add up by construction of `end`
                take = min(n - pos, len(cur) - at)
                dst[off + pos : off + pos + take] = cur[at : at + take]
                pos += take
                at += take
                if at == len(cur):
                    cur, at = next(src, None), 0

    def digest(self) -> bytes:
        h = blake3.blake3()
        for v in self.views:
            h.update(v)
        return h.digest()

    def digests(self, chunk_bytes: int) -> tuple[bytes, list[bytes]]:
        """(digest of the whole state, digest of each chunk) in one read of the memory."""
        whole = blake3.blake3()
        chunks = []
        for start, end in chunk_ranges(self.total, chunk_bytes):
            h = blake3.blake3()
            for i, off, n in self.pieces(start, end):
                piece = self.views[i][off : off + n]
                h.update(piece)
                whole.update(piece)
            chunks.append(h.digest())
        return whole.digest(), chunks


# --------------------------------------------------------------------------------------------
# Donor side


@dataclass
class _Snapshot:
    round: int
    step: int
    meta: dict[str, Any]
    flat: FlatState
    source: Any = None  # what the provider returned, to notice a new one
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
    `publish` (hand over copies). Malformed or hostile requests get `RemoteError` with codes
    `bad_request`, `no_state`, `unknown_state`, `busy`, `send_failed`; nothing a peer sends can
    raise out of a handler. `stats` and `bytes_served_to` count what was sent.
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
        }
        self.bytes_served_to: dict[str, int] = {}
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

    def publish(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], *, key: str = "") -> None:
        """Offer a new snapshot. `meta` (msgpack-able, at most 1 MiB packed) may carry `round`
        and `step` (ints; otherwise a publish counter and 0). Tensors are taken as they are
        (no copy when already contiguous CPU) and must not change afterwards. `key`: which of
        this donor's states it is (module docstring, Keys)."""
        self._publish(meta, tensors, source=None, key=key)

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

    def _publish(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], source: Any, key: str = "") -> None:
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
        snap = _Snapshot(rnd, step, meta, FlatState(ordered), source)
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
            offers.append(await snap.manifest(cb))
        reply = {"format": STATE_FORMAT, "snapshots": offers}
        if len(packb(reply)) > MAX_MANIFEST_BYTES:
            raise self._refuse("bad_request", "the manifest is too large for one reply; use larger chunks")
        self.stats["manifests_served"] += 1
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
            and _FETCH_ID.match(fetch)
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
        self._sending[peer] = self._sending.get(peer, 0) + 1
        try:
            async with self._limiter:
                if self._pacer is not None:
                    await self._pacer.pace(
                        end - start, lambda: self._send_chunk(peer, tag, snap, start, end, chunk_digest)
                    )
                else:
                    await self._send_chunk(peer, tag, snap, start, end, chunk_digest)
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
        return {"sent": end - start}

    async def _send_chunk(
        self, peer: str, tag: str, snap: _Snapshot, start: int, end: int, chunk_digest: bytes
    ) -> None:
        """Send bytes `[start, end)` of `snap` to `peer` under `tag` (tests override this to
        inject a donor that corrupts what it serves)."""
        await self.streams.send(peer, tag, snap.flat.slices(start, end), digest=chunk_digest, timeout=self.send_timeout)

    def _refuse(self, code: str, text: str) -> RemoteError:
        self.stats["requests_refused"] += 1
        return RemoteError(code, text)


# --------------------------------------------------------------------------------------------
# Joiner side


@dataclass(frozen=True)
class Offer:
    """One snapshot as a donor described it (validated)."""

    round: int
    step: int
    total: int
    chunk_bytes: int
    digest: bytes
    chunks: tuple[bytes, ...]
    specs: tuple[TensorSpec, ...]
    meta: dict[str, Any]
    key: bytes  # blake3 of the canonical encoding: equal keys = identical manifests


@dataclass
class FetchReport:
    """What a download did (filled in by `fetch_state` as it goes, so it can be watched)."""

    round: int = -1  # the round downloaded (or being downloaded)
    step: int = 0
    digest: bytes = b""
    total_bytes: int = 0
    chunks: int = 0
    seconds: float = 0.0
    answered: list[str] = field(default_factory=list)
    agreeing: list[str] = field(default_factory=list)
    bytes_per_donor: dict[str, int] = field(default_factory=dict)  # verified bytes only
    chunks_per_donor: dict[str, int] = field(default_factory=dict)
    banned: dict[str, str] = field(default_factory=dict)  # donor -> why
    requeued: int = 0  # chunks fetched again after a donor failed, stalled or lied
    duplicated: int = 0  # end-game copies started
    # Rounds given up on, newest first, because all their donors failed: `round` is then an older
    # agreed state (module docstring, 4).
    abandoned: list[int] = field(default_factory=list)


Progress = Callable[[int, int], Any]


async def fetch_state(
    host: Host,
    streams: TensorStreams,
    donors: Iterable[str],
    *,
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
    per_donor: int = DEFAULT_PER_DONOR,
    chunk_timeout: float = CHUNK_TIMEOUT,
    stall_timeout: float = STALL_SECONDS,
    manifest_timeout: float = MANIFEST_TIMEOUT,
    min_agree: int | None = None,
    max_bytes: int = DEFAULT_MAX_STATE_BYTES,
    report: FetchReport | None = None,
    key: str = "",
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Download the swarm's newest majority-agreed state from `donors` in parallel; returns
    `(meta, tensors)` exactly as published (tensors in name order), verified by digest. If every
    donor of that state fails mid-download, the next newest agreed state that donors not yet
    dropped offer is downloaded instead (`report.round` says which; `report.abandoned` the
    rounds given up on).

    chunk_bytes: size of the byte ranges fetched and verified one by one.
    progress: `progress(done_bytes, total_bytes)` after each verified chunk (for the CLI; after a
        fallback it starts again from 0 with the older state's total).
    per_donor: chunks in flight per donor (1–4).
    chunk_timeout: how long one chunk may take from one donor.
    stall_timeout: a donor that delivers no chunk for this long (or STEAL_FACTOR median chunk
        times, if longer) while another donor delivers is dropped and its chunks re-queued.
    min_agree: donors that must offer the identical manifest (default: a majority of those
        that answered).
    report: a `FetchReport` to fill in (bytes per donor, banned donors, ...).
    key: which of the donors' states (module docstring, Keys; "" the default one).
    Raises a `StateSyncError` subclass: `NoDonors`, `NoAgreement`, `DonorsExhausted`,
    `StateCorrupt`, or a plain `StateSyncError` when `timeout` runs out.
    """
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    if not 1 <= per_donor <= MAX_PER_DONOR:
        raise ValueError(f"per_donor must be in [1, {MAX_PER_DONOR}]")
    if min_agree is not None and min_agree < 1:
        raise ValueError("min_agree must be at least 1")
    fetch = _Fetch(
        host,
        streams,
        [d for d in dict.fromkeys(donors) if d != host.peer_id],
        chunk_bytes=chunk_bytes,
        progress=progress,
        per_donor=per_donor,
        chunk_timeout=chunk_timeout,
        stall_timeout=stall_timeout,
        manifest_timeout=manifest_timeout,
        min_agree=min_agree,
        max_bytes=max_bytes,
        report=report or FetchReport(),
        key=key,
    )
    t0 = time.monotonic()
    try:
        with trio.fail_after(timeout):
            return await fetch.run()
    except trio.TooSlowError:
        r = fetch.report
        raise StateSyncError(
            f"state download did not finish within {timeout:g} s "
            f"({fetch.done_bytes} of {r.total_bytes} bytes from {len(r.agreeing)} "
            f"donors); the donors may be too slow — try again or raise the timeout"
        ) from None
    finally:
        fetch.report.seconds = time.monotonic() - t0


@dataclass(eq=False)
class _Chunk:
    index: int
    start: int
    end: int
    digest: bytes
    done: bool = False
    fetchers: dict[str, tuple[trio.CancelScope, float]] = field(default_factory=dict)


class _ChunkFailed(Exception):
    """Internal: one donor's attempt at one chunk failed; `str` says why."""


class _Fetch:
    """One download: the vote, then the workers. Lives for one `fetch_state` call."""

    def __init__(
        self,
        host: Host,
        streams: TensorStreams,
        donors: list[str],
        *,
        chunk_bytes: int,
        progress: Progress | None,
        per_donor: int,
        chunk_timeout: float,
        stall_timeout: float,
        manifest_timeout: float,
        min_agree: int | None,
        max_bytes: int,
        report: FetchReport,
        key: str = "",
    ) -> None:
        self.host, self.streams, self.donors = host, streams, donors
        self.key = key
        self.chunk_bytes, self.progress, self.per_donor = chunk_bytes, progress, per_donor
        self.chunk_timeout, self.manifest_timeout = chunk_timeout, manifest_timeout
        self.stall_timeout = stall_timeout
        self.min_agree, self.max_bytes, self.report = min_agree, max_bytes, report
        self.fetch_id = os.urandom(8).hex()
        self.attempts = itertools.count()
        self.pending: deque[_Chunk] = deque()
        self.chunks: list[_Chunk] = []
        self.done_bytes = 0
        self.remaining = 0
        self.durations: list[float] = []
        self.in_flight: set[_Chunk] = set()  # chunks with at least one attempt running
        self.delivered_at: dict[str, float] = {}  # donor -> when it last delivered a verified chunk
        self.started = 0.0  # when the current offer's download began
        self._changed = trio.Event()
        self.offer: Offer | None = None
        self.flat: FlatState | None = None

    async def run(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if not self.donors:
            raise NoDonors(
                "no donors to download the state from (pass the peer ids of live swarm members other than ourselves)"
            )
        ranked = await self._vote()
        r = self.report
        failed: Offer | None = None
        # The newest agreed state first; if all its donors fail, the next one that donors not
        # yet dropped offer (module docstring, 4: fallback).
        for offer, backers in ranked:
            donors = [d for d in backers if d not in r.banned]
            if not donors:  # every donor of this state already failed on a newer one
                continue
            if failed is not None:
                r.abandoned.append(failed.round)
                log.warning(kv("state download falls back to an older state", failed=failed.round, round=offer.round))
            if await self._download(offer, donors):
                assert self.flat is not None  # set by `_download`
                return offer.meta, self.flat.tensors
            failed = offer
        reasons = "; ".join(f"{d[-8:]}: {why}" for d, why in r.banned.items())
        tried = ", ".join(str(n) for n in [*r.abandoned, r.round])
        raise DonorsExhausted(
            f"every donor failed before a download completed (rounds tried: {tried}; the last "
            f"got {len(self.chunks) - self.remaining} of {len(self.chunks)} chunks): {reasons}"
        )

    async def _download(self, offer: Offer, donors: list[str]) -> bool:
        """Fetch every chunk of `offer` from `donors`; False if they all failed first."""
        r = self.report
        r.round, r.step, r.digest, r.total_bytes, r.agreeing = (
            offer.round,
            offer.step,
            offer.digest,
            offer.total,
            list(donors),
        )
        self.offer = offer
        self.flat = FlatState(allocate(list(offer.specs)))
        self.chunks = [
            _Chunk(i, s, e, offer.chunks[i]) for i, (s, e) in enumerate(chunk_ranges(offer.total, offer.chunk_bytes))
        ]
        r.chunks = len(self.chunks)
        self.pending = deque(self.chunks)
        self.remaining = len(self.chunks)
        self.done_bytes = 0
        self.started = trio.current_time()
        log.info(
            kv(
                "state download started",
                round=offer.round,
                bytes=offer.total,
                chunks=len(self.chunks),
                donors=len(donors),
            )
        )
        if self.chunks:
            async with trio.open_nursery() as watch:
                watch.start_soon(self._watch_stalls, donors)
                async with trio.open_nursery() as workers:
                    for donor in donors:
                        for _ in range(self.per_donor):
                            workers.start_soon(self._worker, donor)
                watch.cancel_scope.cancel()
        if self.remaining:
            return False
        digest = await trio.to_thread.run_sync(self.flat.digest)
        if digest != offer.digest:
            raise StateCorrupt(
                f"the assembled state of round {offer.round} does not match the "
                f"agreed digest (every chunk verified, so the agreed manifest itself is "
                f"inconsistent); try again with other donors"
            )
        log.info(kv("state downloaded", round=offer.round, bytes=offer.total, donors=len(donors), banned=len(r.banned)))
        return True

    # -- the vote ------------------------------------------------------------------------------

    async def _vote(self) -> list[tuple[Offer, list[str]]]:
        """Ask every donor for its manifest; the states a quorum of them offers identically, each
        with its donors, best first (newest round, then most donors)."""
        offers: dict[str, list[Offer]] = {}
        failures: dict[str, str] = {}

        finished: list[str] = []

        async def ask(donor: str) -> None:
            try:
                await ask_one(donor)
            finally:
                finished.append(donor)

        async def ask_one(donor: str) -> None:
            try:
                reply = await self.host.rpc.call(
                    donor,
                    MANIFEST_RPC,
                    {"chunk_bytes": self.chunk_bytes, **({"key": self.key} if self.key else {})},
                    timeout=self.manifest_timeout,
                    max_response=MAX_MANIFEST_BYTES + 4096,
                )
            except RemoteError as e:
                failures[donor] = str(e)
                if e.code != "no_state":  # it answered, refusing: counts against a majority
                    offers[donor] = []
                return
            except RpcError as e:
                failures[donor] = f"{type(e).__name__}: {e}"
                return
            try:
                offers[donor] = _parse_manifest(reply, self.chunk_bytes, self.max_bytes)
            except StateSyncError as e:  # a malformed answer is an answer: it can only hurt a liar
                failures[donor] = f"malformed manifest: {e}"
                offers[donor] = []

        # Wait for every donor, but once a majority of them answered, give the rest only a grace
        # period: one stalled donor must not hold the join for the whole manifest timeout.
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for d in self.donors:
                nursery.start_soon(ask, d)
            while nursery.child_tasks:
                if len(finished) > len(self.donors) // 2 and any(offers.values()):
                    grace = max(VOTE_GRACE_SECONDS, 3 * (trio.current_time() - t0))
                    with trio.move_on_after(grace):
                        while nursery.child_tasks:
                            await trio.sleep(0.02)
                    nursery.cancel_scope.cancel()
                    break
                await trio.sleep(0.02)
        self.report.answered = sorted(offers)
        if not any(offers.values()):
            why = "; ".join(f"{d[-8:]}: {w}" for d, w in failures.items())
            raise NoDonors(f"none of the {len(self.donors)} donors offered a state ({why})")
        quorum = self.min_agree or len(offers) // 2 + 1
        backers: dict[bytes, list[str]] = {}
        by_key: dict[bytes, Offer] = {}
        for donor, offered in offers.items():
            for o in offered:
                if donor not in backers.setdefault(o.key, []):
                    backers[o.key].append(donor)
                by_key[o.key] = o
        agreed = [k for k, ds in backers.items() if len(ds) >= quorum]
        for d, why in failures.items():
            log.info(kv("donor gave no usable manifest", donor=d, reason=why[:200]))
        if not agreed:
            seen = "; ".join(
                f"round {by_key[k].round} digest {by_key[k].digest.hex()[:12]} by {len(ds)}"
                for k, ds in sorted(backers.items(), key=lambda kv_: -len(kv_[1]))
            )
            raise NoAgreement(
                f"no state is offered identically by {quorum} of the {len(offers)} donors "
                f"that answered ({seen}); donors disagree — some may be lying, or a round "
                f"just ended: try again"
            )
        # The vote is taken once: a fallback (`run`) walks down this list, so every state it may
        # accept was offered identically by `quorum` donors, like the first.
        ranked = sorted(agreed, key=lambda k: (by_key[k].round, len(backers[k])), reverse=True)
        outvoted = [d for d in offers if not any(d in backers[k] for k in ranked)]
        if outvoted:
            log.info(kv("donors not used (offered no agreed state)", donors=",".join(outvoted)))
        return [(by_key[k], backers[k]) for k in ranked]

    # -- the workers ---------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _watch_stalls(self, donors: list[str]) -> None:
        """Drop a donor that delivers nothing for the stall interval (STALL_SECONDS) while another
        delivers: its attempts are cancelled, so their chunks go back to the queue at once."""
        while True:
            await trio.sleep(STALL_CHECK_SECONDS)
            now = trio.current_time()
            interval = self.stall_timeout
            if self.durations:
                interval = max(interval, STEAL_FACTOR * statistics.median(self.durations))
            live = [d for d in donors if d not in self.report.banned]
            delivering = {d for d in live if d in self.delivered_at and now - self.delivered_at[d] < interval}
            attempts: dict[str, list[tuple[trio.CancelScope, float]]] = {}
            for chunk in self.in_flight:
                for donor, attempt in chunk.fetchers.items():
                    attempts.setdefault(donor, []).append(attempt)
            for donor in live:
                if donor not in attempts or not delivering - {donor}:
                    continue
                since = max(self.delivered_at.get(donor, self.started), min(t for _, t in attempts[donor]))
                if now - since < interval:
                    continue
                self._ban(donor, f"stalled: no chunk delivered for {now - since:.1f} s while others delivered")
                for scope, _ in attempts[donor]:
                    scope.cancel()

    def _next_job(self, donor: str) -> _Chunk | None:
        while self.pending:
            chunk = self.pending.popleft()
            if not chunk.done:
                return chunk
        if not self.durations:
            return None
        # End game: the queue is empty; copy a chunk that has been in flight unusually long.
        limit = max(STEAL_MIN_SECONDS, STEAL_FACTOR * statistics.median(self.durations))
        now = trio.current_time()
        stale = [
            c
            for c in self.chunks
            if not c.done
            and c.fetchers
            and len(c.fetchers) < 2
            and donor not in c.fetchers
            and now - min(t for _, t in c.fetchers.values()) > limit
        ]
        if stale:
            self.report.duplicated += 1
            return stale[0]
        return None

    async def _worker(self, donor: str) -> None:
        while donor not in self.report.banned and self.remaining:
            chunk = self._next_job(donor)
            if chunk is None:
                changed = self._changed
                with trio.move_on_after(STEAL_MIN_SECONDS / 2):  # re-check for stale chunks
                    await changed.wait()
                continue
            await self._fetch_chunk(donor, chunk)

    async def _fetch_chunk(self, donor: str, chunk: _Chunk) -> None:
        scope = trio.CancelScope()
        started = trio.current_time()
        chunk.fetchers[donor] = (scope, started)
        self.in_flight.add(chunk)
        got = None
        failure = None
        try:
            with scope:
                got = await self._transfer(donor, chunk)
        except _ChunkFailed as e:
            failure = str(e)
        finally:
            del chunk.fetchers[donor]
            if not chunk.fetchers:
                self.in_flight.discard(chunk)
        if chunk.done:  # another donor delivered it first (our copy was cancelled or is surplus)
            return
        if got is not None:
            if got.nbytes != chunk.end - chunk.start:
                failure = f"chunk {chunk.index} has {got.nbytes} bytes, expected {chunk.end - chunk.start}"
            elif got.digest != chunk.digest:
                failure = f"chunk {chunk.index} does not match the agreed digest (tampered)"
        if failure is not None or got is None:
            self._ban(donor, failure or "cancelled")
            if not chunk.fetchers:
                self.pending.appendleft(chunk)
                self.report.requeued += 1
            self._notify()
            return
        assert self.flat is not None  # set before the workers start
        self.flat.write(chunk.start, byte_views(got.tensors))
        chunk.done = True
        self.remaining -= 1
        for other_scope, _ in chunk.fetchers.values():  # end-game copies still running
            other_scope.cancel()
        n = chunk.end - chunk.start
        self.delivered_at[donor] = trio.current_time()
        self.durations.append(self.delivered_at[donor] - started)
        self.done_bytes += n
        r = self.report
        r.bytes_per_donor[donor] = r.bytes_per_donor.get(donor, 0) + n
        r.chunks_per_donor[donor] = r.chunks_per_donor.get(donor, 0) + 1
        if self.progress is not None:
            self.progress(self.done_bytes, r.total_bytes)
        self._notify()

    async def _transfer(self, donor: str, chunk: _Chunk) -> Any:
        """Ask `donor` for `chunk` and receive it; raises `_ChunkFailed` with the reason."""
        assert self.offer is not None
        tag_id = f"{self.fetch_id}.{next(self.attempts)}"
        tag = f"state/{self.offer.round}/{chunk.index}/{tag_id}"
        request = {
            "digest": self.offer.digest,
            "chunk_bytes": self.offer.chunk_bytes,
            "index": chunk.index,
            "fetch": tag_id,
        }
        result: dict[str, Any] = {}
        with trio.move_on_after(self.chunk_timeout) as deadline:
            async with trio.open_nursery() as nursery:

                async def receive() -> None:
                    try:
                        result["got"] = await self.streams.receive(donor, tag, max_bytes=chunk.end - chunk.start)
                    except TransferError as e:
                        result.setdefault("error", f"{type(e).__name__}: {e}")
                        nursery.cancel_scope.cancel()

                nursery.start_soon(receive)
                try:
                    await self.host.rpc.call(donor, CHUNK_RPC, request, timeout=self.chunk_timeout)
                except RpcError as e:
                    result.setdefault("error", f"{type(e).__name__}: {e}")
                    nursery.cancel_scope.cancel()
        if deadline.cancelled_caught:
            raise _ChunkFailed(f"chunk {chunk.index} took longer than {self.chunk_timeout:g} s")
        if "error" in result:
            raise _ChunkFailed(str(result["error"])[:300])
        return result["got"]

    def _ban(self, donor: str, why: str) -> None:
        if donor not in self.report.banned:
            self.report.banned[donor] = why
            log.warning(kv("state donor dropped", donor=donor, reason=why[:200]))


def _parse_manifest(reply: Any, chunk_bytes: int, max_bytes: int) -> list[Offer]:
    """Validate a `state/manifest` reply from the network; `StateSyncError` on any defect."""
    if not (
        isinstance(reply, dict)
        and reply.get("format") == STATE_FORMAT
        and isinstance(reply.get("snapshots"), list)
        and 1 <= len(reply["snapshots"]) <= 8
    ):
        raise StateSyncError(f"not a {STATE_FORMAT} manifest")
    offers = []
    for raw in reply["snapshots"]:
        if not isinstance(raw, dict):
            raise StateSyncError("snapshot entry is not a map")
        rnd, step, total, cb = raw.get("round"), raw.get("step"), raw.get("total"), raw.get("chunk_bytes")
        digest, chunks, meta = raw.get("digest"), raw.get("chunks"), raw.get("meta")
        if not all(is_int(v) and v >= 0 for v in (rnd, step, total)):
            raise StateSyncError("round, step and total must be non-negative integers")
        if cb != chunk_bytes:
            raise StateSyncError(f"chunk_bytes {cb!r:.20} is not the {chunk_bytes} asked for")
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise StateSyncError("digest must be 32 bytes")
        if not isinstance(meta, dict):
            raise StateSyncError("meta must be a map")
        try:
            specs = validate_specs(raw.get("layout"), max_bytes=max_bytes)
        except LayoutError as e:
            raise StateSyncError(f"bad layout: {e}") from None
        if total_bytes(specs) != total:
            raise StateSyncError(f"layout has {total_bytes(specs)} bytes, manifest says {total}")
        if not (
            isinstance(chunks, list)
            and len(chunks) == chunk_count(total, chunk_bytes)
            and all(isinstance(c, bytes) and len(c) == 32 for c in chunks)
        ):
            raise StateSyncError(f"expected {chunk_count(total, chunk_bytes)} chunk digests of 32 bytes")
        key = blake3.blake3(packb_canonical(raw)).digest()
        offers.append(Offer(rnd, step, total, cb, digest, tuple(chunks), tuple(specs), meta, key))
    return offers


def _in_trio_thread() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


__all__ = [
    "CHUNK_RPC",
    "DEFAULT_CHUNK_BYTES",
    "MANIFEST_RPC",
    "DonorsExhausted",
    "FetchReport",
    "FlatState",
    "NoAgreement",
    "NoDonors",
    "Offer",
    "StateCorrupt",
    "StateDonor",
    "StateSyncError",
    "chunk_count",
    "chunk_ranges",
    "fetch_state",
]
