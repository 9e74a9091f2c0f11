"""Joining: download the swarm's state from several donors at once — the joiner's side of the
state sync (node/state/sync.py).

The vote. `fetch_state` asks every donor for its manifest (waiting for stragglers only a grace
period once half of them answered, one offering a state: of two donors, one SIGSTOPped held a
soak's joiner for the whole 60 s manifest timeout — and its answer could only have tied) and
ranks the states a quorum of them offers identically (default: a majority of those that
answered): newest round first, then most donors. "Identically" is the whole manifest, step
included: peers that hold one state offer it as of the step it dates from, its last merge
(node/state/run_state.py `donor_snapshot`) — offered at each donor's own step, one state was two
to the vote, and a 30-minute soak's joiners failed 39 votes so. The caller may decline a state
from its manifest (`accept`): a joiner asks whether it could enter with it before a byte moves —
a multi-GB state a round old used to be downloaded whole, refused, and downloaded again on every
retry until the swarm published a newer one.

Chunks. Each agreeing donor gets `per_donor` workers (default 2 outstanding chunks) that pull
chunk indices from one shared queue, so a fast donor takes more (work stealing). For chunk i the
joiner opens `streams.receive(donor, "state/<round>/<i>/<attempt>")` and calls `state/chunk`; the
donor sends slices of its snapshot. The data plane hashes the payload as it arrives; that digest
must equal the agreed chunk digest, or the donor is banned for this download and the chunk goes
back to the queue. A donor that vanishes, errs or times out is banned the same way, and so is one
that delivers no chunk for `STALL_SECONDS` (or three median chunk times) while another donor
delivers (SIGSTOPped, a dead link, or merely far slower than the others): its chunks in flight
are re-queued at once rather than after the 60 s chunk timeout (never while no other donor
delivers: then the chunk timeout decides). When the queue is empty an idle worker may duplicate a chunk that has been
in flight far longer than usual (end game: one slow donor cannot hold the join hostage); the
first verified copy wins. At the end the whole state's digest is checked against the agreed one.

Silence. Given `quiet` (whether a donor's heartbeats stopped reaching us: the node's presence), a
donor whose heartbeats stopped and that leaves a probe unanswered (collective/probe.py, the
collective's own rule) is dropped at once — in the vote, and mid-download whether or not another
donor delivers, where the stall rule waits for a second donor and the timeouts are 60 s. A
30-minute soak's joiner sat 24 s in a download whose one donor was SIGSTOPped or cut off by a
partition (its kernel accepts connections its process never answers), until it was killed; its
round's coordinator waited for it meanwhile. With every donor dropped the download fails
(`DonorsExhausted`, `NoDonors`) and the node asks again from the members live now. The converse
in the vote — a donor whose heartbeats arrive but that leaves its manifest and a probe unanswered
— is behind a stalled connection (collective/probe.py, "Stalled connections": a 10-minute soak's
re-sync waited 25 s so after a partition healed): the connection is closed and the donor asked
again over a fresh one, once. Mid-download a stalled donor is left to the stall rule and the
chunk timeout, as before (its chunks come over the data plane's own connection anyway).

Fallback. If every donor of the chosen state is banned before it completes (a donor that answered
the manifest and then failed every chunk because it was leaving; or all of them, when the chunks
all verify but the whole state's digest does not: they agreed on an inconsistent manifest — a
collusion, or a bug), the download starts over on the
next state in the vote's order that a donor not yet banned offers — among the states the vote
agreed on, so a quorum still vouches for whatever is accepted. The vote is not taken again.
`FetchReport.round` is the round downloaded, `FetchReport.abandoned` the rounds given up on.

Why chunks land in fresh buffers and are then copied, rather than received straight into the
destination: a cancelled or stalled transfer (a loser of the end game, a donor that resumes
after SIGSTOP) may still write one more frame into the buffers it was given. Into a buffer that
nobody reads any more that is harmless; into the destination it would silently corrupt a chunk
that another donor already delivered and we verified. The copy costs one memcpy per byte.

Beside the vote. A donor's manifest reply may describe its own inner optimizer's moments
(optim/inner_moments.py); they are no part of any state's identity (every donor's differ). The
report carries their median over the donors of the state downloaded (`FetchReport.inner_moments`),
for the joiner's fresh inner optimizer.

Not here: the wire and the manifest's validation (node/state/sync.py), serving
(node/state/donor.py), choosing donors and entering the state (the node).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from meshtrain.collective.probe import wait_silent, wait_stalled
from meshtrain.collective.protocol import PROBE_EVERY
from meshtrain.log import get_logger, kv
from meshtrain.node.state.sync import (
    CHUNK_RPC,
    DEFAULT_CHUNK_BYTES,
    MANIFEST_RPC,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PER_DONOR,
    MIN_CHUNK_BYTES,
    DonorsExhausted,
    FlatState,
    NoAgreement,
    NoDonors,
    Offer,
    OfferDeclined,
    StateSyncError,
    chunk_ranges,
    parse_manifest,
)
from meshtrain.optim.inner_moments import InnerMoments
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcError
from meshtrain.transport.tensor_layout import allocate, byte_views
from meshtrain.transport.tensor_streams import TensorStreams, TransferError

log = get_logger(__name__)

DEFAULT_MAX_STATE_BYTES = 64 << 30
DEFAULT_FETCH_TIMEOUT = 600.0
MANIFEST_TIMEOUT = 60.0  # a donor may have to hash a large state first
CHUNK_TIMEOUT = 60.0
DEFAULT_PER_DONOR = 2
VOTE_GRACE_SECONDS = 2.0  # wait for late manifests once a majority of donors answered
STEAL_FACTOR = 3.0  # end game: duplicate a chunk in flight this many median chunk times
STEAL_MIN_SECONDS = 0.5
# A donor that has had chunks in flight this long without delivering one, while another donor
# delivered in that time, is dropped (stalled: SIGSTOPped, a dead link) and its chunks go to the
# others — before the end game and without waiting for the chunk timeout. The interval grows to
# STEAL_FACTOR median chunk times, so a donor about as fast as the typical one (a paced uplink)
# is kept; one far slower than the others is dropped too, its chunks arriving sooner elsewhere.
STALL_SECONDS = 5.0
STALL_CHECK_SECONDS = 0.1


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
    # agreed state (module docstring, Fallback).
    abandoned: list[int] = field(default_factory=list)
    # The agreeing donors' inner optimizer moments, their median (optim/inner_moments.py): what
    # the joiner seeds a fresh inner optimizer with; None where no donor described its own.
    inner_moments: InnerMoments | None = None


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
    accept: Callable[[Offer], str | None] | None = None,
    quiet: Callable[[str], bool] | None = None,
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
    key: which of the donors' states (node/state/sync.py, Keys; "" the default one).
    accept: `accept(offer)` → None to download an agreed state, or why not (from its manifest:
        round, step, size), before any of its bytes move; declined, the next older agreed state
        is asked, and `OfferDeclined` raised when none is taken.
    quiet: `quiet(donor)` → whether its heartbeats stopped reaching us (the node's presence);
        with it, a donor that also leaves a probe unanswered is silent and dropped at once, in
        the vote or mid-download, whether or not another delivers (module docstring, Silence).
    Raises a `StateSyncError` subclass: `NoDonors`, `NoAgreement`, `OfferDeclined`,
    `DonorsExhausted`, or a plain `StateSyncError` when `timeout` runs out.
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
        accept=accept,
        quiet=quiet,
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
        accept: Callable[[Offer], str | None] | None = None,
        quiet: Callable[[str], bool] | None = None,
    ) -> None:
        self.host, self.streams, self.donors = host, streams, donors
        self.key, self.accept, self.quiet = key, accept, quiet
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
        self._moments: dict[str, InnerMoments] = {}  # donor -> the moments its manifest described

    async def run(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if not self.donors:
            raise NoDonors(
                "no donors to download the state from (pass the peer ids of live swarm members other than ourselves)"
            )
        ranked = await self._vote()
        r = self.report
        failed: Offer | None = None
        declined: list[str] = []
        # The newest agreed state first; if all its donors fail, the next one that donors not
        # yet dropped offer (module docstring, Fallback).
        for offer, backers in ranked:
            donors = [d for d in backers if d not in r.banned]
            if not donors:  # every donor of this state already failed on a newer one
                continue
            if self.accept is not None and (why := self.accept(offer)) is not None:
                declined.append(why)
                continue
            if failed is not None:
                r.abandoned.append(failed.round)
                log.warning(kv("state download falls back to an older state", failed=failed.round, round=offer.round))
            if await self._download(offer, donors):
                assert self.flat is not None  # set by `_download`
                return offer.meta, self.flat.tensors
            failed = offer
        if declined and failed is None:
            raise OfferDeclined(declined[0])
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
        r.inner_moments = InnerMoments.median([self._moments[d] for d in donors if d in self._moments])
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
                if self.quiet is not None:
                    watch.start_soon(self._watch_silence, lambda: donors, self._cancel_attempts)
                async with trio.open_nursery() as workers:
                    for donor in donors:
                        for _ in range(self.per_donor):
                            workers.start_soon(self._worker, donor)
                watch.cancel_scope.cancel()
        if self.remaining:
            return False
        digest = await trio.to_thread.run_sync(self.flat.digest)
        if digest != offer.digest:
            # Every chunk matched its agreed digest, so the manifest itself is inconsistent: its
            # donors vouched for it together. All of them go; the next agreed state is tried.
            for donor in donors:
                self._ban(
                    donor,
                    f"vouched for round {offer.round}'s manifest, whose whole-state digest does not match its verified chunks",
                )
            return False
        log.info(kv("state downloaded", round=offer.round, bytes=offer.total, donors=len(donors), banned=len(r.banned)))
        return True

    # -- the vote ------------------------------------------------------------------------------

    async def _vote(self) -> list[tuple[Offer, list[str]]]:
        """Ask every donor for its manifest; the states a quorum of them offers identically, each
        with its donors, best first (newest round, then most donors)."""
        offers: dict[str, list[Offer]] = {}
        failures: dict[str, str] = {}

        finished: list[str] = []
        asking = {d: trio.CancelScope() for d in self.donors}  # cancelled when a donor is silent ...
        redialled: set[str] = set()  # ... or behind a stalled connection: asked again, once

        async def ask(donor: str) -> None:
            try:
                for fresh_connection in (False, True):
                    with asking[donor]:
                        await ask_one(donor)
                    if not asking[donor].cancelled_caught:
                        return
                    if fresh_connection or donor in self.report.banned or donor not in redialled:
                        failures[donor] = self.report.banned.get(donor, "silent")
                        return
                    asking[donor] = trio.CancelScope()
                    with trio.move_on_after(PROBE_EVERY):
                        await self.host.disconnect(donor)
            finally:
                finished.append(donor)

        def redial(donor: str) -> None:
            log.info(kv("state donor's connection stalled; asking again over a fresh one", donor=donor))
            redialled.add(donor)
            asking[donor].cancel()

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
                offers[donor] = parse_manifest(reply, self.chunk_bytes, self.max_bytes)
                if (moments := InnerMoments.from_wire(reply.get("inner_moments"))) is not None:
                    self._moments[donor] = moments  # beside the vote: every donor's are its own
            except StateSyncError as e:  # a malformed answer is an answer: it can only hurt a liar
                failures[donor] = f"malformed manifest: {e}"
                offers[donor] = []

        # Wait for every donor, but once half of them answered, give the rest only a grace
        # period: one stalled donor must not hold the join for the whole manifest timeout.
        t0 = trio.current_time()
        async with trio.open_nursery() as watch:
            if self.quiet is not None:

                def unanswered() -> list[str]:
                    return [d for d in self.donors if d not in finished]

                watch.start_soon(self._watch_silence, unanswered, lambda d: asking[d].cancel())
                watch.start_soon(self._watch_stalled, lambda: [d for d in unanswered() if d not in redialled], redial)
            async with trio.open_nursery() as nursery:
                for d in self.donors:
                    nursery.start_soon(ask, d)
                while nursery.child_tasks:
                    if 2 * len(finished) >= len(self.donors) and any(offers.values()):
                        grace = max(VOTE_GRACE_SECONDS, 3 * (trio.current_time() - t0))
                        with trio.move_on_after(grace):
                            while nursery.child_tasks:
                                await trio.sleep(0.02)
                        nursery.cancel_scope.cancel()
                        break
                    await trio.sleep(0.02)
            watch.cancel_scope.cancel()
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

    async def _watch_silence(self, donors: Callable[[], Sequence[str]], cancel: Callable[[str], None]) -> None:
        """Drop each donor that goes silent — its heartbeats stopped and a probe went unanswered
        (collective/probe.py) — and `cancel` what waits on it (module docstring, Silence)."""
        assert self.quiet is not None

        def live() -> list[str]:
            return [d for d in donors() if d not in self.report.banned]

        while True:
            for donor in await wait_silent(self.host, live, self.quiet):
                self._ban(donor, "silent: its heartbeats stopped and it answered no probe")
                cancel(donor)

    async def _watch_stalled(self, donors: Callable[[], Sequence[str]], redial: Callable[[str], None]) -> None:
        """`redial` each donor whose heartbeats arrive but that leaves a probe unanswered: the
        connection to it is stalled (collective/probe.py, "Stalled connections")."""
        assert self.quiet is not None
        while True:
            for donor in await wait_stalled(self.host, donors, self.quiet):
                redial(donor)

    def _cancel_attempts(self, donor: str) -> None:
        """Cancel `donor`'s chunk transfers in flight: their chunks go back to the queue."""
        for chunk in list(self.in_flight):
            if (attempt := chunk.fetchers.get(donor)) is not None:
                attempt[0].cancel()

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


__all__ = ["FetchReport", "Progress", "fetch_state"]
