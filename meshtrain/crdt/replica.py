"""`Replica`: keeps one swarm's named CRDTs in sync among its peers (gossip push, anti-entropy pull).

The problem. Every peer holds the swarm's shared state (membership, progress, metrics, config) as
signed CRDTs (`types.py`). A local write must reach every peer quickly, and a peer that missed
messages (it was partitioned, restarted, or a gossip message was dropped) must catch up without a
leader. Peers are untrusted: anything that arrives may be forged, tampered, oversized or garbage.

Design.
- **Push (fast path): gossipsub** (`gossip.py`, the part `Gossip`: the topic, the
  message format, its size limits and why they are so small): a local write's entry is queued,
  coalesced for `publish_delay` and published to the swarm's topic in messages of at most
  `max_gossip_payload`. **Merging happens in the topic validator** (`gossip.py`): a message
  with any rejected entry is not relayed, and entries accepted from gossip are *not*
  re-published.
- **Pull (repair path): anti-entropy** (`anti_entropy.py`, the part `AntiEntropy`) every
  `anti_entropy_interval` with one random connected peer, and at once with every newly connected
  peer: fingerprints first, then push and pull what differs. Entries accepted through
  anti-entropy *are* re-gossiped.
- **Hostile input** is decoded only within size limits and raises only `CrdtError`s; rejected
  entries and undecodable messages are counted in `stats` and logged (rate-limited); nothing a
  peer sends can raise out of a validator or an RPC handler. An entry whose encoding exceeds
  `MAX_ENTRY_BYTES` is refused everywhere (the same deterministic rule on every replica, so they
  still converge), which bounds every message this module produces. py-libp2p's own pubsub
  stream handler is wrapped (`gossip.py`): unwrapped, one malformed frame from any peer kills
  the host.
- **Gate: whose records we keep at all.** Signatures bind an entry to its owner, but an identity
  costs nothing: a stranger can mint thousands and sign a record with each. The type and spec
  rules cannot see that (they are pure functions of one entry), so the replica takes a `gate`
  (`install_gate`, called by `SwarmView` when the swarm has an admission rule): `(crdt name,
  entry) -> reason or None`, asked after the spec's checks and before the signature, for every
  entry that arrives (never for our own). A refused entry is not stored, not re-gossiped, and makes its gossip
  message not relayed; it is counted in `stats.refusals_by_reason` (the status document's
  `refused`), logged at debug level only (a joiner's records are refused for a moment in normal
  operation). Refusing is safe because the gate only depends on other replicated state (the
  entry owner's membership record, the swarm owner's config) and anti-entropy is digest-based: an entry we
  refused stays in our partner's digest and not in ours, so every exchange with a peer that holds
  it (its owner always does) offers it again, and once the state the gate reads has arrived it is
  taken. That can be one anti-entropy period late, which a swarm taking a round per step (dp)
  feels: a joiner's progress that arrived a moment before its membership record would keep it
  out of rounds until the next exchange. So the latest entry of each owner and CRDT refused for
  one of the park reasons installed with the gate (a missing membership record) is parked (at most `MAX_PARKED` in all, the oldest evicted; an entry parked twice replaces itself,
  so a stranger cannot grow it) and merged again, through the gate, whenever some other entry
  was accepted. Within one message or reply, batches are merged in the order of the replica's
  specs, so list the CRDTs the gate reads first (`swarm_specs` does). Cost: while peers disagree about the
  gate's inputs their fingerprints differ, and anti-entropy sends digests instead of one
  fingerprint; a refused entry also travels again on each such exchange (bounded by the RPC
  limits, as before).
- **Restarts** (`anti_entropy.py`): `recover()` pulls the swarm's state, our own earlier entries
  included, before the caller writes; an entry of ours that arrives later anyway makes the
  `ChangeEvent` carry `own_superseded=True`.
- **Subscriptions**: `on_change(callback)` (called inline, must not block) and `subscribe()` (a
  bounded trio channel of `ChangeEvent`s; a full channel drops events and counts them — the
  state itself is always readable, so a slow consumer re-reads it rather than blocking merges).

Parts. The replica owns the CRDTs, the merge path (spec rules, size limit, gate, parked
entries), the fingerprint caches, the subscriptions and the counters (`stats`). The two sync
paths are parts it builds, each owning its own state and seeing the replica only through a
narrow interface: `Gossip` (`replica.gossip`) and `AntiEntropy` (`replica.anti_entropy`) read
the CRDTs and merge into them as `LocalCrdts` / `FingerprintedCrdts` (`crdts`,
`merge_batches`, `fingerprint`, `bucket_fingerprints`), and bump their own counters of `stats`.
The replica queues its writes and anti-entropy's acceptances on `gossip.queue`; `recover` and
`flush` are anti-entropy's and both parts' work. The two parts meet in two callables the replica
passes: gossip asks anti-entropy when a peer connected, and anti-entropy's tick has gossip open
the streams gossipsub missed.

Lifecycle: `async with Replica(host, swarm_id, specs) as replica:` enters `Gossip` (gossipsub
unless a running `Pubsub` is passed in, the topic validator, two tasks: drain the subscription,
publish) and then `AntiEntropy` (the RPC handlers, two tasks: anti-entropy ticks, greeting new
connections), each a `Service` with its own nursery; leaving unwinds them in reverse.

Not here: the CRDT types and merge rules (`types.py`, `base.py`), what the swarm's state means
(`swarm_records.py`, `swarm_view.py`), dialling and peer discovery (transport, dht). One replica
per host: gossipsub registers host-wide protocol handlers, and so do the `crdt/*` RPCs. The push path and its wire
format are in `gossip.py`, the pull path and its RPCs in `anti_entropy.py`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

import trio
from libp2p.pubsub.pubsub import Pubsub

from meshtrain.crdt.anti_entropy import DEFAULT_RECOVER_TIMEOUT, MAX_RPC_ENTRIES_BYTES, AntiEntropy
from meshtrain.crdt.base import SignedCrdt
from meshtrain.crdt.entries import (
    CrdtError,
    Digest,
    MergeOutcome,
    Rejection,
    SignatureCache,
    SignedEntry,
)
from meshtrain.crdt.fingerprints import FINGERPRINT_BYTES, bucket_fingerprints, fingerprint_of
from meshtrain.crdt.gossip import (
    MAX_GOSSIP_PAYLOAD,
    YAMUX_FRAME_PAYLOAD,
    Gossip,
    RateLimitedLog,
    entry_wire_size,
)
from meshtrain.crdt.types import CRDT_TYPES
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host

log = get_logger(__name__)

MAX_ENTRY_BYTES = 48 << 10  # one entry, encoded; fits a gossip message with room to spare
MAX_PARKED = 256  # refused entries kept for another try once the gate's inputs change (see Gate)

DEFAULT_ANTI_ENTROPY_INTERVAL = 1.5
DEFAULT_ANTI_ENTROPY_JITTER = 0.3  # fraction of the interval, so peers do not tick in lockstep
DEFAULT_RPC_TIMEOUT = 5.0
DEFAULT_PUBLISH_DELAY = 0.01  # writes within 10 ms share one gossip message
DEFAULT_FLUSH_TIMEOUT = 2.0

Source = Literal["local", "gossip", "anti-entropy"]


class EntryTooLarge(CrdtError):
    """A write would produce an entry above `MAX_ENTRY_BYTES`; keep an owner's contribution small
    (put bulk data in the tensor data plane or a checkpoint and reference it by digest)."""


@dataclass(frozen=True)
class CrdtSpec:
    """One CRDT the replica keeps: its name, its type tag (a key of `CRDT_TYPES`), who may write
    it (`writers`, None for anyone) and optional extra body rules (`check`, raising `CrdtError`).

    `check` must be a pure function of the entry: every replica applies the same rules, so they
    reject the same entries and still converge.
    """

    name: str
    type_tag: str
    writers: frozenset[str] | None = None
    check: Callable[[SignedEntry], None] | None = None

    def __post_init__(self) -> None:
        if self.type_tag not in CRDT_TYPES:
            raise CrdtError(f"unknown CRDT type {self.type_tag!r}; known: {sorted(CRDT_TYPES)}")
        if self.writers is not None and not isinstance(self.writers, frozenset):
            object.__setattr__(self, "writers", frozenset(self.writers))


@dataclass(frozen=True)
class ReplicaConfig:
    """Timing and size limits of a replica (defaults suit a swarm of up to a few hundred peers)."""

    anti_entropy_interval: float = DEFAULT_ANTI_ENTROPY_INTERVAL
    anti_entropy_jitter: float = DEFAULT_ANTI_ENTROPY_JITTER
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    publish_delay: float = DEFAULT_PUBLISH_DELAY
    max_gossip_payload: int = MAX_GOSSIP_PAYLOAD
    max_rpc_entries_bytes: int = MAX_RPC_ENTRIES_BYTES
    max_pull_rounds: int = 8  # `more` replies followed per anti-entropy exchange
    recover_peers: int = 3
    event_buffer: int = 256
    # gossipsub mesh degree (D, D_low, D_high) and its heartbeat in whole seconds
    gossip_degree: tuple[int, int, int] = (6, 4, 12)
    gossip_heartbeat: int = 1

    def __post_init__(self) -> None:
        if self.anti_entropy_interval <= 0 or not 0 <= self.anti_entropy_jitter < 1:
            raise CrdtError("anti_entropy_interval must be > 0 and anti_entropy_jitter in [0, 1)")
        if not MAX_ENTRY_BYTES + 1024 <= self.max_gossip_payload <= YAMUX_FRAME_PAYLOAD:
            raise CrdtError(
                f"max_gossip_payload must be in {MAX_ENTRY_BYTES + 1024}..{YAMUX_FRAME_PAYLOAD} "
                "bytes (an entry must fit, and a message must fit one yamux frame)"
            )
        if not MAX_ENTRY_BYTES < self.max_rpc_entries_bytes <= 768 << 10:
            raise CrdtError(f"max_rpc_entries_bytes must be in {MAX_ENTRY_BYTES}..{768 << 10}")


@dataclass(frozen=True)
class ChangeEvent:
    """Entries that changed CRDT `crdt`, where they came from, and from whom.

    `peer` is the local peer for local writes, the gossip publisher, or the anti-entropy partner.
    `own_superseded`: the change includes an entry of *ours* that we did not write in this
    process — a previous incarnation's, newer than what we wrote since starting: our writes to
    this CRDT since the restart lost, and the writer should write again.
    """

    crdt: str
    entries: tuple[SignedEntry, ...]
    source: Source
    peer: str | None
    own_superseded: bool = False


@dataclass
class ReplicaStats:
    """Counters for tests, the status page and the benchmark (monotone, never reset)."""

    writes: int = 0
    gossip_published: int = 0
    gossip_bytes_published: int = 0
    gossip_publish_failed: int = 0
    gossip_received: int = 0  # messages from other peers that reached our validator
    gossip_invalid: int = 0  # ... that were undecodable or carried a rejected entry (not relayed)
    entries_accepted: int = 0
    entries_rejected: int = 0
    entries_regossiped: int = 0
    ae_exchanges: int = 0  # anti-entropy exchanges that completed
    ae_failed: int = 0
    ae_rpcs_sent: int = 0
    ae_rpcs_served: int = 0
    ae_entries_pulled: int = 0
    ae_entries_pushed: int = 0
    own_superseded: int = 0
    events_dropped: int = 0
    rejections_by_reason: dict[str, int] = field(default_factory=dict)
    entries_refused: int = 0  # ... that were well formed but the gate refused (e.g. a non-member's)
    refusals_by_reason: dict[str, int] = field(default_factory=dict)


def _tally(by_reason: dict[str, int], reasons: Iterable[str]) -> None:
    """Count `reasons` (each cut to 80 characters) in `by_reason`, at most 64 distinct ones: a
    hostile peer cannot grow the table."""
    for reason in reasons:
        reason = reason[:80]
        if reason in by_reason or len(by_reason) < 64:
            by_reason[reason] = by_reason.get(reason, 0) + 1


class Replica(Service):
    """The swarm's CRDTs on this peer, kept in sync with its connected peers.

    Parameters:
    - `host`: the running `Host`; its identity signs our writes, its RPC layer serves `crdt/*`.
    - `namespace`: the swarm id; bound into every entry's signature and the gossip topic.
    - `specs`: the CRDTs to keep (`CrdtSpec`); every peer of a swarm must use the same specs.
    - `config`: timing and limits (`ReplicaConfig`).
    - `pubsub`: a running py-libp2p `Pubsub` to share; by default the replica runs its own.
    - `cache`: a `SignatureCache` (default: the process-wide one).

    `install_gate(gate, park_reasons)` (none by default): whose entries the replica keeps at all
    (module docstring, "Gate"), installed by whoever builds the gate after the replica
    (`SwarmView`, whose gate reads the CRDTs of this replica).

    Parts (module docstring): `gossip` (`Gossip`, the push path) and `anti_entropy`
    (`AntiEntropy`, the repair path: `anti_entropy.exchange_with(peer)` runs one exchange).

    Contract: `write` never blocks and never loses a write locally; delivery to other peers is
    best effort by gossip and guaranteed eventually by anti-entropy while some path of connected,
    honest peers exists. Reading (`crdt(name)`, `digests()`) sees merged state immediately. A
    peer's failure costs us at most one RPC timeout per anti-entropy tick.
    """

    def __init__(
        self,
        host: Host,
        namespace: str,
        specs: Iterable[CrdtSpec],
        *,
        config: ReplicaConfig | None = None,
        pubsub: Pubsub | None = None,
        cache: SignatureCache | None = None,
    ) -> None:
        self.host = host
        self.identity = host.identity
        self.me = host.peer_id
        self.namespace = namespace
        self.config = config or ReplicaConfig()
        self._specs: dict[str, CrdtSpec] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise CrdtError(f"CRDT {spec.name!r} is specified twice")
            self._specs[spec.name] = spec
        if not self._specs:
            raise CrdtError("a replica needs at least one CrdtSpec")
        self._crdts: dict[str, SignedCrdt] = {
            name: CRDT_TYPES[s.type_tag](namespace, name, writers=s.writers, cache=cache)
            for name, s in self._specs.items()
        }
        self._fingerprints: dict[str, bytes] = {}
        self._bucket_fps: dict[str, tuple[int, list[bytes]]] = {}  # name -> (count, by bucket): the last asked
        self._subscribers: list[trio.MemorySendChannel[ChangeEvent]] = []
        self._callbacks: list[Callable[[ChangeEvent], None]] = []
        self._written_here: set[str] = set()  # CRDTs we wrote to in this process
        self._started = False
        self._warn = RateLimitedLog()
        self.stats = ReplicaStats()
        self._gate: Callable[[str, SignedEntry], str | None] | None = None  # install_gate
        self._park_reasons: frozenset[str] = frozenset()  # the gate's refusals worth another try
        # (crdt, owner) -> (entry, source, peer): the gate's latest refusals, tried again later
        self._parked: dict[tuple[str, str], tuple[SignedEntry, Source, str | None]] = {}
        self._retrying = False
        # The two sync paths, each with its own state; they read and merge through this replica.
        self.anti_entropy = AntiEntropy(
            host, namespace, self, self.config, self.stats, before_tick=self._open_gossip_streams
        )
        self.gossip = Gossip(
            host,
            namespace,
            self,
            self.config,
            self.stats,
            connected_since=self.anti_entropy.connected_since,
            pubsub=pubsub,
        )

    # --- reading --------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return sorted(self._crdts)

    @property
    def crdts(self) -> Mapping[str, SignedCrdt]:
        """The live CRDTs by name. Read them freely; write only through `write`."""
        return self._crdts

    def spec(self, name: str) -> CrdtSpec:
        return self._specs[self._check_name(name)]

    def crdt(self, name: str) -> SignedCrdt:
        """The live CRDT `name`. Read it freely; write only through `write` (else nobody hears)."""
        return self._crdts[self._check_name(name)]

    def digests(self) -> dict[str, Digest]:
        return {name: crdt.digest() for name, crdt in sorted(self._crdts.items())}

    def fingerprint(self, name: str | None = None) -> bytes:
        """16-byte hash of one CRDT's digest, or of all of them: equal on two peers iff they hold
        the same entries (up to a 2**-128 chance)."""
        if name is not None:
            return self._fingerprint(self._check_name(name))
        h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
        for n in sorted(self._crdts):
            h.update(n.encode() + b"\0" + self._fingerprint(n))
        return h.digest()

    def _fingerprint(self, name: str) -> bytes:
        fp = self._fingerprints.get(name)
        if fp is None:
            fp = self._fingerprints[name] = fingerprint_of(self._crdts[name].digest())
        return fp

    def bucket_fingerprints(self, name: str, count: int) -> list[bytes]:
        """One CRDT's fingerprints by owner bucket (crdt/fingerprints.py), cached until it changes."""
        cached = self._bucket_fps.get(name)
        if cached is None or cached[0] != count:
            cached = self._bucket_fps[name] = (
                count,
                bucket_fingerprints(self._crdts[self._check_name(name)].digest(), count),
            )
        return cached[1]

    def _changed(self, name: str) -> None:
        self._fingerprints.pop(name, None)
        self._bucket_fps.pop(name, None)

    def _check_name(self, name: str) -> str:
        if name not in self._crdts:
            raise CrdtError(f"this replica keeps no CRDT named {name!r}; it keeps {self.names}")
        return name

    # --- subscriptions --------------------------------------------------------------------------

    def on_change(self, callback: Callable[[ChangeEvent], None]) -> None:
        """Call `callback(event)` after every change, inline: it must be quick and not block."""
        self._callbacks.append(callback)

    def subscribe(self, buffer: int | None = None) -> trio.MemoryReceiveChannel[ChangeEvent]:
        """A channel of change events; close it to unsubscribe. Full channels drop (counted)."""
        send, receive = trio.open_memory_channel[ChangeEvent](buffer or self.config.event_buffer)
        self._subscribers.append(send)
        return receive

    def _emit(self, event: ChangeEvent) -> None:
        for callback in list(self._callbacks):
            try:
                callback(event)
            except Exception as e:  # a subscriber's bug must not break merging
                log.warning(kv("crdt change callback failed", crdt=event.crdt, error=repr(e)))
        for channel in list(self._subscribers):
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                self.stats.events_dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(channel)

    # --- writing --------------------------------------------------------------------------------

    def write(self, name: str, mutate: Callable[[Any, Any], SignedEntry | None]) -> SignedEntry | None:
        """Apply `mutate(crdt, identity)` — a mutator such as `lambda c, me: c.increment(me, 5)` —
        and queue the resulting entry for gossip. Returns the entry (None if nothing was written).
        (`crdt` is typed Any: its class is the one `name`'s spec gives.)

        The mutator runs on a copy first, and the entry must pass the same checks other peers
        will apply (the spec's `check`, the size limit), so a write that fails (`CrdtError`,
        `NotAWriter`, `EntryTooLarge`) leaves the state unchanged. Never blocks.
        """
        crdt = self._crdts[self._check_name(name)]
        trial = crdt.copy()
        entry = mutate(trial, self.identity)
        if entry is None:
            return None
        if not isinstance(entry, SignedEntry) or entry.owner != self.me:
            raise CrdtError("a mutator must return this peer's new SignedEntry (or None)")
        check = self._specs[name].check
        if check is not None:  # the rules every peer applies: fail here, not silently there
            check(entry)
        size = entry_wire_size(entry)
        if size > MAX_ENTRY_BYTES:
            raise EntryTooLarge(
                f"writing {name!r} would make this peer's entry {size} bytes; the limit is "
                f"{MAX_ENTRY_BYTES} (keep per-peer CRDT contributions small)"
            )
        outcome = crdt.apply([entry])  # the signature is cached from signing: no re-verification
        if outcome.rejected:  # the type refused its own mutator's output: a bug, not peer input
            raise CrdtError(f"write to {name!r} rejected: {outcome.rejected[0].reason}")
        self._written_here.add(name)
        self.stats.writes += 1
        if outcome.accepted:
            self._changed(name)
            self.gossip.queue(name, outcome.accepted)
            self._emit(ChangeEvent(name, outcome.accepted, "local", self.me))
        return entry

    # --- merging --------------------------------------------------------------------------------

    def install_gate(self, gate: Callable[[str, SignedEntry], str | None], *, park_reasons: Iterable[str] = ()) -> None:
        """From now on keep only the arriving entries that `gate(crdt name, entry)` passes (it
        returns None, or the reason it refuses; our own entries are never asked about). A refusal
        for one of `park_reasons` is parked and merged again once another entry was accepted (module
        docstring, "Gate"). The gate must not raise (if it does, the entry is refused as
        `gate-failed`) and must depend only on replicated state, so that a refused entry is taken
        when anti-entropy offers it again. A replica has one gate: a second is a `CrdtError`."""
        if self._gate is not None:
            raise CrdtError("this replica already has a gate")
        self._gate = gate
        self._park_reasons = frozenset(park_reasons)

    def merge_entries(
        self, name: str, entries: Iterable[SignedEntry], source: Source, peer: str | None
    ) -> MergeOutcome:
        """Merge untrusted entries into CRDT `name`: the spec's rules and size limit first, then
        the type's checks (`SignedCrdt.apply`). Emits a `ChangeEvent`; entries accepted through
        anti-entropy are queued for gossip (see the module docstring for why only those)."""
        crdt = self._crdts[self._check_name(name)]
        check = self._specs[name].check
        gate = self._gate
        candidates: list[SignedEntry] = []
        rejected: list[Rejection] = []
        refused: list[Rejection] = []
        for entry in entries:
            held = crdt.entry(entry.owner)
            if held is not None and entry.order_key <= held.order_key:
                continue  # nothing new: not worth checking
            if entry_wire_size(entry) > MAX_ENTRY_BYTES:
                rejected.append(Rejection(entry, f"entry larger than {MAX_ENTRY_BYTES} bytes"))
                continue
            if check is not None:
                try:
                    check(entry)
                except CrdtError as e:
                    rejected.append(Rejection(entry, f"malformed {name} entry: {e}"))
                    continue
            if gate is not None and entry.owner != self.me:
                reason = self._gate_reason(gate, name, entry)
                if reason is not None:
                    refused.append(Rejection(entry, reason))
                    if reason in self._park_reasons:
                        self._park(name, entry, source, peer)
                    continue
            candidates.append(entry)
        outcome = crdt.apply(candidates)
        rejected.extend(outcome.rejected)
        if rejected:
            self._count_rejections(name, rejected, source, peer)
        if refused:
            if not self._retrying:  # a parked entry refused again was counted when it came
                self._count_refusals(name, refused, source, peer)
            rejected.extend(refused)  # callers treat them alike: not relayed, not stored
        if outcome.accepted:
            self._changed(name)
            self.stats.entries_accepted += len(outcome.accepted)
            own_superseded = any(e.owner == self.me for e in outcome.accepted)
            if own_superseded:
                self.stats.own_superseded += 1
                if name in self._written_here:
                    log.warning(
                        kv(
                            "an earlier incarnation's entry superseded our writes; rewrite them",
                            crdt=name,
                            peer=self.me,
                        )
                    )
            if source == "anti-entropy":
                self.stats.entries_regossiped += len(outcome.accepted)
                self.gossip.queue(name, outcome.accepted)
            self._emit(ChangeEvent(name, outcome.accepted, source, peer, own_superseded))
            self._retry_parked()
        return MergeOutcome(outcome.accepted, tuple(rejected))

    def merge_batches(self, batches: Iterable[tuple[str, list[SignedEntry]]], source: Source, peer: str | None) -> int:
        """Merge one message's or reply's batches (crdt name, entries) with `merge_entries`, in the
        order of the replica's specs: the CRDTs a `gate` reads merge first. Returns how many
        entries were rejected or refused."""
        rank = {name: i for i, name in enumerate(self._specs)}
        ordered = sorted(batches, key=lambda batch: rank.get(batch[0], len(rank)))
        return sum(len(self.merge_entries(name, entries, source, peer).rejected) for name, entries in ordered)

    def _park(self, name: str, entry: SignedEntry, source: Source, peer: str | None) -> None:
        key = (name, entry.owner)
        held = self._parked.pop(key, None)
        if held is not None and held[0].order_key > entry.order_key:
            entry, source, peer = held  # keep the newer one
        self._parked[key] = (entry, source, peer)
        while len(self._parked) > MAX_PARKED:
            del self._parked[next(iter(self._parked))]

    def _retry_parked(self) -> None:
        """Merge the parked refusals again (the entries just accepted may be what the gate was
        waiting for: a joiner's membership record). Each goes back through the gate, and one that
        is still refused is parked again; nothing recurses past one level per acceptance."""
        if not self._parked or self._retrying:
            return
        self._retrying = True
        try:
            parked, self._parked = self._parked, {}
            for (name, _), (entry, source, peer) in parked.items():
                self.merge_entries(name, [entry], source, peer)
        finally:
            self._retrying = False

    def _gate_reason(self, gate: Callable[[str, SignedEntry], str | None], name: str, entry: SignedEntry) -> str | None:
        try:
            return gate(name, entry)
        except Exception as e:  # a gate's bug must not break merging: refuse (it comes again)
            log.warning(kv("crdt gate failed", crdt=name, error=repr(e)))
            return "gate-failed"

    def _count_refusals(self, name: str, refused: list[Rejection], source: Source, peer: str | None) -> None:
        self.stats.entries_refused += len(refused)
        _tally(self.stats.refusals_by_reason, (r.reason for r in refused))
        first = refused[0]
        log.debug(
            kv(
                "refused CRDT entries",
                crdt=name,
                count=len(refused),
                source=source,
                peer=peer,
                owner=first.entry.owner,
                reason=first.reason,
            )
        )

    def _count_rejections(self, name: str, rejected: list[Rejection], source: Source, peer: str | None) -> None:
        self.stats.entries_rejected += len(rejected)
        _tally(self.stats.rejections_by_reason, (r.reason.split(":")[0] for r in rejected))
        first = rejected[0]
        self._warn.warning(
            f"reject:{peer}",
            kv(
                "rejected CRDT entries",
                crdt=name,
                count=len(rejected),
                source=source,
                peer=peer,
                owner=first.entry.owner,
                seq=first.entry.seq,
                reason=first.reason,
            ),
        )

    # --- syncing ------------------------------------------------------------------------------

    async def recover(self, timeout: float = DEFAULT_RECOVER_TIMEOUT) -> bool:
        """Pull the swarm's state — our own earlier entries included — before writing
        (`AntiEntropy.recover`). Returns True once one exchange completed, False if no peer
        answered within `timeout` (e.g. the first peer of a swarm)."""
        return await self.anti_entropy.recover(timeout)

    @property
    def recovered(self) -> trio.Event:
        """Set once `recover` completed an exchange."""
        return self.anti_entropy.recovered

    async def flush(self, timeout: float = DEFAULT_FLUSH_TIMEOUT, peers: int = 2, first: Sequence[str] = ()) -> int:
        """Publish pending gossip now and hand our state to up to `peers` connected peers by
        anti-entropy (they re-gossip what was new to them): those of `first` that are connected,
        in its order, then others at random. Returns how many peers confirmed within `timeout`.
        The exchanges run side by side: a peer that does not answer (stopped, its link cut)
        holds none of the others. For a clean shutdown: a gossip publish alone may still sit in
        a send queue when the host closes."""
        confirmed = 0

        async def exchange(peer: str) -> None:
            nonlocal confirmed
            confirmed += await self.anti_entropy.exchange_with(peer)

        with trio.move_on_after(timeout):
            await self.gossip.publish_pending()
            connected = self.anti_entropy.candidate_peers()
            chosen = [p for p in dict.fromkeys(first) if p in connected][:peers]
            rest = [p for p in connected if p not in chosen]
            random.shuffle(rest)
            async with trio.open_nursery() as nursery:
                for peer in [*chosen, *rest][:peers]:
                    nursery.start_soon(exchange, peer)
        return confirmed

    def _open_gossip_streams(self) -> None:
        """Before each anti-entropy tick: gossip streams to connected peers gossipsub missed."""
        self.gossip.ensure_pubsub_peers()

    # --- lifecycle ------------------------------------------------------------------------------

    async def _start(self, stack: AsyncExitStack) -> None:
        if self._started:
            raise CrdtError("a Replica runs once; make a new one (its state can be merged in)")
        self._started = True
        await stack.enter_async_context(self.gossip)
        await stack.enter_async_context(self.anti_entropy)
        log.info(kv("crdt replica started", swarm=self.namespace, peer=self.me, crdts=self.names))

    @property
    def topic(self) -> str:
        """The gossipsub topic of the swarm's deltas."""
        return self.gossip.topic

    @property
    def pubsub(self) -> Pubsub | None:
        """The py-libp2p `Pubsub` in use (for diagnostics and benchmarks)."""
        return self.gossip.pubsub


__all__ = [
    "MAX_ENTRY_BYTES",
    "ChangeEvent",
    "CrdtSpec",
    "EntryTooLarge",
    "Replica",
    "ReplicaConfig",
    "ReplicaStats",
]
