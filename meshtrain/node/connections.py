"""Whom a node stays connected to, and dialling them: `ConnectionPlan` and `Dialler`.

Problem. A swarm's node used to dial every live member, one after another, every 2 s with a 5 s
timeout each: a full mesh, n − 1 connections per peer, and one re-dial pass that took minutes
once a few members were unreachable. A round never uses most of them: grouped rounds
(collective/groups.py) all-reduce within groups of at most 16 (automatic) above 32 peers.

Design. `ConnectionPlan.wanted` is a pure function of what the node knows — the live members,
the trainers and the round each is in the roster from (a round's groups come from its roster,
collective/groups.py "Failures"), the round it is in, its DHT routing table — and answers the
peers to keep, most wanted first:
1. the group partners (`GroupPlan.partners`) of the rounds under way — the round and the one the
   collective prepares ahead of it (outer_round.py, "Prepared rounds") —: never cut, a round
   needs every one (closing a partner's connection drops it from the round's candidates);
2. the partners of the round after those, dialled while these run so it does not wait;
3. the `neighbours` members closest to us in the DHT's key space (XOR of our id), so lookups
   and the swarm's records stay reachable;
4. a random sample of about `sample` members for gossip (membership, progress) and a connected
   graph: a pair is in each other's sample when a hash of the pair (both ends compute the same)
   falls under sample / (n − 1) — symmetric, so neither end closes what the other wants.
That list is one end's wish (`wish`), cut at `max_peers` (partners of the rounds under way
excepted). Of the rest (2–4), a pair is kept only where both ends' wishes keep it (`wanted`;
each end computes the other's from the same view): nearness is one-sided (b among a's nearest,
a not among b's) and the cut falls elsewhere at each end (room for 2 of a next round's 15
partners at 256 members, a different 2 at each end), and where one end kept a peer the other did
not, the other closed the connection over its bound and the first dialled it again seconds later
— 65 to 113 closes per daemon in 4 minutes in a 13-daemon swarm with a bound of 6
(docs/benchmarks.md). The partners of the rounds under way are kept as wished. The other end
keeps what our plan keeps, as far as its view tells (`wanted_by`: our plan computed there, from
the round we report), over its bound if need be: it had kept every partner of our next three
rounds, 43 connections per peer at 256 members where the plans kept at most 32. A swarm of at
most `max_peers` other members is wanted whole: the full mesh, as before, where it is cheap.

`Dialler` dials concurrently, at most `in_flight` dials at once (a `trio.CapacityLimiter`), in
its owner's nursery; a dial tries the peer's dialable addresses in turn (transport/host.py
`dialable_addrs`), each with its timeout, until one connects. A peer whose dial failed waits
before the next (`Backoff`, exponential with jitter, from `initial` to `cap`), and a dial that
succeeds resets it.
Its failure counts are what presence's address book reads ("taken for gone" after a few).

`DiscoveryPace` says when the connection loop reads the swarm's DHT key again: often only while
the node is looking for its swarm (node/presence.py, "Discovery, sparingly").

Failures. A dial that fails is logged at INFO and backed off; nothing else waits for it.

Not here: closing connections over the bound and when (node/presence.py), the groups themselves
(collective/groups.py), the host's own hard cap (transport/host.py `HostConfig.max_connections`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

import trio

from meshtrain.backoff import Backoff
from meshtrain.collective.groups import GroupPlan
from meshtrain.dht.routing import xor_distance
from meshtrain.errors import MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host, dialable_addrs
from meshtrain.transport.identity import parse_peer_id

log = get_logger(__name__)

DEFAULT_MAX_PEERS = 32  # connections a node keeps (not counting partners beyond it): NodeConfig.max_peers
GOSSIP_SAMPLE = 8  # members a node keeps, on average, beside its partners: gossip's graph
DHT_NEIGHBOURS = 4  # members closest to us in the DHT's key space that we keep
DIALS_IN_FLIGHT = 8  # dials (Noise + yamux handshakes) at once
DIAL_TIMEOUT = 5.0  # seconds one dial may take
DISCOVERY_INTERVAL = 15.0  # seconds between two DHT reads of the swarm's key while the view holds nobody else
DISCOVERY_SETTLED_INTERVAL = 120.0  # ... once it holds other live members (their gossip brings newcomers)
DISCOVERY_AFTER_LOSS_S = 300.0  # ... but every DISCOVERY_INTERVAL for this long after a live member dropped out
ANNOUNCERS = 4  # members of a larger swarm that refresh their announcement per interval, on average
KEY_READERS = 4  # ... and that make a due read of the swarm's key while the view holds others


@dataclass(frozen=True)
class Wish:
    """One end's wish (`ConnectionPlan.wish`): the `partners` of the rounds under way, then the
    `rest` (the next round's partners, DHT neighbours, gossip sample), kept only where the other
    end wishes it too."""

    partners: list[str]
    rest: list[str]

    def all(self) -> list[str]:
        return [*self.partners, *self.rest]


@dataclass(frozen=True)
class ConnectionPlan:
    """Which peers `me` keeps connected (module docstring). grouping: the spec's `GroupPlan` (None:
    every round is the whole swarm — NoLoCo, pipelines —, so every trainer is a partner and the
    bound does not cut them); max_peers: the bound; sample, neighbours: see the constants."""

    me: str
    max_peers: int = DEFAULT_MAX_PEERS
    grouping: GroupPlan | None = None
    sample: int = GOSSIP_SAMPLE
    neighbours: int = DHT_NEIGHBOURS

    @property
    def period(self) -> int:
        """Inner steps per group round (`GroupPlan.period`; 1 without grouping)."""
        return self.grouping.period if self.grouping is not None else 1

    def wanted(
        self,
        members: Sequence[str],
        trainers: Sequence[str],
        rounds: Sequence[int],
        *,
        in_from: Mapping[str, int] | None = None,
    ) -> list[str]:
        """Peers to keep connected, most wanted first: all `members` (live, any role) when at most
        `max_peers`, else our wish (`wish`): the partners among `trainers` of the `rounds` under
        way (a round and the one prepared ahead of it), then of the round after the last's
        partners, the DHT neighbours and the gossip sample those whose own wish — computed here
        from the same view — keeps us too: such a pair is kept at both ends or at neither, so
        neither end dials what the other closes. Never more than `max_peers`, but for the
        partners of a round under way (it needs them all).
        `in_from`: the round id each trainer (us too) is in the roster from (collective/groups.py,
        "Failures"; absent: 0): a round's partners come from its roster, and we have none in a
        round before ours."""
        others = sorted(set(members) - {self.me})
        if len(others) <= self.max_peers:
            return others
        mine = self.wish(others, trainers, rounds, in_from=in_from)
        everyone = [self.me, *others]
        mutual = [
            p
            for p in mine.rest
            if self.me in replace(self, me=p).wish(everyone, trainers, rounds, in_from=in_from).all()
        ]
        return [*mine.partners, *mutual]

    def wish(
        self,
        members: Sequence[str],
        trainers: Sequence[str],
        rounds: Sequence[int],
        *,
        in_from: Mapping[str, int] | None = None,
    ) -> Wish:
        """The peers this end would keep, one end's wish (`wanted` keeps the pair's): the partners
        of the rounds under way (never cut), then those of the round after the last, the DHT
        neighbours among the members and the gossip sample, most wanted first, cut at
        `max_peers`."""
        others = sorted(set(members) - {self.me})
        grouping = self.grouping
        now: list[str] = sorted(set(trainers) - {self.me})  # ungrouped: every round is the whole swarm
        ahead: tuple[str, ...] = ()
        if grouping is not None:
            now = [p for r in rounds for p in _partners(grouping, self.me, trainers, r, in_from)]
            ahead = _partners(grouping, self.me, trainers, max(rounds, default=0) + grouping.period, in_from)
        now = list(dict.fromkeys(now))
        near = self._nearest(self.me, others)
        # Where the bound cuts the next round's partners or the sample, it cuts by the pair's hash,
        # the same at both ends: by peer id, the lowest ids were kept by everyone (56 links at 256).
        ahead = tuple(sorted(ahead, key=self._pair_hash))
        sampled = sorted((p for p in others if self._sampled(p, len(others))), key=self._pair_hash)
        out = list(dict.fromkeys([*now, *ahead, *near, *sampled]))[: max(self.max_peers, len(now))]
        return Wish(now, out[len(now) :])

    def wanted_by(
        self,
        peer: str,
        members: Sequence[str],
        trainers: Sequence[str],
        rounds: Sequence[int],
        *,
        in_from: Mapping[str, int] | None = None,
    ) -> bool:
        """Whether `peer`'s own plan keeps us, computed from our view with `peer`'s `rounds` under
        way (its reported step's, as its presence computes its own): then it dials us when we
        close it, and closing it may drop us from a round it runs, whatever ours is (our rounds
        and its differ while one of us is a round or more ahead). `members`, `trainers` and
        `in_from` as for `wanted`."""
        return self.me in replace(self, me=peer).wanted([self.me, *members], trainers, rounds, in_from=in_from)

    def _nearest(self, peer: str, others: Sequence[str]) -> list[str]:
        """`peer`'s `neighbours` nearest of `others` in the DHT's key space."""
        if not self.neighbours:
            return []
        key = _id_hash(peer)
        return sorted(others, key=lambda p: xor_distance(key, p))[: self.neighbours]

    def _pair_hash(self, peer: str) -> int:
        """A hash of the pair (me, peer): the same at both ends, uniform in [0, 2^64)."""
        a, b = sorted((self.me, peer))
        return int.from_bytes(hashlib.blake2b(f"{a}/{b}".encode(), digest_size=8).digest(), "big")

    def _sampled(self, peer: str, n: int) -> bool:
        """Whether the pair (me, peer) is in the gossip sample: the same answer at both ends."""
        return self._pair_hash(peer) < self.sample / n * 2**64


def _partners(
    grouping: GroupPlan, peer: str, trainers: Sequence[str], round_id: int, in_from: Mapping[str, int] | None
) -> tuple[str, ...]:
    """`peer`'s group partners in round `round_id`, from the round's roster; none if `peer` itself
    is not in it yet."""
    entries = {p: (in_from or {}).get(p, 0) for p in {*trainers, peer}}
    roster = grouping.roster(entries, round_id)
    return grouping.partners(roster, round_id, peer) if peer in roster else ()


class UnwantedSince:
    """Since when each connection has gone unwanted: presence closes a connection over the bound
    only once it has not been wanted for a grace (node/presence.py), not once it is that old —
    an old connection to a partner of a round two rounds ahead, closed the moment it left the
    plan, had to be re-dialled within the one round before it was wanted again."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}  # connected peer -> when last wanted (else when first seen)
        self._was_wanted: set[str] = set()  # connected peers the plan wanted at some pass since they connected

    def note(self, connected: Sequence[str], wanted: AbstractSet[str], now: float) -> None:
        """A pass of the connection loop: these are connected, these wanted, at `now`."""
        self._since = {p: now if p in wanted else self._since.get(p, now) for p in connected}
        self._was_wanted = (self._was_wanted | set(wanted)) & self._since.keys()

    def opened(self, peer: str, now: float) -> None:
        """A connection to `peer` opened now (a new one, whatever we thought of its last)."""
        self._since[peer] = now
        self._was_wanted.discard(peer)

    def was_wanted(self, peer: str) -> bool:
        """Whether `peer` was wanted (by our plan, or by its own that keeps us: `wanted_now`) at
        some pass since its connection opened: a partner of a round that has ended, not a
        connection someone else opened (a DHT query, a peer whose view differs), whose query or
        RPC must finish first."""
        return peer in self._was_wanted

    def wanted_now(self, peers: set[str], now: float) -> None:
        """These were found wanted after all (a peer whose own plan keeps us): wanted, as by ours."""
        found = peers & self._since.keys()
        self._since.update(dict.fromkeys(found, now))
        self._was_wanted |= found

    def seconds(self, peer: str, now: float) -> float:
        """How long `peer`'s connection has gone unwanted (0: not seen connected)."""
        return now - self._since.get(peer, now)


def takes_turn(live_members: int, draw: float, few: int) -> bool:
    """Whether a member of a swarm of `live_members`, `draw` uniform in [0, 1), does its share of
    a chore a `few` members per interval are enough for: all of them up to `few`, else each with
    chance `few / live_members`, so about `few` per interval whatever the swarm's size."""
    return live_members <= few or draw < few / live_members


def refreshes_announcement(live_members: int, draw: float) -> bool:
    """Whether a member makes a due refresh of its announcement under the swarm's DHT key
    (node/presence.py, "Discovery, sparingly"): about `ANNOUNCERS` per interval (`takes_turn`) —
    a newcomer needs a few live announcements, and each refresh is a lookup and a store at the
    key's few holders."""
    return takes_turn(live_members, draw, ANNOUNCERS)


class DiscoveryPace:
    """When to read the swarm's DHT key again (node/presence.py, "Discovery, sparingly"): every
    `DISCOVERY_INTERVAL` while the view holds nobody else or for `DISCOVERY_AFTER_LOSS_S` after a
    live member's lease ran out (not one that left: it may be behind a partition, and its
    announcement is how we find it once the partition heals), else every
    `DISCOVERY_SETTLED_INTERVAL`: the members' gossip brings every newcomer. While the view holds
    others, about `KEY_READERS` of the swarm's members make each due read (`takes_turn`): what one
    finds (a half of the swarm it never met, a member back from a partition) it dials, and the
    CRDT sync over that connection brings it to everyone; a node alone always reads."""

    def __init__(self) -> None:
        self._last_read = -math.inf
        self._lost_at = -math.inf
        self._live: set[str] = set()

    def due(self, me: str, live: set[str], left: set[str], now: float, draw: float = 0.0) -> bool:
        """A pass of the connection loop with these `live` members (us included or not) and these
        that `left` cleanly, at `now`: whether to read the key now (a due read, made or left to
        others by `draw`, uniform in [0, 1), counts as read; 0 always reads)."""
        if self._live - live - left:
            self._lost_at = now
        self._live = set(live)
        alone = not live - {me}
        searching = alone or now - self._lost_at < DISCOVERY_AFTER_LOSS_S
        if now - self._last_read <= (DISCOVERY_INTERVAL if searching else DISCOVERY_SETTLED_INTERVAL):
            return False
        self._last_read = now
        return alone or takes_turn(len(live | {me}), draw, KEY_READERS)


@functools.lru_cache(maxsize=4096)
def _id_hash(peer: str) -> bytes:
    """The DHT key of a peer id (what `xor_distance` measures from): sha256 of its bytes (cached:
    a pass computes every member's wish, and so every member's nearest)."""
    return hashlib.sha256(parse_peer_id(peer).to_bytes()).digest()


class Dialler:
    """Dials peers in the background, concurrently and with backoff (module docstring).

    host: whose connections. nursery: where dials run (the owner's: they end with it).
    in_flight: dials at once. timeout: seconds per dial. initial, cap: the backoff of an
    unreachable peer, seconds. on_dialled(peer, ok): told after every dial (inline, must not block).
    """

    def __init__(
        self,
        host: Host,
        nursery: trio.Nursery,
        *,
        in_flight: int = DIALS_IN_FLIGHT,
        timeout: float = DIAL_TIMEOUT,
        initial: float = 2.0,
        cap: float = 60.0,
        on_dialled: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.host = host
        self.nursery = nursery
        self.limiter = trio.CapacityLimiter(in_flight)
        self.timeout = timeout
        self.initial, self.cap = initial, cap
        self.on_dialled = on_dialled
        self.dials = 0  # dials started, for benchmarks and the curious
        self._dialling: set[str] = set()
        self._backoff: dict[str, tuple[float, Backoff]] = {}  # peer -> (not before, its backoff)

    def ready(self, peer: str) -> bool:
        """Whether `peer` may be dialled now: not connected, not being dialled, not backing off."""
        if peer == self.host.peer_id or peer in self._dialling or self.host.is_connected(peer):
            return False
        return time.monotonic() >= self._backoff.get(peer, (0.0, None))[0]

    def failures(self, peer: str) -> int:
        """Dials of `peer` that failed in a row (0 after one succeeded)."""
        entry = self._backoff.get(peer)
        return entry[1].attempts if entry is not None else 0

    def dial(self, peer: str, addrs: Sequence[str]) -> bool:
        """Start dialling `peer` if `ready`, at each of its `dialable_addrs` in turn until one
        connects (a record may list a listen address no one else can use before its circuit
        address); returns whether a dial started."""
        dialable = dialable_addrs(addrs, peer)
        if not dialable or not self.ready(peer):
            return False
        self._dialling.add(peer)
        self.dials += 1
        self.nursery.start_soon(self._dial, peer, dialable)
        return True

    async def _dial(self, peer: str, addrs: list[str]) -> None:
        ok = False
        try:
            async with self.limiter:
                for addr in addrs:
                    with trio.move_on_after(self.timeout):
                        try:
                            await self.host.connect(addr, timeout=self.timeout)
                            ok = True
                            break
                        except MeshtrainError as e:
                            log.info(kv("peer unreachable", peer=peer[-8:], error=str(e)))
        finally:
            self._dialling.discard(peer)
        if ok:
            self._backoff.pop(peer, None)
        else:
            _, backoff = self._backoff.get(peer, (0.0, Backoff(initial=self.initial, cap=self.cap)))
            self._backoff[peer] = (time.monotonic() + backoff.next(), backoff)
        if self.on_dialled is not None:
            self.on_dialled(peer, ok)
