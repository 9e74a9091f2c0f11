"""Kademlia routing: the key space, one lookup's bookkeeping, and who is worth asking.

The problem. A key's records live on the `replication` peers closest to it, and a node knows
only part of the swarm. To find those peers it asks the closest peers it knows, learns closer
ones from their answers, and asks again, until the closest it has heard of have all answered.
Some of the peers it asks are dead and some are alive but slow: waiting for each in turn would
cost a lookup its whole timeout, and asking a peer that just failed would cost the next one too.

Design.
- **Key space**, as py-libp2p's kad-dht computes it, so our lookups and kad's routing table
  agree: a key sits at `sha256(routing_key(key))`, a peer at sha256 of its peer id's bytes, and
  their distance is the XOR of the two (`xor_distance`). Peer ids arrive as base58 strings in
  every reply; `parse_peer_id` caches their parsing, which is a lookup's hottest step.
- **`Lookup`** is a pure state machine (no I/O, the caller passes `now`): candidates ranked by
  distance, and which were queried, answered, failed, or are in flight since when. `next_peer`
  is the closest of the `width` best candidates not asked yet. A query outstanding for longer
  than `patience` (4x the lookup's median answer time so far, within `low..high`; `high` until
  the first answer) makes its peer a *straggler*: ranked out, so the next closest peer is asked,
  and no longer counted among the queries in flight (`active`), but not failed: it counts again
  if it answers. The lookup is `done` when the `width` closest usable candidates have all
  answered. With fewer candidates than `width` (a small swarm, many dead peers) a straggler may
  still be one of the closest, so it is waited for until `give_up_at` (2x patience after the
  last straggler started), not for its whole timeout. In a swarm whose routing tables are
  complete (small swarms) a lookup is one round trip. `LookupResult` is what one hands back.
- **`Routing`** keeps what lookups learn across lookups. py-libp2p's kad-dht owns the routing
  table (k-buckets with splitting, eviction of dead peers by ping, its periodic `refresh`, and
  answering other peers' FIND_NODE), but `host.connect` does not fill it: the host's connection
  events queue every new connection, and `admit_connected_peers` waits for identify and admits
  only peers that serve kad (server mode), as the Kademlia spec requires. Peers that answer our
  queries or send us theirs are admitted too, without that wait (`Dht._admit_soon`). Addresses from a find reply are learned only for
  peers we know no address of (`learn_addrs`), so a lying peer cannot redirect our traffic to
  peers we already know.
- **Dead and suspect peers.** A call that fails fast (refused, reset, garbage: under 0.9x
  `rpc_timeout`) marks the peer dead: dropped from kad's routing table and skipped for
  `dead_peer_ttl`, or until it connects to us again. A timeout is only a strike (our own
  starved event loop may be what timed out) and makes the peer suspect for `rpc_timeout`; the
  second in a row marks it dead. A straggler is suspect too (the lookup marks it) until its
  query settles which it is. Lookups skip peers that are not `usable`; find replies leave out
  dead ones.

Wire: none; the `dht/find` queries that feed a `Lookup` and `Routing` are sent in `kademlia.py`.
Failures: a string that is not a peer id is ignored as a lookup candidate (`Lookup.add`) and
raises `ValueError` from `parse_peer_id`. Admission, removal from kad's table and kad's refresh
are best effort: a failure there is dropped (the last two logged at debug level).

Not here: sending queries, the deadline of a whole lookup and the records it collects
(`Dht._lookup` in `kademlia.py`, which drives a `Lookup` and reports each call to `Routing`);
what records mean (`records.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.peerinfo import PeerInfo

from meshtrain.dht.records import Record, Subkey
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host
from meshtrain.transport.identity import parse_peer_id

log = get_logger(__name__)

KAD_PROTOCOL = "/ipfs/kad/1.0.0"
TIMEOUT_STRIKES = 2  # timeouts in a row before a peer is taken for dead
IDENTIFY_WAIT = 5.0  # how long a new connection may take to finish identify
LEARNED_ADDR_TTL = 600  # seconds a peer address learned from a find reply stays in the peerstore


def routing_key(key: str) -> bytes:
    """The bytes whose SHA-256 places `key` in the Kademlia key space."""
    return key.encode()


def xor_distance(target_hash: bytes, peer: str) -> int:
    """XOR distance as kad-dht computes it: sha256(key) ^ sha256(peer id bytes)."""
    return int.from_bytes(target_hash, "big") ^ parse_peer_id(peer).xor_id


@dataclass
class LookupResult:
    closest: list[str]  # peers that answered, closest first
    records: dict[Subkey, Record]  # merged valid records (get lookups only)
    seen: dict[str, set[tuple[Subkey, bytes]]]  # per answering peer: (subkey, signature) it held


class Lookup:
    """Bookkeeping of one iterative lookup: who is a candidate, asked, answered, failed, slow.

    A *straggler* is a peer whose query has been outstanding for longer than a few times the
    lookup's typical answer time: it is ranked out (so the next closest peer is asked) but not
    failed, and counts again if it answers before the lookup ends."""

    def __init__(self, target: bytes, own_id: str, width: int) -> None:
        self.target_hash = hashlib.sha256(target).digest()
        self.own_id = own_id
        self.width = width
        self.distance: dict[str, int] = {}
        self.queried: set[str] = set()
        self.answered: set[str] = set()
        self.failed: set[str] = set()
        self.stragglers: set[str] = set()
        self.in_flight: dict[str, float] = {}  # peer -> when its query started
        self.answer_times: list[float] = []

    def add(self, peer: str) -> None:
        if peer != self.own_id and peer not in self.distance:
            with contextlib.suppress(Exception):  # not a peer id: ignore it
                self.distance[peer] = xor_distance(self.target_hash, peer)

    def _ranked(self) -> list[str]:
        usable = [p for p in self.distance if p not in self.failed and p not in self.stragglers]
        return sorted(usable, key=self.distance.__getitem__)

    def next_peer(self) -> str | None:
        for p in self._ranked()[: self.width]:
            if p not in self.queried:
                return p
        return None

    def started(self, peer: str, now: float) -> None:
        self.queried.add(peer)
        self.in_flight[peer] = now

    def finished(self, peer: str, answered: bool, now: float) -> None:
        started = self.in_flight.pop(peer, now)
        self.stragglers.discard(peer)
        if answered:
            self.answered.add(peer)
            self.answer_times.append(now - started)
        else:
            self.failed.add(peer)

    def active(self) -> int:
        """Queries in flight that are not stragglers (the ones that count toward alpha)."""
        return sum(p not in self.stragglers for p in self.in_flight)

    def patience(self, low: float, high: float) -> float:
        """How long a query may take before it is a straggler: 4x the median answer time so
        far, within [low, high]; `high` until the first answer."""
        if not self.answer_times:
            return high
        typical = sorted(self.answer_times)[len(self.answer_times) // 2]
        return min(high, max(low, 4 * typical))

    def next_straggler_at(self, patience: float) -> float:
        """When the oldest non-straggling query becomes a straggler (inf if none is pending)."""
        pending = [t for p, t in self.in_flight.items() if p not in self.stragglers]
        return min(pending) + patience if pending else math.inf

    def mark_stragglers(self, now: float, patience: float) -> None:
        for p, t in self.in_flight.items():
            if now - t >= patience:
                self.stragglers.add(p)

    def give_up_at(self, patience: float) -> float:
        """When waiting for the stragglers stops being worth it (2x patience after the last
        one started): they are then treated as failed (inf if none is in flight)."""
        starts = [t for p, t in self.in_flight.items() if p in self.stragglers]
        return max(starts) + 2 * patience if starts else math.inf

    def top_answered(self) -> bool:
        return all(p in self.answered for p in self._ranked()[: self.width])

    def done(self, now: float, patience: float) -> bool:
        if not self.top_answered():
            return False
        # Fewer usable candidates than wanted (a small swarm, or many dead peers): a straggler
        # may still be one of the closest, so wait for it a little, not for its whole timeout.
        return len(self._ranked()) >= self.width or now >= self.give_up_at(patience)

    def closest_answered(self) -> list[str]:
        return [p for p in self._ranked() if p in self.answered]


class Routing:
    """A node's routing state: kad's routing table, fed from connections and answers, and the
    peers that lookups skip because they are dead or suspect. Owned by `Dht`, which runs
    `admit_connected_peers` in its nursery and calls `on_connected` for every new connection.

    host: the running `Host` (its peerstore holds the addresses).
    kad: py-libp2p's `KadDHT`, whose routing table this feeds and prunes.
    rpc_timeout: a call that took less than 0.9x this failed fast (dead at once); a peer that
        timed out is suspect for this long.
    dead_peer_ttl: how long a dead peer is skipped (unless it connects to us again).
    """

    def __init__(self, host: Host, kad: KadDHT, rpc_timeout: float, dead_peer_ttl: float) -> None:
        self.host = host
        self.kad = kad
        self.rpc_timeout = rpc_timeout
        self.dead_peer_ttl = dead_peer_ttl
        self.dead: dict[str, float] = {}  # peer -> monotonic time until which it is skipped
        self.suspect: dict[str, float] = {}  # peer -> until when lookups do not wait for it
        self._strikes: dict[str, int] = {}  # peer -> timeouts in a row
        self._feed_send, self._feed_recv = trio.open_memory_channel[str](1024)

    def on_connected(self, peer: str) -> None:
        self.dead.pop(peer, None)
        # in a burst of connections some are dropped: they arrive through lookups and refresh
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
            self._feed_send.send_nowait(peer)

    async def admit_connected_peers(self) -> None:
        async with trio.open_nursery() as nursery:
            async for peer in self._feed_recv:
                nursery.start_soon(self.admit, peer, None, True)

    async def admit(self, peer: str, addrs: list[multiaddr.Multiaddr] | None, wait_identify: bool) -> None:
        """Add `peer` to kad's routing table. With `wait_identify`, first wait for identify and
        admit it only if it serves kad (server mode), as the Kademlia spec requires."""
        pid = parse_peer_id(peer)
        peerstore = self.host.libp2p.get_peerstore()
        if wait_identify:
            with trio.move_on_after(IDENTIFY_WAIT):
                while True:
                    try:
                        protocols = peerstore.get_protocols(pid)
                    except Exception:
                        protocols = []
                    if protocols:
                        break
                    await trio.sleep(0.05)
            try:
                if KAD_PROTOCOL not in peerstore.get_protocols(pid):
                    return
            except Exception:
                return
        if addrs is None:
            try:
                addrs = peerstore.addrs(pid)
            except Exception:
                return
        if addrs:
            await self.kad.routing_table.add_peer(PeerInfo(pid, addrs), skip_server_mode_check=not wait_identify)

    def learn_addrs(self, peer: str, addrs: list[str]) -> None:
        """Addresses from a find reply, for peers we know no address of (so a lying peer can
        not redirect our traffic to peers we already know). Parsed only then: multiaddr
        parsing is slow and most peers in a reply are known."""
        peerstore = self.host.libp2p.get_peerstore()
        pid = parse_peer_id(peer)
        with contextlib.suppress(Exception):  # PeerStoreError: an unknown peer
            if peerstore.addrs(pid):
                return
        parsed = []
        for a in addrs:
            with contextlib.suppress(Exception):  # not a multiaddr: skip that one
                parsed.append(multiaddr.Multiaddr(a))
        if parsed:
            peerstore.add_addrs(pid, parsed, LEARNED_ADDR_TTL)

    def answered(self, peer: str) -> None:
        self._strikes.pop(peer, None)
        self.suspect.pop(peer, None)

    def failed(self, peer: str, started: float) -> None:
        """A call to `peer` failed. Failing fast (refused, reset, garbage) means the peer is gone
        or broken: dead at once. A timeout may be our own overload (a starved event loop blames
        everyone), so it is a strike: suspect for a while, dead at the second in a row."""
        if time.monotonic() - started < 0.9 * self.rpc_timeout:
            self._mark_dead(peer)
            return
        strikes = self._strikes.get(peer, 0) + 1
        if strikes >= TIMEOUT_STRIKES:
            self._mark_dead(peer)
        else:
            self._strikes[peer] = strikes
            self.suspect[peer] = time.monotonic() + self.rpc_timeout

    def _mark_dead(self, peer: str) -> None:
        self._strikes.pop(peer, None)
        self.dead[peer] = time.monotonic() + self.dead_peer_ttl
        try:
            self.kad.routing_table.remove_peer(parse_peer_id(peer))
        except Exception as e:
            log.debug(kv("routing table removal failed", peer=peer, error=repr(e)))

    def is_dead(self, peer: str) -> bool:
        until = self.dead.get(peer)
        if until is None:
            return False
        if until < time.monotonic():
            del self.dead[peer]
            return False
        return True

    def usable(self, peer: str) -> bool:
        """Worth asking: neither dead nor still owing an answer to an earlier lookup (a
        straggler's query goes on in the background and settles which it is)."""
        return not self.is_dead(peer) and not self._is_suspect(peer)

    def _is_suspect(self, peer: str) -> bool:
        until = self.suspect.get(peer)
        if until is None:
            return False
        if until < time.monotonic():
            del self.suspect[peer]
            return False
        return True

    async def refresh(self) -> None:
        try:
            with trio.move_on_after(60):
                await self.kad.refresh_routing_table()
        except Exception as e:  # kad's refresh is best effort
            log.debug(kv("kad refresh failed", error=repr(e)))
