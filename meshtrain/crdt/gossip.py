"""Gossip: how a `Replica` pushes its writes to the swarm, and merges what the swarm pushes to it.

The problem. A local write must reach every peer of the swarm quickly, and py-libp2p's gossipsub
has limits and failure modes that a naive publish runs into (docs/libp2p-notes.md).

Design (`Gossip`, a part that `Replica` builds and enters: it owns the outbox, the py-libp2p
`Pubsub` unless one is shared, the topic validator and subscription, and the gossip streams it is
opening; it reads the CRDTs and merges into them only through `LocalCrdts`, which the replica is):
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
- Every message is cut to the budget by `split_batches` (anti-entropy cuts its batches with it
  too, to its larger budget): an entry's encoded size is estimated by `entry_wire_size`, and
  every budget keeps `SPLIT_MARGIN` of slack for the framing the estimate leaves out.
- py-libp2p's gossipsub runs with the settings `start_gossipsub` explains (spam protection,
  adaptive gossip and eclipse protection off; gossipsub v1.1 at most). Its pubsub learns peers
  from connection events only, so `Gossip.ensure_pubsub_peers` opens gossip streams to connected
  peers it missed (at start, and before each anti-entropy tick: the replica wires that up); a
  peer that connected a moment ago (anti-entropy's `connected_since`) is left to py-libp2p.

Wire: `encode_gossip` / `decode_gossip`, on the topic `gossip_topic(namespace)`.

Failures: an untrusted message is decoded only within size limits (`MalformedCrdtData`), and
nothing it carries can raise out of the validator. py-libp2p's own pubsub stream handler is
wrapped (`guard_gossip_streams`): unwrapped, one malformed frame from any peer kills the host.

Not here: the merge rules, the size limit of an entry, the gate and the order batches merge in
(`Replica.merge_entries` / `merge_batches`, `replica.py`), the anti-entropy repair path
(`anti_entropy.py`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AsyncExitStack, suppress
from typing import Any, Literal, Protocol

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from meshtrain.crdt.base import SignedCrdt
from meshtrain.crdt.entries import SIGNATURE_BYTES, MalformedCrdtData, SignedEntry, unpack_envelope
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import packb
from meshtrain.transport.host import Host
from meshtrain.transport.identity import parse_peer_id

log = get_logger(__name__)

GOSSIP_VERSION = 1
MAX_GOSSIP_PAYLOAD = 56 << 10  # per gossip message: one yamux frame (64 KiB) with the envelope
YAMUX_FRAME_PAYLOAD = (64 << 10) - 12 - 2048  # minus yamux header and pubsub envelope
_ENTRY_OVERHEAD = SIGNATURE_BYTES + 32  # msgpack framing of [owner, seq, body, signature], roughly
SPLIT_MARGIN = 1024  # slack under every size limit for framing the estimates leave out
_LOG_EVERY = 10.0  # seconds between repeated warnings about the same peer
RETRY_AFTER = 10.0  # seconds before retrying a peer that would not speak gossipsub or crdt RPCs
_PUBSUB_GRACE = 3.0  # seconds py-libp2p gets to open a gossip stream to a new peer by itself


def gossip_topic(namespace: str) -> str:
    """The gossipsub topic that carries a swarm's CRDT deltas."""
    return f"/meshtrain/{namespace}/crdt/1"


class RateLimitedLog:
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


