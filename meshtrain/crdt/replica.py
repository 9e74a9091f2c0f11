"""`Replica`: keeps one swarm's named CRDTs in sync among its peers (gossip push, anti-entropy pull).

The problem. Every peer holds the swarm's shared state (membership, progress, metrics, config) as
signed CRDTs (`types.py`). A local write must reach every peer quickly, and a peer that missed
messages (it was partitioned, restarted, or a gossip message was dropped) must catch up without a
leader. Peers are untrusted: anything that arrives may be forged, tampered, oversized or garbage.

Design.
- **Push (fast path): gossipsub**, one topic per swarm (`/meshtrain/<swarm>/crdt/1`). A local
  write signs the owner's next entry (the entry *is* the delta); entries written within
  `publish_delay` are coalesced (per CRDT only the owner's latest entry matters) and published
  as `[GOSSIP_VERSION, namespace, [[crdt name, entry batch], ...]]` (each batch is
  `encode_entries` output) in messages of at most `max_gossip_payload` = 56 KiB. Why so small:
  py-libp2p drops pubsub RPCs above 1 MiB silently, and it splits a write above 64 KiB into
  several yamux frames that its pubsub — several tasks write one stream without a lock — can
  interleave with another message, corrupting the stream. Big deltas are split.
- **Merging happens in the topic validator.** py-libp2p calls a sync topic validator before it
  marks a message seen and forwards it; ours decodes the message within size limits, merges it
  (signature, owner, allow-list and body rules are the types' checks plus the spec's `check`)
  and answers whether to relay it: a message with any rejected entry is not relayed, so honest
  peers never amplify a hostile publisher (gossipsub's own signature check already binds each
  message to its publisher). Entries accepted from gossip are *not* re-published: gossipsub
  floods the original message through the mesh, and re-publishing would multiply every message
  by the swarm size.
- **Pull (repair path): anti-entropy** every `anti_entropy_interval` (±`anti_entropy_jitter`)
  with one random *currently connected* peer, and at once with every newly connected peer (a
  reconnection is when two peers most likely differ: a healed partition, a restart). The replica
  never dials: it checks the connection before each RPC, because py-libp2p's `new_stream`
  silently re-dials a peer from its address book, so a partition stays a partition until the
  transport reconnects. Two RPCs: `crdt/digest` sends a 16-byte fingerprint per CRDT and gets
  back the full digest (owner -> (seq, signature prefix)) of only the CRDTs that differ — one
  small RPC when in sync; `crdt/pull` then pushes what the peer lacks and pulls what we lack
  (`delta_since`) in batches of at most `max_rpc_entries_bytes` (512 KiB; RPC frames are capped
  at 1 MiB), repeating while the peer says `more`. Entries accepted through anti-entropy *are*
  re-gossiped: nobody flooded them on this side of a healed partition, and the first peer to
  pull them spreads them to its whole side in one gossip round instead of many exchanges.
- **Hostile input** is decoded only within size limits and raises only `CrdtError`s; rejected
  entries and undecodable messages are counted in `stats` and logged (rate-limited); nothing a
  peer sends can raise out of a validator or an RPC handler. An entry whose encoding exceeds
  `MAX_ENTRY_BYTES` is refused everywhere (the same deterministic rule on every replica, so they
  still converge), which bounds every message this module produces. py-libp2p's own pubsub
  stream handler is wrapped: unwrapped, one malformed frame from any peer kills the host.
- **Gate: whose records we keep at all.** Signatures bind an entry to its owner, but an identity
  costs nothing: a stranger can mint thousands and sign a record with each. The type and spec
  rules cannot see that (they are pure functions of one entry), so the replica takes a `gate`
  (set by `SwarmView` when the swarm has an admission rule): `(crdt name, entry) -> reason or
  None`, asked after the spec's checks and before the signature, for every entry that arrives
  (never for our own). A refused entry is not stored, not re-gossiped, and makes its gossip
  message not relayed; it is counted in `stats.refusals_by_reason` (the status document's
  `refused`), logged at debug level only (a joiner's records are refused for a moment in normal
  operation). Refusing is safe because the gate only depends on other replicated state (the
  entry owner's membership record, the swarm owner's config) and anti-entropy is digest-based: an entry we
  refused stays in our partner's digest and not in ours, so every exchange with a peer that holds
  it (its owner always does) offers it again, and once the state the gate reads has arrived it is
  taken. That can be one anti-entropy period late, which a swarm taking a round per step (dp)
  feels: a joiner's progress that arrived a moment before its membership record would keep it
  out of rounds until the next exchange. So the latest entry of each owner and CRDT refused for
  one of `park_reasons` (set with the gate: a missing membership record) is parked (at most `MAX_PARKED` in all, the oldest evicted; an entry parked twice replaces itself,
  so a stranger cannot grow it) and merged again, through the gate, whenever some other entry
  was accepted. Within one message or reply, batches are merged in the order of the replica's
  specs, so list the CRDTs the gate reads first (`swarm_specs` does). Cost: while peers disagree about the
  gate's inputs their fingerprints differ, and anti-entropy sends digests instead of one
  fingerprint; a refused entry also travels again on each such exchange (bounded by the RPC
  limits, as before).
- **Restarts.** A peer that restarts with the same identity but no state would restart its seqs
  at 1 and lose to its own older entries (`base.py`). `recover()` pulls the swarm's state from
  up to `recover_peers` connected peers before the caller writes; if an entry of ours arrives
  later anyway (we started alone and met the swarm afterwards), the `ChangeEvent` carries
  `own_superseded=True` so the writer can write again on top (`SwarmView` does).
- **Subscriptions**: `on_change(callback)` (called inline, must not block) and `subscribe()` (a
  bounded trio channel of `ChangeEvent`s; a full channel drops events and counts them — the
  state itself is always readable, so a slow consumer re-reads it rather than blocking merges).

Lifecycle: `async with Replica(host, swarm_id, specs) as replica:` starts gossipsub (unless a
running `Pubsub` is passed in), the RPC handlers, and four tasks in the replica's nursery (drain
the subscription, publish, anti-entropy ticks, greeting new connections); leaving cancels them
and stops gossipsub.

Not here: the CRDT types and merge rules (`types.py`, `base.py`), what the swarm's state means
(`swarm_view.py`), dialling and peer discovery (transport, dht). One replica per host: gossipsub
registers host-wide protocol handlers, and so do the `crdt/*` RPCs.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from typing import Any, Literal

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from meshtrain.crdt.base import SignedCrdt
from meshtrain.crdt.entries import (
    SIGNATURE_BYTES,
    CrdtError,
    Digest,
    MalformedCrdtData,
    MergeOutcome,
    Rejection,
    SignatureCache,
    SignedEntry,
    digest_from_wire,
    digest_to_wire,
    unpack_envelope,
)
from meshtrain.crdt.types import CRDT_TYPES
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import packb, packb_canonical
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcError, RpcUnavailable
from meshtrain.transport.validate import MALFORMED, UNAVAILABLE, WRONG_SWARM, require_map

log = get_logger(__name__)

GOSSIP_VERSION = 1
RPC_DIGEST = "crdt/digest"
RPC_PULL = "crdt/pull"

MAX_GOSSIP_PAYLOAD = 56 << 10  # per gossip message: one yamux frame (64 KiB) with the envelope
MAX_RPC_ENTRIES_BYTES = 512 << 10  # entries per anti-entropy request or reply (RPC cap: 1 MiB)
MAX_ENTRY_BYTES = 48 << 10  # one entry, encoded; fits a gossip message with room to spare
MAX_PARKED = 256  # refused entries kept for another try once the gate's inputs change (see Gate)
_YAMUX_FRAME_PAYLOAD = (64 << 10) - 12 - 2048  # minus yamux header and pubsub envelope
MAX_RPC_REQUEST = 1 << 20
FINGERPRINT_BYTES = 16
_ENTRY_OVERHEAD = SIGNATURE_BYTES + 32  # msgpack framing of [owner, seq, body, signature], roughly
_SPLIT_MARGIN = 1024  # slack under every size limit for framing the estimates leave out

DEFAULT_ANTI_ENTROPY_INTERVAL = 1.5
DEFAULT_ANTI_ENTROPY_JITTER = 0.3  # fraction of the interval, so peers do not tick in lockstep
DEFAULT_RPC_TIMEOUT = 5.0
DEFAULT_PUBLISH_DELAY = 0.01  # writes within 10 ms share one gossip message
DEFAULT_RECOVER_TIMEOUT = 5.0
DEFAULT_FLUSH_TIMEOUT = 2.0
_RETRY_AFTER = 10.0  # seconds before retrying a peer that would not speak gossipsub or crdt RPCs
_PUBSUB_GRACE = 3.0  # seconds py-libp2p gets to open a gossip stream to a new peer by itself
_LOG_EVERY = 10.0  # seconds between repeated warnings about the same peer

Source = Literal["local", "gossip", "anti-entropy"]


def gossip_topic(namespace: str) -> str:
    """The gossipsub topic that carries a swarm's CRDT deltas."""
    return f"/meshtrain/{namespace}/crdt/1"


