"""One attempt's data phase of the all-reduce: reduce-scatter and all-gather, pipelined.

Group of n, flattened input of M elements cut into n parts (flat.py `part_bounds`; part j belongs
to the j-th peer of the sorted group), equal or sized by the `shares` the coordinator announced
with the group, each part cut into stripes of at most `config.stripe_bytes` (`stripe_bounds`;
every peer computes the same cut). **Reduce-scatter**: every peer sends its slice of stripe s
of part j (optionally codec-encoded, with its weight) to the owner j, which combines the
contributions of a stripe in fp32 in a fixed (sorted) order — or robustly
(aggregation.py `reduce_contributions`) — as soon as the last one arrived. **All-gather**: the owner
encodes each reduced stripe once, decodes it back for itself, and sends the same bytes to all.
Every peer thus holds the owner's exact bits for every stripe, so results are bit-identical by
construction. With equal parts each peer moves 2(n−1)/n·M elements, the bandwidth-optimal amount
(as hivemind's butterfly and PCCL's ring) when every link is as fast.

**Weighted parts, for links of different speeds.** Owning a fraction f of the vector
costs a peer M·(1 + (n − 2)·f) each way, so a slow peer should own little: the coordinator turns
the rates the members joined with into integer `shares` (shares.py: the bottleneck time is
minimised, a peer too slow to help owns an empty part) and sends them with the group; every
member cuts the same bounds from them. An empty part has no stripes: nobody sends to it or waits
for it, its owner receives and reduces nothing (no contributions to screen or keep), and it still
sends its input to every other owner and receives every result. Our own sends are timed
(`stats.sends`) so that our uplink can be measured for the next join (shares.py `egress_rate`).

**Pipelining, for links where bandwidth × latency is large (a WAN, scripts/labs/wanlab).** There is
no barrier between the phases: a stripe's all-gather starts the moment it is reduced, while
later stripes are still being scattered, so each link carries both phases at once and is busy
in both directions until the end; only the last stripe's all-gather is left when the scatter
ends — which is why each part's last stripes shrink by halves (the `taper` its coordinator
announced: flat.py `STRIPE_TAPER`, 3): its owner sends that stripe to all n − 1 peers with nothing
else left to overlap, 1.2 s of a 16.4 s round with equal 2 MiB stripes in the WAN lab, ~0.15 s
with a quarter-MiB one. Reduce-scatter sends go to the owners in ring order from ours, so the
first stripes in flight spread over every owner's downlink.

Every transfer (tensor_streams: header → accept → data → trailer → ack) costs two round
trips of its own, so to each peer, in each direction, `config.window` transfers are in flight
(on as many pooled connections, opened up front by `connect_group`): the next stripe's header and
acceptance cross while the previous stripe's data still flows, and no per-transfer round trip is
on the critical path. Every receive is posted when the attempt starts, so no sender ever waits
for a matching receive. A peer's reduce-scatter sends, to all owners together, share a few
slots (`scatter_slots`), taken in stripe order: a slow uplink carrying a dozen transfers at once
would finish them all only at the end of the time they share, so no stripe would be reduced —
and nothing would come back down that peer's link — for the first quarter of its upload (the WAN
benchmark, docs/benchmarks.md); a few at a time, its stripes finish in turn and the all-gather overlaps the scatter
from the start. How few is a matter of the uplink: as many stripes as it sends in
`config.scatter_horizon` (1 s), at least 2 (the transfers' round trips must hide behind each
other's data), `config.scatter_window` (4) while the rate is unknown. In the WAN lab (8 peers,
100 Mbit/s, 20 ms) 4 slots kept the links ~87 % busy (each transfer's two round trips and a
cold connection's ramp showed), 6–8 about 97 %; 8 slots on the two 20 Mbit/s peers of the mixed
lab made its round 4 % slower, and `window` 4 (28 all-gather flows on a 20 Mbit/s uplink) once
starved a transfer past its deadline. Robust modes use one stripe per part (clipping looks at a
part's norm).

With `codec="none"` stripes travel as views of the flat input (no encode copy) and reduced
stripes are received straight into their slice of the output (no decode, no concatenation).

**Screening** (robust modes with `config.screen_norm`): the owner of a part, which holds every
contribution to it, flags the outliers as it combines them (aggregation.py) and keeps the
flags in `stats.flags`.
Replay screening (robust modes with screening, given the participant's `EchoMemory`): before
combining, the owner drops a contribution that repeats one of its earlier rounds' (echoes.py;
named in `stats.rejected`, as garbage is, and kept in `stats.echoes`), and keeps a sketch of the
part (`stats.sketch`), which the participant remembers if the round commits.
With `config.score_samples` (loss scoring, node/trust/scoring.py) the owner also keeps every weighted,
finite contribution to its part in `stats.kept` until the round commits (one more copy of the
flat input per peer, the size of the robust stack it already builds): which few of them are
scored depends on the committed digest (contract.py `sampled_peers`).

Failures become `AttemptFailed` with the peers we suspect: a transfer that broke or missed its
size-scaled deadline, a peer whose connection dropped (the host's connection events wake us at
once) or went silent (its heartbeats stopped and a probe went unanswered: probe.py — watched
from the attempt's start, connecting included: a stopped peer's kernel accepts a connection its
process never answers), or garbage
— a contribution with NaN/inf or of the wrong size is dropped and its sender named in
`stats.rejected`; a reduced part that does not decode, or (robust modes) is far outside our own
contribution's range, is proof against its owner (`evidence=True`).

Wire: every stripe moves as one tensor_streams transfer, named by the attempt and its place:
`ar/<round key>/<attempt>/rs/<part>/<stripe>` carries a contribution to the part's owner (meta
`{"w": weight}`), `.../ag/<part>/<stripe>` the reduced stripe back from it (its digest in the
header). A name from another attempt never matches, so stale data is never mixed in.

`AttemptPlan` is what one attempt is, decided before bytes move: the group and our place in it,
the codec, every part's bounds and stripes (from the shares and taper the coordinator announced:
every member derives the same ones, and so the same transfer names and sizes), the transfer
deadline and our scatter slots; a value, built and checked before the attempt starts. A
`Transfer` is one stripe's movement to a peer (name, tensors, meta, digest). `DataPhase` is one
object per attempt, over its plan: `run` = connect (while our input is flattened and checked:
contribution.py), then `exchange` (both phases), under a liveness watch (a silence watch
over both).

Not here: who is in the group and what happens after a failure (coordinator.py), the round's
control messages (protocol.py).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import torch
import trio

from meshtrain.collective.aggregation import reduce_contributions
from meshtrain.collective.compression import Codec, CodecError, get_codec
from meshtrain.collective.contract import CollectiveError, ContributionFlag
from meshtrain.collective.contribution import Contribution
from meshtrain.collective.echoes import Echo, EchoMemory, PartSketch
from meshtrain.collective.flat import all_finite, part_bounds, stripe_bounds, unflatten
from meshtrain.collective.probe import wait_silent
from meshtrain.collective.protocol import AllReduceConfig, Joined, Retry, RoundKey
from meshtrain.log import get_logger, kv
from meshtrain.transport.data_channel import Received, payload_digest
from meshtrain.transport.host import Host
from meshtrain.transport.tensor_streams import TensorStreams, TransferError

log = get_logger(__name__)


class AttemptFailed(Exception):
    """This attempt cannot complete; carries the peers we suspect.

    `evidence` says we hold proof (their data was garbage, or we are accusing ourselves because
    we are leaving); without it the suspicion is a broken transfer, which may only be the echo of
    that peer abandoning the attempt because of someone else."""

    def __init__(self, suspects: set[str], why: str, evidence: bool = False) -> None:
        super().__init__(why)
        self.suspects = suspects
        self.evidence = evidence


@dataclass
class AttemptStats:
    """What one attempt moved and saw."""

    sent: int = 0
    received: int = 0
    zero_weight: set[str] = field(default_factory=set)  # contributed nothing (weight 0)
    rejected: dict[str, str] = field(default_factory=dict)  # peer -> why its data was thrown away
    digest: bytes | None = None  # of our result, once we have one
    flags: list[ContributionFlag] = field(default_factory=list)  # screening, as the owner of a part
    # Loss scoring (config.score_samples): every weighted, finite contribution of another peer to
    # our part, kept until the round commits (the sample depends on the committed digest).
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    part: tuple[int, int] = (0, 0)  # our part's [start, stop) in the flat input
    # Replay screening (echoes.py): a sketch of every weighted contribution to our part and of its
    # aggregate, kept by the participant if the round commits; the echoes we dropped from our part.
    sketch: PartSketch | None = None
    echoes: list[Echo] = field(default_factory=list)
    # Every send of ours, (start, end, bytes) in trio time: our uplink's measure (shares.py
    # `egress_rate`), which our next joins carry when no rate is configured.
    sends: list[tuple[float, float, int]] = field(default_factory=list)


def exception_leaves(eg: BaseException) -> Iterator[BaseException]:
    """The non-group exceptions inside a (nested) exception group."""
    if isinstance(eg, BaseExceptionGroup):
        for e in eg.exceptions:
            yield from exception_leaves(e)
    else:
        yield eg


MAX_SCATTER_SLOTS = 16  # 32 MiB of 2 MiB stripes: a 1 Gbit/s link's bandwidth × 250 ms


def scatter_slots(config: AllReduceConfig, uplink: float | None, stripe_bytes: int) -> int:
    """How many of our reduce-scatter transfers (of `stripe_bytes` on the wire) may be in flight at
    once, to all owners together.

    Enough that each transfer's own round trips are hidden behind the others' data; few enough
    that a stripe finishes soon after it starts, so that its owner reduces it and the all-gather
    flows back down our link while we still send. With our uplink known (bytes/s, configured or
    measured): as many stripes as it sends in `config.scatter_horizon` seconds, from 2 to
    `MAX_SCATTER_SLOTS` — 100 Mbit/s and 2 MiB stripes give 6, 20 Mbit/s gives 2 (8 at 20 Mbit/s
    land their first stripe after 6.7 s, and the all-gather to that peer starts as late: issue
    20's bench). Unknown (no measurement yet): `config.scatter_window`.

    A measured uplink includes each transfer's two round trips, so over a long RTT the rule
    settles where the slots' data covers the horizon less those round trips: about
    1 − 2·RTT/horizon of the link busy (0.92 at 40 ms of RTT, 0.6 at 200 ms; the fixed 4 slots
    before gave 0.89 and 0.63). A configured `uplink_mbit` does not shrink that way."""
    if not uplink or stripe_bytes <= 0:
        return config.scatter_window
    fit = round(uplink * config.scatter_horizon / stripe_bytes)
    return max(2, min(MAX_SCATTER_SLOTS, fit))


@dataclass(frozen=True)
class AttemptPlan:
    """What one attempt of the data phase is: everything decided before bytes move.

    key / attempt: name the transfers (`tag`), so stale data from another attempt is never mixed
    in. group: the attempt's members, sorted; `me` is in it. codec: how stripes are encoded on
    the wire (`lossless`: "none", stripes travel as views). bounds: part j is
    [bounds[j], bounds[j + 1]) of the flat input, owned by group[j] (flat.py `part_bounds`, sized
    by the coordinator's shares). stripes: each part's stripe bounds (flat.py `stripe_bounds`,
    tapered as the coordinator announced; an empty part has none). deadline: one transfer's,
    scaled to the input's size. scatter_slots: our reduce-scatter transfers in flight at once
    (`scatter_slots`). Every peer of the group derives the same bounds and stripes from the same
    layout, so they agree on every transfer's name and size without a message."""

    key: RoundKey
    attempt: int
    group: tuple[str, ...]
    me: str
    codec: Codec
    bounds: tuple[int, ...]
    stripes: tuple[tuple[int, ...], ...]
    deadline: float
    scatter_slots: int

    @classmethod
    def of(
        cls,
        key: RoundKey,
        layout: Joined | Retry,
        me: str,
        numel: int,
        config: AllReduceConfig,
        codec: str,
        uplink: float | None = None,
    ) -> AttemptPlan:
        """The plan of attempt `layout.attempt` (its group, shares and taper, as the coordinator
        announced them) for an input of `numel` elements, `me` a member of the group; `uplink`
        (bytes/s, if known) sizes `scatter_slots`. An unknown codec or shares that do not fit
        the group are a `CollectiveError`."""
        try:
            coder = get_codec(codec)
        except CodecError as e:
            raise CollectiveError(str(e)) from None
        try:
            bounds = tuple(part_bounds(numel, len(layout.group), layout.shares))
        except ValueError as e:
            raise CollectiveError(f"the coordinator's part shares do not fit the group: {e}") from None
        # Robust modes combine a whole part at once (clipping looks at its norm): one stripe.
        # An empty part (a slow member's, shares.py) has no stripes: nothing is sent to or from it.
        stripe = numel if config.robust != "none" else max(1, config.stripe_bytes // 4)
        stripes = tuple(
            tuple(stripe_bounds(a, b, stripe, layout.taper)) if b > a else (a,)
            for a, b in zip(bounds, bounds[1:], strict=False)
        )
        # In flight is counted on the wire: a stripe as its codec encodes it.
        widest = max((b - a for part in stripes for a, b in zip(part, part[1:], strict=False)), default=0)
        slots = scatter_slots(config, uplink, coder.encoded_nbytes(widest))
        return cls(
            key, layout.attempt, layout.group, me, coder, bounds, stripes, config.transfer_deadline(numel), slots
        )

    @property
    def index(self) -> int:
        """Our place in the group: the part we own."""
        return self.group.index(self.me)

    @property
    def others(self) -> tuple[str, ...]:
        return tuple(p for p in self.group if p != self.me)

    @property
    def tag(self) -> str:
        """The attempt's name on the wire, under which every transfer of it is named."""
        return f"ar/{self.key.wire}/{self.attempt}"

    @property
    def lossless(self) -> bool:
        """Stripes travel as views of the input and land in place: no encode, no decode."""
        return self.codec.name == "none"

    def stripe_count(self, part: int) -> int:
        return len(self.stripes[part]) - 1

    def stripe(self, part: int, s: int) -> tuple[int, int]:
        """Stripe `s` of part `part`: [start, stop) of the flat input."""
        return self.stripes[part][s], self.stripes[part][s + 1]

    def subtag(self, phase: str, part: int, s: int) -> str:
        """The name of stripe `s` of part `part` in `phase` ("rs": a contribution to its owner,
        "ag": the reduced stripe from its owner)."""
        return f"{self.tag}/{phase}/{part}/{s}"


@dataclass(frozen=True)
class Transfer:
    """One stripe's movement to a peer, ready to send: its name (`AttemptPlan.subtag`), its
    tensors (codec-encoded; lossless, the stripe itself: in the reduce-scatter a view of our flat
    input), its metadata (our weight, in the reduce-scatter) and, in the all-gather, the digest
    of its bytes, hashed once for every receiver."""

    subtag: str
    parts: dict[str, torch.Tensor]
    meta: dict[str, float] = field(default_factory=dict)
    digest: bytes | None = None


class DataPhase:
    """The data movement of one attempt.

    streams / host: the tensor data plane, and the host whose connection events tell us a peer
    dropped. config: the window, connection timeout and the robust mode. plan: the attempt
    (`AttemptPlan`: who owns which stripes, the codec, the deadline). contribution: our input
    (contribution.py: flat vector and weight, once ready — weight 0: we contribute nothing but
    still receive the result). echoes: the participant's memory for replay screening (used in
    robust modes with screening). `stats` fills in as the attempt runs."""

    def __init__(
        self,
        streams: TensorStreams,
        host: Host,
        config: AllReduceConfig,
        plan: AttemptPlan,
        contribution: Contribution,
        echoes: EchoMemory | None = None,
        quiet: Callable[[str], bool] | None = None,
    ) -> None:
        self.streams, self.host, self.config = streams, host, config
        self.quiet = quiet
        self.plan, self.contribution = plan, contribution
        self.tensors = contribution.tensors
        # Our flat input and weight, set by `run` once the contribution is ready.
        self.flat, self.weight = torch.empty(0), 0.0
        # Replay screening needs a part's contributions side by side: robust modes with screening.
        screens = config.screen_echo and config.screen_norm and config.robust != "none"
        self.echoes = echoes if screens else None
        # The result is assembled in place: every owner's part lands in its slice of `out`.
        self.out = torch.empty(contribution.numel)
        self.failed: set[str] = set()
        self.failed_why = "peers disconnected during the attempt"
        self.silent: set[str] = set()  # the peers our silence watch found silent (among `failed`)
        self.stats = AttemptStats()

    async def run(self) -> dict[str, torch.Tensor]:
        """The attempt's result, in the caller's names, shapes and dtypes; or `AttemptFailed`."""
        try:
            # Silence is watched from the start: connecting to a SIGSTOPped member hangs in the
            # session handshake (its kernel accepts, its process never answers) until the part
            # deadline — a soak's retry waited 7 s so, its member stopped since the attempt before.
            async with trio.open_nursery() as watched:
                if self.quiet is not None:
                    watched.start_soon(self._watch_silence, watched.cancel_scope)
                async with trio.open_nursery() as nursery:  # the input is prepared while we connect
                    nursery.start_soon(self.connect_group)
                    self.flat, self.weight = await self.contribution.ready()
                if self.weight == 0:
                    self.stats.zero_weight.add(self.plan.me)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_liveness, nursery.cancel_scope)
                    await self.exchange()
                    nursery.cancel_scope.cancel()
                watched.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            leaves = list(exception_leaves(eg))
            for e in leaves:
                if isinstance(e, CollectiveError):
                    raise e from None
            fails = [e for e in leaves if isinstance(e, AttemptFailed)]
            if fails and len(fails) == len(leaves):
                # Proof outweighs broken transfers, which may only echo others abandoning the attempt.
                fails = [f for f in fails if f.evidence] or fails
                raise AttemptFailed(
                    set().union(*(f.suspects for f in fails)), str(fails[0]), evidence=fails[0].evidence
                ) from None
            raise
        if self.failed:
            raise AttemptFailed(set(self.failed), self.failed_why)
        return unflatten(self.out, self.tensors, list(self.tensors))

    async def connect_group(self) -> None:
        """Open data-plane connections to the whole group first (`config.window` to each peer, one
        per transfer in flight): setup is off the critical path, and an unreachable member is a
        suspect before any data moves."""

        async def one(peer: str) -> None:
            try:
                with trio.fail_after(self.config.part_timeout):
                    async with trio.open_nursery() as nursery:
                        for _ in range(self.config.window):
                            nursery.start_soon(self.streams.prepare, peer)
            except BaseExceptionGroup as eg:
                leaves = list(exception_leaves(eg))
                if not all(isinstance(e, TransferError) for e in leaves):
                    raise
                self.failed.add(peer)
                log.info(kv("allreduce peer unreachable", peer=peer[-8:], error=repr(leaves[0])))
            except trio.TooSlowError as e:
                self.failed.add(peer)
                log.info(kv("allreduce peer unreachable", peer=peer[-8:], error=repr(e)))

        async with trio.open_nursery() as nursery:
            for p in self.plan.others:
                nursery.start_soon(one, p)
        if self.failed:
            raise AttemptFailed(set(self.failed), "group members unreachable")

    async def exchange(self) -> None:
        """Reduce-scatter and all-gather, pipelined stripe by stripe (see the module docstring)."""
        plan = self.plan
        index, group, others = plan.index, plan.group, plan.others
        count = plan.stripe_count(index)
        self._contributions: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
        self._weights: list[dict[str, float]] = [{} for _ in range(count)]
        self._missing = [len(others)] * count
        self._reduced: list[Transfer | None] = [None] * count  # each stripe's all-gather, once reduced
        self._ready = [trio.Event() for _ in range(count)]
        # Our reduce-scatter sends share `scatter_slots` slots, taken in stripe order across the
        # owners, so that stripes finish one after another, not all together at the end: the
        # first reduced stripes come back while we still send (see the module docstring).
        scatter = trio.Semaphore(plan.scatter_slots)
        async with trio.open_nursery() as nursery:
            # Owners in ring order from ours, so that the first stripes in flight spread over
            # every owner's downlink rather than all landing on the lowest ids.
            for k in range(1, len(group)):
                j = (index + k) % len(group)
                peer = group[j]
                # Reduce-scatter: our slice of part j, stripe by stripe, to its owner ...
                rs = [self._contribution_job(j, s) for s in range(plan.stripe_count(j))]
                nursery.start_soon(self._pipeline, peer, rs, scatter)
                # ... and part j's reduced stripes from it, straight into `out`.
                for s in range(plan.stripe_count(j)):
                    nursery.start_soon(self._fetch, j, s, peer)
            for peer in others:
                for s in range(count):
                    nursery.start_soon(self._collect, peer, s)
                # All-gather: each of our reduced stripes, as soon as it is ready.
                nursery.start_soon(self._pipeline, peer, [self._reduced_job(s) for s in range(count)])
            for s in range(count):
                if not self._missing[s]:  # alone in the group: nothing to wait for
                    nursery.start_soon(self._reduce_stripe, s)

    def _contribution_job(self, j: int, s: int) -> Callable[[], Awaitable[Transfer]]:
        """Our slice of stripe s of part j, encoded only when its turn to be sent comes."""

        async def job() -> Transfer:
            a, b = self.plan.stripe(j, s)
            return Transfer(self.plan.subtag("rs", j, s), self._encode(self.flat[a:b]), {"w": self.weight})

        return job

    def _reduced_job(self, s: int) -> Callable[[], Awaitable[Transfer]]:
        """Our reduced stripe s, once it is reduced."""

        async def job() -> Transfer:
            await self._ready[s].wait()
            transfer = self._reduced[s]
            assert transfer is not None  # set before the event
            return transfer

        return job

    async def _pipeline(
        self, peer: str, jobs: list[Callable[[], Awaitable[Transfer]]], shared: trio.Semaphore | None = None
    ) -> None:
        """Send `jobs` to `peer` in order, `config.window` transfers in flight: the next one's
        header and acceptance cross the link while the previous one's data still flows. With
        `shared`, each transfer also holds one of its slots (a cap over all peers, first come
        first served)."""
        slots = trio.Semaphore(self.config.window)

        async def one(transfer: Transfer) -> None:
            try:
                await self._send(peer, transfer)
            finally:
                slots.release()
                if shared is not None:
                    shared.release()

        async with trio.open_nursery() as nursery:
            for job in jobs:
                await slots.acquire()
                if shared is not None:
                    await shared.acquire()
                nursery.start_soon(one, await job())

    async def _collect(self, peer: str, s: int) -> None:
        """One contribution to stripe s of our part; the last one to arrive starts its reduction."""
        index = self.plan.index
        a, b = self.plan.stripe(index, s)
        got = await self._receive(peer, self.plan.subtag("rs", index, s), b - a)
        w = got.meta.get("w")
        try:
            if not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
                raise CodecError("bad weight")
            x = self.plan.codec.decode(got.tensors, (b - a,), torch.float32)
        except CodecError as e:
            self.stats.rejected[peer] = f"garbage contribution: {e}"
        else:
            if w == 0:
                self.stats.zero_weight.add(peer)
            self._contributions[s][peer] = x
            self._weights[s][peer] = float(w)
        self._missing[s] -= 1
        if not self._missing[s]:
            await self._reduce_stripe(s)

    async def _reduce_stripe(self, s: int) -> None:
        """Reduce stripe s of our part, keep the owner's exact bits in `out`, release its all-gather."""
        plan, me = self.plan, self.plan.me
        a, b = plan.stripe(plan.index, s)
        contributions, weights = self._contributions[s], self._weights[s]
        contributions[me] = self.flat[a:b]
        weights[me] = self.weight
        sketch = self._drop_echoes(self.echoes, a, b, contributions, weights) if self.echoes is not None else None
        reduced = await trio.to_thread.run_sync(
            reduce_contributions, contributions, weights, self.config, self.stats.rejected, self.stats.flags, plan.index
        )
        if self.config.robust != "none" and (self.config.score_samples or sketch is not None):
            self.stats.part = (a, b)
        if self.config.score_samples and self.config.robust != "none":
            self.stats.kept = {
                p: x
                for p, x in contributions.items()
                if p != me and weights.get(p, 0) > 0 and p not in self.stats.rejected
            }
        if sketch is not None:
            self.stats.sketch = sketch.with_aggregate(reduced)
        self._contributions[s] = {}  # the contributions are no longer needed (kept ones aside)
        parts = self._encode(reduced)
        self.out[a:b] = reduced if plan.lossless else plan.codec.decode(parts, (b - a,), torch.float32)
        # Hashed once, off the event loop, rather than once per receiver while sending.
        digest = await trio.to_thread.run_sync(payload_digest, parts) if plan.others else None
        self._reduced[s] = Transfer(plan.subtag("ag", plan.index, s), parts, digest=digest)
        self._ready[s].set()

    def _drop_echoes(
        self,
        echoes: EchoMemory,
        a: int,
        b: int,
        contributions: dict[str, torch.Tensor],
        weights: dict[str, float],
    ) -> PartSketch:
        """Replay screening (echoes.py), before our part [a, b) is combined: the contributions
        that repeat an earlier round's in `echoes` are taken out of it (named in `stats.rejected`,
        kept in `stats.echoes`); the sketch of every weighted contribution, theirs included."""
        key = self.plan.key
        weighted = {p: x for p, x in contributions.items() if weights.get(p, 0) > 0 and p not in self.stats.rejected}
        sketch = PartSketch.of(key.round_id, (a, b), self.flat.numel(), weighted)
        for echo in echoes.match(key.tag, sketch):
            if echo.peer != self.plan.me:
                self.stats.rejected[echo.peer] = (
                    f"repeats round {echo.earlier}'s contribution (cosine {echo.cosine:.6f})"
                )
                self.stats.echoes.append(echo)
                del contributions[echo.peer], weights[echo.peer]
        return sketch

    async def _fetch(self, j: int, s: int, peer: str) -> None:
        """Stripe s of part j, reduced, from its owner `peer`, into its slice of `out`."""
        plan = self.plan
        a, b = plan.stripe(j, s)
        slot = self.out[a:b]
        got = await self._receive(
            peer, plan.subtag("ag", j, s), b - a, {"values": slot} if plan.lossless else None, phases=2
        )
        try:
            if plan.lossless:
                if not all_finite(slot):
                    raise CodecError("non-finite values")
                part = slot
            else:
                part = plan.codec.decode(got.tensors, (b - a,), torch.float32)
        except CodecError as e:
            raise AttemptFailed({peer}, f"garbage reduced part from {peer[-8:]}: {e}", evidence=True) from None
        if self.config.robust != "none" and part.numel():
            # Robust combination cannot exceed the contributions' range; we only know ours, so a
            # part vastly larger than our slice of it means its owner is lying (robust
            # aggregation alone protects contributions only). Our slice all zeros (we contribute
            # nothing, or a free rider's zeros) bounds nothing: no verdict then.
            ours = float(self.flat[a:b].abs().max())
            if ours > 0 and self.weight > 0 and float(part.abs().max()) > self.config.owner_check * ours:
                self.stats.rejected[peer] = "reduced part out of range"
                raise AttemptFailed({peer}, f"reduced part from {peer[-8:]} out of range", evidence=True)
        if not plan.lossless:
            slot.copy_(part)

    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.plan.lossless:
            return {"values": x}
        try:
            return self.plan.codec.encode(x)
        except CodecError as e:  # our own input is not finite: we cannot take part
            raise CollectiveError(f"cannot encode our input: {e}") from None

    async def _send(self, peer: str, transfer: Transfer) -> None:
        try:
            t0 = trio.current_time()
            rep = await self.streams.send(
                peer,
                transfer.subtag,
                transfer.parts,
                meta=transfer.meta,
                digest=transfer.digest,
                timeout=self.plan.deadline,
            )
            self.stats.sent += rep.nbytes
            self.stats.sends.append((t0, trio.current_time(), rep.nbytes))
        except TransferError as e:
            self.failed.add(peer)
            raise AttemptFailed({peer}, f"send to {peer[-8:]}: {e}") from None

    async def _receive(
        self, peer: str, subtag: str, numel: int, into: dict[str, torch.Tensor] | None = None, phases: int = 1
    ) -> Received:
        """One stripe of `numel` elements. It was asked for when the attempt began, so an
        all-gather stripe (`phases=2`) may wait for the whole reduce-scatter first."""
        try:
            got = await self.streams.receive(
                peer,
                subtag,
                timeout=phases * self.plan.deadline,
                into=into,
                max_bytes=2 * (4 * numel + 64) + (1 << 20),
            )
            self.stats.received += got.nbytes
            return got
        except TransferError as e:
            self.failed.add(peer)
            raise AttemptFailed({peer}, f"receive from {peer[-8:]}: {e}") from None

    async def _watch_liveness(self, scope: trio.CancelScope) -> None:
        """Cancel the attempt as soon as a peer we depend on drops its connection."""
        gone = await self.host.wait_disconnected(self.plan.others)
        self.failed.update(gone)
        scope.cancel()

    async def _watch_silence(self, scope: trio.CancelScope) -> None:
        """Cancel the attempt once a peer we depend on went silent (probe.py `wait_silent`): a
        SIGSTOPped peer keeps its connections open, and the transfers to and from it waited out
        their deadline, 20 s and more."""
        assert self.quiet is not None
        key = self.plan.key
        others = self.plan.others
        silent = await wait_silent(self.host, lambda: [p for p in others if p not in self.failed], self.quiet, key)
        self.failed.update(silent)
        self.silent.update(silent)
        self.failed_why = f"peers silent during the attempt: {', '.join(sorted(p[-8:] for p in silent))}"
        scope.cancel()