async def start_gossipsub(
    stack: AsyncExitStack, host: Host, gossip_degree: tuple[int, int, int], gossip_heartbeat: int
) -> Pubsub:
    """Run py-libp2p gossipsub on `host` inside `stack`, with settings that work for a swarm:
    mesh degree `gossip_degree` (D, D_low, D_high) and a heartbeat of `gossip_heartbeat` seconds
    (`ReplicaConfig`'s).

    Turned off, each for a measured reason (docs/libp2p-notes.md):
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
    degree, low, high = gossip_degree
    router = GossipSub(
        protocols=[PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=degree,
        degree_low=low,
        degree_high=high,
        heartbeat_interval=gossip_heartbeat,
        adaptive_gossip_enabled=False,
        spam_protection_enabled=False,
        eclipse_protection_enabled=False,
    )
    pubsub = Pubsub(host.libp2p, router, strict_signing=True)
    guard_gossip_streams(host, pubsub, router.get_protocols())
    await stack.enter_async_context(background_trio_service(pubsub))
    await stack.enter_async_context(background_trio_service(router))
    await pubsub.wait_until_ready()
    return pubsub


def guard_gossip_streams(host: Host, pubsub: Pubsub, protocols: Iterable[TProtocol]) -> None:
    """Replace py-libp2p's pubsub stream handler with one that contains its errors.

    In py-libp2p 0.8.1 a single malformed pubsub frame (protobuf `DecodeError`) escapes the
    handler and takes the whole host down (its network service fails, and with it the trio
    program): any connected peer could crash us with a dozen garbage bytes. Here a bad stream
    is reset and the peer dropped from pubsub, as py-libp2p does for the errors it expects.
    """
    warn = RateLimitedLog()

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


class LocalCrdts(Protocol):
    """The replica's CRDTs as a sync path sees them: read them, merge untrusted batches into them
    (`Replica` is one)."""

    @property
    def crdts(self) -> Mapping[str, SignedCrdt]: ...

    def merge_batches(
        self,
        batches: Iterable[tuple[str, list[SignedEntry]]],
        source: Literal["gossip", "anti-entropy"],
        peer: str,
    ) -> int:
        """Merge every batch (the gate's inputs first); return how many entries were not taken."""
        ...


class GossipSettings(Protocol):
    """The settings gossip reads (`ReplicaConfig` has them)."""

    @property
    def publish_delay(self) -> float: ...
    @property
    def max_gossip_payload(self) -> int: ...
    @property
    def gossip_degree(self) -> tuple[int, int, int]: ...
    @property
    def gossip_heartbeat(self) -> int: ...


class GossipCounters(Protocol):
    """The counters gossip bumps (`ReplicaStats` has them)."""

    gossip_published: int
    gossip_bytes_published: int
    gossip_publish_failed: int
    gossip_received: int
    gossip_invalid: int


class Gossip(Service):
    """The push path of a `Replica`: queues its writes, publishes them, merges what arrives.

    Parameters:
    - `host`: the running `Host`; gossipsub runs on it (unless `pubsub` is given), and its
      connected peers are those we open gossip streams to.
    - `namespace`: the swarm id: the topic and every message's envelope.
    - `local`: the CRDTs it encodes from and merges into (`LocalCrdts`).
    - `settings`, `stats`: the replica's config and counters (`GossipSettings`, `GossipCounters`).
    - `connected_since(peer)`: when a peer connected while we ran (None if before or unknown);
      a fresh connection's gossip stream is left to py-libp2p for `_PUBSUB_GRACE` seconds.
    - `pubsub`: a running py-libp2p `Pubsub` to share; by default one is started with the part.

    Entering starts gossipsub (if it owns it), the topic validator and subscription, and two
    tasks (drain the subscription, publish the outbox); leaving stops them in reverse.
    """

    def __init__(
        self,
        host: Host,
        namespace: str,
        local: LocalCrdts,
        settings: GossipSettings,
        stats: GossipCounters,
        *,
        connected_since: Callable[[str], float | None],
        pubsub: Pubsub | None = None,
    ) -> None:
        self.host = host
        self.me = host.peer_id
        self.namespace = namespace
        self.topic = gossip_topic(namespace)
        self.local = local
        self.settings = settings
        self.stats = stats
        self.connected_since = connected_since
        self.pubsub = pubsub
        self._owns_pubsub = pubsub is None
        self._outbox: dict[str, dict[str, SignedEntry]] = {}  # crdt -> owner -> latest entry
        self._outbox_ready = trio.Event()
        self._pubsub_pending: set[str] = set()  # peers whose gossip stream we are opening
        self._pubsub_failed: dict[str, float] = {}  # peers whose gossip stream would not open
        self._warn = RateLimitedLog()
        self._nursery: trio.Nursery | None = None

    async def _start(self, stack: AsyncExitStack) -> None:
        if self.pubsub is None:
            self.pubsub = await start_gossipsub(
                stack, self.host, self.settings.gossip_degree, self.settings.gossip_heartbeat
            )
        pubsub = self.pubsub
        pubsub.set_topic_validator(self.topic, self._validate, False)
        stack.callback(pubsub.remove_topic_validator, self.topic)
        subscription = await pubsub.subscribe(self.topic)
        if not self._owns_pubsub:
            stack.push_async_callback(self._unsubscribe)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._drain_subscription, subscription)
        self._nursery.start_soon(self._publish_loop)
        self.ensure_pubsub_peers()

    async def _unsubscribe(self) -> None:
        if self.pubsub is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                try:
                    await self.pubsub.unsubscribe(self.topic)
                except Exception as e:
                    log.debug(kv("gossip unsubscribe failed", error=repr(e)))

    def queue(self, name: str, entries: Iterable[SignedEntry]) -> None:
        """Publish `entries` of CRDT `name` within `publish_delay` (an owner's latest only)."""
        pending = self._outbox.setdefault(name, {})
        for entry in entries:
            held = pending.get(entry.owner)
            if held is None or entry.order_key > held.order_key:
                pending[entry.owner] = entry
        self._outbox_ready.set()

    # --- receiving and publishing ---------------------------------------------------------------

    def _validate(self, forwarder: ID, message: Any) -> bool:
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
            batches = decode_gossip(message.data, self.namespace, self.local.crdts, self.settings.max_gossip_payload)
        except MalformedCrdtData as e:
            self.stats.gossip_invalid += 1
            self._warn.warning(
                f"gossip:{origin}",
                kv("undecodable CRDT gossip", origin=origin, via=forwarder.to_base58(), error=e),
            )
            return False
        if self.local.merge_batches(batches, "gossip", origin):
            self.stats.gossip_invalid += 1
            return False
        return True

    async def _drain_subscription(self, subscription: Any) -> None:
        # Messages were merged by the validator; the subscription channel (32 deep in py-libp2p)
        # only has to be emptied so that py-libp2p does not log and drop.
        async for _ in subscription:
            pass

    async def _publish_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            await trio.sleep(self.settings.publish_delay)
            await self.publish_pending()

    async def publish_pending(self) -> None:
        """Publish the queued entries now."""
        self._outbox_ready = trio.Event()
        outbox, self._outbox = self._outbox, {}
        if self.pubsub is None or not outbox:
            return
        for payload in self._payloads(outbox):
            try:
                await self.pubsub.publish(self.topic, payload)
            except Exception as e:  # anti-entropy delivers what gossip could not
                self.stats.gossip_publish_failed += 1
                log.debug(kv("gossip publish failed", error=repr(e)))
                continue
            self.stats.gossip_published += 1
            self.stats.gossip_bytes_published += len(payload)

    def _payloads(self, outbox: Mapping[str, Mapping[str, SignedEntry]]) -> list[bytes]:
        batches = {name: list(by_owner.values()) for name, by_owner in outbox.items()}
        budget = self.settings.max_gossip_payload - SPLIT_MARGIN  # the sizes are estimates
        return [encode_gossip(self.namespace, chunk, self.local.crdts) for chunk in split_batches(batches, budget)]

    # --- gossip streams -------------------------------------------------------------------------

    def ensure_pubsub_peers(self) -> None:
        """Open gossip streams to connected peers gossipsub does not know yet.

        py-libp2p's pubsub learns peers from connection events only: peers connected before it
        started, or whose gossipsub was not up when they connected, are otherwise never used.
        A fresh connection is left to py-libp2p for a few seconds (two concurrent
        registrations of one peer would leave a stray send loop behind).
        """
        if self.pubsub is None or self._nursery is None:
            return
        now = time.monotonic()
        known = {p.to_base58() for p in self.pubsub.peers}
        for peer in self.host.connected_peers():
            if peer in known or peer in self._pubsub_pending:
                continue
            since = self.connected_since(peer)
            if since is not None and now - since < _PUBSUB_GRACE:
                continue
            if now - self._pubsub_failed.get(peer, -math.inf) < RETRY_AFTER:
                continue
            self._pubsub_pending.add(peer)
            self._nursery.start_soon(self._open_pubsub_stream, peer)

    async def _open_pubsub_stream(self, peer: str) -> None:
        pubsub = self.pubsub
        try:
            ok = pubsub is not None and await pubsub.ensure_peer_stream(parse_peer_id(peer), timeout=5.0)
        except Exception as e:
            log.debug(kv("gossip stream failed", peer=peer, error=repr(e)))
            ok = False
        finally:
            self._pubsub_pending.discard(peer)
        if not ok:
            self._pubsub_failed[peer] = time.monotonic()


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


__all__ = [
    "GOSSIP_VERSION",
    "RETRY_AFTER",
    "MAX_GOSSIP_PAYLOAD",
    "SPLIT_MARGIN",
    "YAMUX_FRAME_PAYLOAD",
    "Gossip",
    "GossipCounters",
    "GossipSettings",
    "LocalCrdts",
    "RateLimitedLog",
    "decode_gossip",
    "encode_gossip",
    "entry_wire_size",
    "gossip_topic",
    "guard_gossip_streams",
    "split_batches",
    "start_gossipsub",
]