class _NotConnected(RpcError):
    """The chosen anti-entropy partner is no longer connected (we do not dial)."""


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
        if not MAX_ENTRY_BYTES + 1024 <= self.max_gossip_payload <= _YAMUX_FRAME_PAYLOAD:
            raise CrdtError(
                f"max_gossip_payload must be in {MAX_ENTRY_BYTES + 1024}..{_YAMUX_FRAME_PAYLOAD} "
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


class _RateLimitedLog:
    """One warning per key per `_LOG_EVERY` seconds, so a hostile peer cannot flood our logs."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def warning(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -math.inf) < _LOG_EVERY:
            return
        if len(self._last) > 4096:
            self._last.clear()
        self._last[key] = now
        log.warning(message)


def entry_wire_size(entry: SignedEntry) -> int:
    """Close upper estimate of an entry's encoded size (exact to within a few bytes)."""
    return len(entry.owner) + len(entry.body_bytes) + _ENTRY_OVERHEAD


def fingerprint_of(digest: Digest) -> bytes:
    """A 16-byte hash of a digest: equal digests, equal fingerprints."""
    return hashlib.blake2b(packb_canonical(digest_to_wire(digest)), digest_size=FINGERPRINT_BYTES).digest()


def _beats(theirs: tuple[int, bytes], mine: SignedEntry | None) -> bool:
    seq, prefix = theirs
    return mine is None or (seq, prefix) > (mine.seq, mine.signature[: len(prefix)])


class Replica(Service):
    """The swarm's CRDTs on this peer, kept in sync with its connected peers.

    Parameters:
    - `host`: the running `Host`; its identity signs our writes, its RPC layer serves `crdt/*`.
    - `namespace`: the swarm id; bound into every entry's signature and the gossip topic.
    - `specs`: the CRDTs to keep (`CrdtSpec`); every peer of a swarm must use the same specs.
    - `config`: timing and limits (`ReplicaConfig`).
    - `pubsub`: a running py-libp2p `Pubsub` to share; by default the replica runs its own.
    - `cache`: a `SignatureCache` (default: the process-wide one).

    `gate` (attribute, default None): `(crdt name, entry) -> reason | None`, whose entries the
    replica keeps at all (module docstring); it must not raise, and it must depend only on
    replicated state, so that a refused entry is taken when anti-entropy offers it again.

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
        self.topic = gossip_topic(namespace)
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
        self._outbox: dict[str, dict[str, SignedEntry]] = {}
        self._outbox_ready = trio.Event()
        self._subscribers: list[trio.MemorySendChannel[ChangeEvent]] = []
        self._callbacks: list[Callable[[ChangeEvent], None]] = []
        self._written_here: set[str] = set()  # CRDTs we wrote to in this process
        self._pubsub = pubsub
        self._owns_pubsub = pubsub is None
        self._pubsub_pending: set[str] = set()
        self._pubsub_failed: dict[str, float] = {}
        self._ae_unavailable: dict[str, float] = {}  # peers that do not serve crdt RPCs
        self._connected_since: dict[str, float] = {}  # peers that connected while we ran
        self._started = False
        self._nursery: trio.Nursery | None = None
        self._running = False
        self._warn = _RateLimitedLog()
        self.recovered = trio.Event()
        self.stats = ReplicaStats()
        self.gate: Callable[[str, SignedEntry], str | None] | None = None
        self.park_reasons: frozenset[str] = frozenset()  # the gate's refusals worth another try
        # (crdt, owner) -> (entry, source, peer): the gate's latest refusals, tried again later
        self._parked: dict[tuple[str, str], tuple[SignedEntry, Source, str | None]] = {}
        self._retrying = False

    # --- reading --------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return sorted(self._crdts)

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

    def _in_spec_order(self, batches: Iterable[tuple[str, list[SignedEntry]]]) -> list[tuple[str, list[SignedEntry]]]:
        """Batches in the order of the replica's specs: the CRDTs a `gate` reads merge first."""
        rank = {name: i for i, name in enumerate(self._specs)}
        return sorted(batches, key=lambda batch: rank.get(batch[0], len(rank)))

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

    def write(self, name: str, mutate: Callable[[SignedCrdt, Any], SignedEntry | None]) -> SignedEntry | None:
        """Apply `mutate(crdt, identity)` — a mutator such as `lambda c, me: c.increment(me, 5)` —
        and queue the resulting entry for gossip. Returns the entry (None if nothing was written).

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
            self._fingerprints.pop(name, None)
            self._queue_gossip(name, outcome.accepted)
            self._emit(ChangeEvent(name, outcome.accepted, "local", self.me))
        return entry

    def _queue_gossip(self, name: str, entries: Iterable[SignedEntry]) -> None:
        pending = self._outbox.setdefault(name, {})
        for entry in entries:
            held = pending.get(entry.owner)
            if held is None or entry.order_key > held.order_key:
                pending[entry.owner] = entry
        self._outbox_ready.set()

    # --- merging --------------------------------------------------------------------------------

    def merge_entries(
        self, name: str, entries: Iterable[SignedEntry], source: Source, peer: str | None
    ) -> MergeOutcome:
        """Merge untrusted entries into CRDT `name`: the spec's rules and size limit first, then
        the type's checks (`SignedCrdt.apply`). Emits a `ChangeEvent`; entries accepted through
        anti-entropy are queued for gossip (see the module docstring for why only those)."""
        crdt = self._crdts[self._check_name(name)]
        check = self._specs[name].check
        gate = self.gate
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
                    if reason in self.park_reasons:
                        self._park(name, entry, source, peer)
                    continue
            candidates.append(entry)
        outcome = crdt.apply(candidates)
        rejected.extend(outcome.rejected)
        if rejected:
            self._count_rejections(name, rejected, source, peer)
        if refused:
            self._count_refusals(name, refused, source, peer)
            rejected.extend(refused)  # callers treat them alike: not relayed, not stored
        if outcome.accepted:
            self._fingerprints.pop(name, None)
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
                self._queue_gossip(name, outcome.accepted)
            self._emit(ChangeEvent(name, outcome.accepted, source, peer, own_superseded))
            self._retry_parked()
        return MergeOutcome(outcome.accepted, tuple(rejected))

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

    # --- gossip ---------------------------------------------------------------------------------

    def _validate_gossip(self, forwarder: ID, message: Any) -> bool:
        """py-libp2p's topic validator: merge the message; relay it only if nothing was rejected.

        Must never raise: an exception here would propagate into py-libp2p's pubsub task.
        """
        try:
            return self._on_gossip(forwarder, message)
        except Exception as e:
            self.stats.gossip_invalid += 1
            log.warning(kv("gossip message handling failed", error=repr(e)))
            return False

    def _on_gossip(self, forwarder: ID, message: Any) -> bool:
        origin = ID(message.from_id).to_base58()
        if origin == self.me:
            return True  # our own publish: its entries are merged already
        self.stats.gossip_received += 1
        try:
            batches = decode_gossip(message.data, self.namespace, self._crdts, self.config.max_gossip_payload)
        except MalformedCrdtData as e:
            self.stats.gossip_invalid += 1
            self._warn.warning(
                f"gossip:{origin}",
                kv("undecodable CRDT gossip", origin=origin, via=forwarder.to_base58(), error=e),
            )
            return False
        relay = True
        for name, entries in self._in_spec_order(batches):
            if self.merge_entries(name, entries, "gossip", origin).rejected:
                relay = False
        if not relay:
            self.stats.gossip_invalid += 1
        return relay

    async def _drain_subscription(self, subscription: Any) -> None:
        # Messages were merged by the validator; the subscription channel (32 deep in py-libp2p)
        # only has to be emptied so that py-libp2p does not log and drop.
        async for _ in subscription:
            pass

    async def _publish_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            await trio.sleep(self.config.publish_delay)
            await self._publish_pending()

    async def _publish_pending(self) -> None:
        self._outbox_ready = trio.Event()
        outbox, self._outbox = self._outbox, {}
        if self._pubsub is None or not outbox:
            return
        for payload in self._gossip_payloads(outbox):
            try:
                await self._pubsub.publish(self.topic, payload)
            except Exception as e:  # anti-entropy delivers what gossip could not
                self.stats.gossip_publish_failed += 1
                log.debug(kv("gossip publish failed", error=repr(e)))
                continue
            self.stats.gossip_published += 1
            self.stats.gossip_bytes_published += len(payload)

    def _gossip_payloads(self, outbox: Mapping[str, Mapping[str, SignedEntry]]) -> list[bytes]:
        batches = {name: list(by_owner.values()) for name, by_owner in outbox.items()}
        budget = self.config.max_gossip_payload - _SPLIT_MARGIN  # the sizes are estimates
        return [encode_gossip(self.namespace, chunk, self._crdts) for chunk in split_batches(batches, budget)]

    # --- anti-entropy: client -------------------------------------------------------------------

    def _candidate_peers(self) -> list[str]:
        """Connected peers for anti-entropy; those that recently did not serve `crdt/*` for
        our swarm only if there is nobody else. (Not filtered by gossip subscription: a peer
        whose gossip stream failed to come up is exactly one anti-entropy must still reach.)"""
        connected = self.host.connected_peers()
        now = time.monotonic()
        serving = [p for p in connected if now - self._ae_unavailable.get(p, -math.inf) >= _RETRY_AFTER]
        return serving or connected

    async def anti_entropy_with(self, peer: str, *, mark_unavailable: bool = True) -> bool:
        """One exchange with `peer`: compare fingerprints, then push and pull what differs.

        Returns True if the exchange completed (the peer answered well-formed replies).
        `mark_unavailable`: if the peer turns out not to serve us, skip it for a while.
        """
        fps = {name: self._fingerprint(name) for name in self._crdts}
        try:
            reply = await self._call(peer, RPC_DIGEST, {"ns": self.namespace, "fp": fps})
            theirs = _parse_digest_reply(reply, self._crdts)
        except (RpcError, MalformedCrdtData) as e:
            return self._ae_failed(peer, e, mark_unavailable)
        push: dict[str, list[SignedEntry]] = {}
        want: set[str] = set()
        for name, digest in theirs.items():
            crdt = self._crdts[name]
            missing = crdt.delta_since(digest)
            if missing:
                push[name] = missing
            if any(_beats(v, crdt.entry(owner)) for owner, v in digest.items()):
                want.add(name)
        for _ in range(self.config.max_pull_rounds):
            if not push and not want:
                break
            chunk, push = _take(push, self.config.max_rpc_entries_bytes - _SPLIT_MARGIN)
            request = {
                "ns": self.namespace,
                "d": {n: digest_to_wire(self._crdts[n].digest()) for n in sorted(want)},
                "p": {n: self._crdts[n].encode_entries(es) for n, es in chunk.items()},
            }
            try:
                reply = await self._call(peer, RPC_PULL, request)
                pulled, more = _parse_pull_reply(reply, self._crdts, self.config.max_rpc_entries_bytes + (64 << 10))
            except (RpcError, MalformedCrdtData) as e:
                return self._ae_failed(peer, e, mark_unavailable)
            self.stats.ae_entries_pushed += sum(len(es) for es in chunk.values())
            for name, entries in self._in_spec_order(pulled.items()):
                self.stats.ae_entries_pulled += len(entries)
                self.merge_entries(name, entries, "anti-entropy", peer)
            if not more:
                want = set()
        self.stats.ae_exchanges += 1
        return True

    async def _call(self, peer: str, name: str, request: Any) -> Any:
        # py-libp2p's new_stream dials a peer it has no connection to; check first, so that
        # anti-entropy never re-opens a link that was closed (that would undo a partition).
        if not self.host.is_connected(peer):
            raise _NotConnected(f"{peer} is not connected")
        self.stats.ae_rpcs_sent += 1
        return await self.host.rpc.call(peer, name, request, timeout=self.config.rpc_timeout)

    def _ae_failed(self, peer: str, error: Exception, mark_unavailable: bool = True) -> bool:
        self.stats.ae_failed += 1
        not_serving = (isinstance(error, RpcUnavailable) and self.host.is_connected(peer)) or (
            isinstance(error, RemoteError) and error.code in (WRONG_SWARM, UNAVAILABLE)
        )
        if mark_unavailable and not_serving:  # prefer other peers for a while
            self._ae_unavailable[peer] = time.monotonic()
            if len(self._ae_unavailable) > 4096:
                self._ae_unavailable.clear()
        if isinstance(error, MalformedCrdtData) or (isinstance(error, RemoteError) and error.code == "malformed"):
            self._warn.warning(f"ae:{peer}", kv("anti-entropy failed", peer=peer, error=error))
        else:
            log.debug(kv("anti-entropy failed", peer=peer, error=error))
        return False

    async def _anti_entropy_loop(self) -> None:
        cfg = self.config
        while True:
            jitter = random.uniform(1 - cfg.anti_entropy_jitter, 1 + cfg.anti_entropy_jitter)
            await trio.sleep(cfg.anti_entropy_interval * jitter)
            self._ensure_pubsub_peers()
            peers = self._candidate_peers()
            if peers:
                await self.anti_entropy_with(random.choice(peers))

    async def _watch_connections(self) -> None:
        """Greet every newly connected peer with an anti-entropy exchange right away.

        A (re)connection is when two peers are most likely to differ — a healed partition, a
        restarted or new peer — so waiting for the next random tick would only delay the
        repair. Of the two ends, the one with the smaller peer id starts the exchange (one
        exchange per connection, not two); the other's periodic ticks cover a failure.
        """
        known: set[str] = set(self.host.connected_peers())
        while True:
            await self.host.wait_until(lambda known=known: set(self.host.connected_peers()) != known)
            current = set(self.host.connected_peers())
            new = current - known
            known = current
            now = time.monotonic()
            for peer in new:
                self._connected_since[peer] = now
            for peer in [p for p in self._connected_since if p not in current]:
                del self._connected_since[peer]
            if not new or self._nursery is None:
                continue
            for peer in sorted(new):
                if self.me < peer:
                    self._nursery.start_soon(self._greet, peer)

    async def _greet(self, peer: str) -> None:
        await trio.sleep(0.05)  # the new connection's muxer may still be settling
        await self.anti_entropy_with(peer, mark_unavailable=False)

    async def recover(self, timeout: float = DEFAULT_RECOVER_TIMEOUT) -> bool:
        """Pull the swarm's state — our own earlier entries included — before writing.

        Waits (up to `timeout`) for a connected peer, then runs anti-entropy with up to
        `recover_peers` of them. Returns True (and sets `recovered`) once one exchange completed;
        False if no peer answered in time (e.g. the first peer of a swarm).
        """
        with trio.move_on_after(timeout):
            while True:
                peers = self._candidate_peers()
                random.shuffle(peers)
                ok = False
                for peer in peers[: self.config.recover_peers]:
                    ok = await self.anti_entropy_with(peer) or ok
                if ok:
                    self.recovered.set()
                    return True
                await trio.sleep(0.1)
        return False

    async def flush(self, timeout: float = DEFAULT_FLUSH_TIMEOUT, peers: int = 2) -> int:
        """Publish pending gossip now and hand our state to up to `peers` connected peers by
        anti-entropy (they re-gossip what was new to them). Returns how many peers confirmed.
        For a clean shutdown: a gossip publish alone may still sit in a send queue when the
        host closes."""
        confirmed = 0
        with trio.move_on_after(timeout):
            await self._publish_pending()
            candidates = self._candidate_peers()
            random.shuffle(candidates)
            for peer in candidates[:peers]:
                confirmed += await self.anti_entropy_with(peer)
        return confirmed

    # --- anti-entropy: server -------------------------------------------------------------------

    def _check_request(self, request: Any, *fields: str) -> dict[str, Any]:
        if not self._running:
            raise RemoteError(UNAVAILABLE, "replica is not running")
        request = require_map(request, "ns", *fields, what="anti-entropy request")
        if request["ns"] != self.namespace:
            raise RemoteError(WRONG_SWARM, f"this peer replicates swarm {self.namespace!r}")
        return request

    async def _serve_digest(self, peer: str, request: Any) -> Any:
        self.stats.ae_rpcs_served += 1
        fps = self._check_request(request, "fp")["fp"]
        if not isinstance(fps, dict) or len(fps) > 4 * len(self._crdts) + 16:
            raise RemoteError(MALFORMED, "fp must be a small map of CRDT name -> fingerprint")
        return {
            "d": {
                name: digest_to_wire(crdt.digest())
                for name, crdt in self._crdts.items()
                if fps.get(name) != self._fingerprint(name)
            }
        }

    async def _serve_pull(self, peer: str, request: Any) -> Any:
        self.stats.ae_rpcs_served += 1
        request = self._check_request(request, "d", "p")
        digests, pushed = request["d"], request["p"]
        if not isinstance(digests, dict) or not isinstance(pushed, dict):
            raise RemoteError(MALFORMED, "d and p must be maps keyed by CRDT name")
        rejected = 0
        limit = self.config.max_rpc_entries_bytes + (64 << 10)
        decoded: list[tuple[str, list[SignedEntry]]] = []
        for name, data in pushed.items():
            crdt = self._crdts.get(name) if isinstance(name, str) else None
            if crdt is None or not isinstance(data, bytes):
                raise RemoteError(MALFORMED, f"p: unknown CRDT {name!r:.60} or not bytes")
            try:
                decoded.append((name, crdt.decode_entries(data, max_size=limit)))
            except MalformedCrdtData as e:
                self._warn.warning(f"ae:{peer}", kv("undecodable pushed entries", peer=peer, error=e))
                raise RemoteError(MALFORMED, str(e)) from None
        for name, entries in self._in_spec_order(decoded):
            rejected += len(self.merge_entries(name, entries, "anti-entropy", peer).rejected)
        wanted: dict[str, list[SignedEntry]] = {}
        for name, wire in digests.items():
            crdt = self._crdts.get(name) if isinstance(name, str) else None
            if crdt is None:
                continue  # a CRDT we do not keep: nothing to send
            try:
                delta = crdt.delta_since(digest_from_wire(wire))
            except MalformedCrdtData as e:
                raise RemoteError(MALFORMED, f"d[{name!r}]: {e}") from None
            if delta:
                wanted[name] = delta
        chunk, rest = _take(wanted, self.config.max_rpc_entries_bytes - _SPLIT_MARGIN)
        return {
            "e": {n: self._crdts[n].encode_entries(es) for n, es in chunk.items()},
            "more": bool(rest),
            "rejected": rejected,
        }

    # --- lifecycle ------------------------------------------------------------------------------

    def _ensure_pubsub_peers(self) -> None:
        """Open gossip streams to connected peers gossipsub does not know yet.

        py-libp2p's pubsub learns peers from connection events only: peers connected before it
        started, or whose gossipsub was not up when they connected, are otherwise never used.
        A fresh connection is left to py-libp2p for a few seconds (two concurrent
        registrations of one peer would leave a stray send loop behind).
        """
        if self._pubsub is None or self._nursery is None:
            return
        now = time.monotonic()
        known = {p.to_base58() for p in self._pubsub.peers}
        for peer in self.host.connected_peers():
            if peer in known or peer in self._pubsub_pending:
                continue
            if now - self._connected_since.get(peer, -math.inf) < _PUBSUB_GRACE:
                continue
            if now - self._pubsub_failed.get(peer, -math.inf) < _RETRY_AFTER:
                continue
            self._pubsub_pending.add(peer)
            self._nursery.start_soon(self._open_pubsub_stream, peer)

    async def _open_pubsub_stream(self, peer: str) -> None:
        pubsub = self._pubsub
        try:
            ok = pubsub is not None and await pubsub.ensure_peer_stream(ID.from_base58(peer), timeout=5.0)
        except Exception as e:
            log.debug(kv("gossip stream failed", peer=peer, error=repr(e)))
            ok = False
        finally:
            self._pubsub_pending.discard(peer)
        if not ok:
            self._pubsub_failed[peer] = time.monotonic()

    async def _start(self, stack: AsyncExitStack) -> None:
        if self._started:
            raise CrdtError("a Replica runs once; make a new one (its state can be merged in)")
        self._started = True
        if self._pubsub is None:
            self._pubsub = await _start_gossipsub(stack, self.host, self.config)
        pubsub = self._pubsub
        pubsub.set_topic_validator(self.topic, self._validate_gossip, False)
        stack.callback(pubsub.remove_topic_validator, self.topic)
        subscription = await pubsub.subscribe(self.topic)
        if not self._owns_pubsub:
            stack.push_async_callback(self._unsubscribe)
        self.host.rpc.serve(RPC_DIGEST, self._serve_digest, max_request=MAX_RPC_REQUEST)
        self.host.rpc.serve(RPC_PULL, self._serve_pull, max_request=MAX_RPC_REQUEST)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._drain_subscription, subscription)
        self._nursery.start_soon(self._publish_loop)
        self._nursery.start_soon(self._anti_entropy_loop)
        self._nursery.start_soon(self._watch_connections)
        self._ensure_pubsub_peers()
        self._running = True
        log.info(kv("crdt replica started", swarm=self.namespace, peer=self.me, crdts=self.names))

    async def _stop(self) -> None:
        self._running = False

    async def _unsubscribe(self) -> None:
        if self._pubsub is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                try:
                    await self._pubsub.unsubscribe(self.topic)
                except Exception as e:
                    log.debug(kv("gossip unsubscribe failed", error=repr(e)))

    @property
    def pubsub(self) -> Pubsub | None:
        """The py-libp2p `Pubsub` in use (for diagnostics and benchmarks)."""
        return self._pubsub


async def _start_gossipsub(stack: AsyncExitStack, host: Host, config: ReplicaConfig) -> Pubsub:
    """Run py-libp2p gossipsub on `host` inside `stack`, with settings that work for a swarm.

    Turned off, each for a measured reason (shared/LIBP2P-NOTES.md):
    - spam protection: it drops (silently, after local delivery) every message beyond 10 per
      second per forwarding peer and topic — a relay in a 32-peer swarm forwards more than that
      from one neighbour; our validator is the spam filter.
    - adaptive gossip: it can stretch the gossipsub heartbeat to 30-60 s when it rates the
      network's "health" low, e.g. right after a partition.
    - eclipse protection: it grafts for IP diversity, meaningless on one LAN or loopback.
    Offered protocols stop at gossipsub v1.1: v1.2's IDONTWANT is sent for *every* message to
    every mesh peer (go-libp2p only above 1 KiB), which doubled our frame count for no gain on
    messages of a few hundred bytes.
    """
    degree, low, high = config.gossip_degree
    router = GossipSub(
        protocols=[PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=degree,
        degree_low=low,
        degree_high=high,
        heartbeat_interval=config.gossip_heartbeat,
        adaptive_gossip_enabled=False,
        spam_protection_enabled=False,
        eclipse_protection_enabled=False,
    )
    pubsub = Pubsub(host.libp2p, router, strict_signing=True)
    _guard_gossip_streams(host, pubsub, router.get_protocols())
    await stack.enter_async_context(background_trio_service(pubsub))
    await stack.enter_async_context(background_trio_service(router))
    await pubsub.wait_until_ready()
    return pubsub


def _guard_gossip_streams(host: Host, pubsub: Pubsub, protocols: Iterable[str]) -> None:
    """Replace py-libp2p's pubsub stream handler with one that contains its errors.

    In py-libp2p 0.8.1 a single malformed pubsub frame (protobuf `DecodeError`) escapes the
    handler and takes the whole host down (its network service fails, and with it the trio
    program): any connected peer could crash us with a dozen garbage bytes. Here a bad stream
    is reset and the peer dropped from pubsub, as py-libp2p does for the errors it expects.
    """
    warn = _RateLimitedLog()

    async def guarded(stream: Any) -> None:
        try:
            await pubsub.stream_handler(stream)
        except Exception as e:
            peer = getattr(getattr(stream, "muxed_conn", None), "peer_id", None)
            warn.warning(
                f"pubsub:{peer}",
                kv("dropped a malformed gossip stream", peer=peer, error=type(e).__name__),
            )
            with trio.CancelScope(shield=True), trio.move_on_after(1), suppress(Exception):
                await stream.reset()
            if peer is not None:
                try:
                    pubsub._handle_dead_peer(peer)  # py-libp2p's own clean-up for a bad stream
                except Exception as cleanup_error:
                    log.debug(kv("pubsub clean-up failed", error=repr(cleanup_error)))

    for protocol in protocols:
        host.libp2p.set_stream_handler(protocol, guarded)


# --- wire helpers ---------------------------------------------------------------------------------


def split_batches(batches: Mapping[str, list[SignedEntry]], budget: int) -> list[dict[str, list[SignedEntry]]]:
    """Cut {crdt name: entries} into chunks whose encoded size stays within `budget` bytes.

    Entries above the budget on their own are left out (they travel by anti-entropy, whose
    budget is larger; `MAX_ENTRY_BYTES` keeps every valid entry below both).
    """
    chunks: list[dict[str, list[SignedEntry]]] = []
    current: dict[str, list[SignedEntry]] = {}
    size = 64
    for name in sorted(batches):
        for entry in sorted(batches[name], key=lambda e: e.owner):
            cost = entry_wire_size(entry)
            if cost + 64 + len(name) > budget:
                continue
            if current and size + cost + len(name) + 16 > budget:
                chunks.append(current)
                current, size = {}, 64
            if name not in current:
                current[name] = []
                size += len(name) + 16
            current[name].append(entry)
            size += cost
    if current:
        chunks.append(current)
    return chunks


def _take(
    batches: Mapping[str, list[SignedEntry]], budget: int
) -> tuple[dict[str, list[SignedEntry]], dict[str, list[SignedEntry]]]:
    """The first chunk of `split_batches` and everything else."""
    chunks = split_batches(batches, budget)
    if not chunks:
        return {}, {}
    first = chunks[0]
    rest: dict[str, list[SignedEntry]] = {}
    for chunk in chunks[1:]:
        for name, entries in chunk.items():
            rest.setdefault(name, []).extend(entries)
    return first, rest


def encode_gossip(
    namespace: str,
    batches: Mapping[str, list[SignedEntry]],
    crdts: Mapping[str, SignedCrdt],
) -> bytes:
    return packb([GOSSIP_VERSION, namespace, [[n, crdts[n].encode_entries(es)] for n, es in batches.items()]])


def decode_gossip(
    data: bytes,
    namespace: str,
    crdts: Mapping[str, SignedCrdt],
    max_size: int,
) -> list[tuple[str, list[SignedEntry]]]:
    """Decode an untrusted gossip message into [(crdt name, entries)]; `MalformedCrdtData` if it
    is oversized, malformed, for another swarm, or names a CRDT we do not keep."""
    ns, batches = unpack_envelope(
        data, max_size=max_size, version=GOSSIP_VERSION, what="gossip message", layout="[version, namespace, batches]"
    )
    if ns != namespace:
        raise MalformedCrdtData(f"gossip for swarm {ns!r:.80}, not {namespace!r}")
    if not isinstance(batches, list) or len(batches) > len(crdts):
        raise MalformedCrdtData("gossip batches must be an array, at most one per CRDT")
    out: list[tuple[str, list[SignedEntry]]] = []
    seen: set[str] = set()
    for item in batches:
        if not isinstance(item, list) or len(item) != 2:
            raise MalformedCrdtData("a gossip batch is [crdt name, entries]")
        name, batch = item
        if not isinstance(name, str) or name not in crdts or name in seen:
            raise MalformedCrdtData(f"gossip batch for unknown or repeated CRDT {name!r:.80}")
        if not isinstance(batch, bytes):
            raise MalformedCrdtData("a gossip batch's entries must be bytes")
        seen.add(name)
        out.append((name, crdts[name].decode_entries(batch, max_size=max_size)))
    return out


def _parse_digest_reply(reply: Any, crdts: Mapping[str, SignedCrdt]) -> dict[str, Digest]:
    if not isinstance(reply, dict) or not isinstance(reply.get("d"), dict):
        raise MalformedCrdtData("a digest reply is {'d': {crdt name: digest}}")
    return {
        name: digest_from_wire(wire) for name, wire in reply["d"].items() if isinstance(name, str) and name in crdts
    }


def _parse_pull_reply(
    reply: Any, crdts: Mapping[str, SignedCrdt], max_size: int
) -> tuple[dict[str, list[SignedEntry]], bool]:
    if not isinstance(reply, dict) or not isinstance(reply.get("e"), dict):
        raise MalformedCrdtData("a pull reply is {'e': {crdt name: entries}, 'more': bool}")
    more = reply.get("more", False)
    if not isinstance(more, bool):
        raise MalformedCrdtData("'more' must be a bool")
    out: dict[str, list[SignedEntry]] = {}
    for name, data in reply["e"].items():
        if not isinstance(name, str) or name not in crdts or not isinstance(data, bytes):
            raise MalformedCrdtData(f"pull reply for unknown CRDT {name!r:.60} or not bytes")
        out[name] = crdts[name].decode_entries(data, max_size=max_size)
    return out, more


__all__ = [
    "GOSSIP_VERSION",
    "MAX_ENTRY_BYTES",
    "MAX_GOSSIP_PAYLOAD",
    "RPC_DIGEST",
    "RPC_PULL",
    "ChangeEvent",
    "CrdtSpec",
    "EntryTooLarge",
    "Replica",
    "ReplicaConfig",
    "ReplicaStats",
    "decode_gossip",
    "encode_gossip",
    "gossip_topic",
]
