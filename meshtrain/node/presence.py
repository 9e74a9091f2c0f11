"""Peer presence: who is in the swarm, who trains now, and staying connected to them.

Problem. Three sources tell a node about its swarm's peers, each incomplete: the DHT (one for
every swarm; this swarm's `/meshtrain/<swarm>/peers` records, found through bootstrap peers and
the peer we join through), mDNS on the LAN, and the replicated CRDT membership (every member's signed record with
its role, addresses and lease; progress records with step, round and φ digests). Before this
module, the node met them in one loop of its own and asked the view for the same sets in five
places.

Design. `PeerPresence` is a `Service` that enters, in order: the DHT (bootstrapped from the
configured peers and the join address), LAN discovery (a LAN peer of this swarm bootstraps us as
it is heard), DHT discovery (our own record under the swarm's key), and the swarm view (the CRDT
replica; the owner publishes the signed spec in its config).

Admission (node/trust/admission.py). The view answers from admitted peers only: `PeerPresence` hands
it the spec's rule (`Admission.admits`), so every question below — trainers, candidates, donors,
`is_member` — ignores a peer that fails it, on every honest peer alike. The rule without strikes
(`keep`) also decides whose records the replica stores at all: a stranger's membership record
without a valid proof (or allow), and progress, metrics or strikes records of a peer that is not
an admitted member, are refused, not stored or spread (crdt/swarm_view.py; counted in the status
document's `refused`). The swarm's verified
strikes (node/trust/strikes.py, a `StrikeBook` kept in `data_dir`) are part of the rule: a peer struck
out is excluded from all of them; `standing()` shows who has strikes. Our own record always
counts for us; `not_admitted()` says whether the others count it (a node that is not admitted
waits, `Node`). In an open swarm our record carries our proof of work (capability "pow").

Advertising (dht/swarm_index.py). Unless the swarm is private, the owner and the first
`ADVERTISERS` other live peers by id (every peer computes the same list from the same view)
store the swarm's advert in the DHT's swarm index every `ADVERT_INTERVAL` seconds: the signed
spec, how many peers are live, the swarm's step, and their addresses as entry points.

Staying connected (node/connections.py), bounded. Every `CONNECT_INTERVAL` seconds, and at once
when the collective first asks about a new round, one background task works out whom to keep
(`ConnectionPlan.wanted`: everyone while the swarm has at most `max_peers` other members — the
full mesh, as before —, else the group partners of the rounds under way (never cut), and those
of the next round, DHT neighbours and a gossip sample that both ends keep, at most `max_peers`),
dials those we are not connected to concurrently (`Dialler`:
a few at once, an unreachable peer backing off exponentially), and asks NAT traversal to upgrade
a relayed connection (DCUtR). The rounds under way are ours (`current_round`, the node's step;
before it trains, the swarm's) and the next, whose join the collective prepares ahead — not the
rounds other peers' requests name, which a faster peer's prepared join sets ahead of ours —:
the groups are a pure function of the round and its roster (collective/groups.py), so the
partners of the round after are dialled while these run.
While connected to more than `max_peers` peers, it closes the surplus that nothing keeps once
each has gone unwanted for its grace — 10 s for a trainer (2 s for a past partner where rounds
last longer), 30 s for a peer not in the view —,
never a syncing member's nor that of a peer whose own plan keeps us; a connection one of our DHT
queries dialled is hung up a moment after the query unless the bound would keep it or it goes to
a bootstrap peer (a private node's relay) (node/bound.py `ConnectionBound`, which tells why each
rule is there; transport/one_off.py). So the bound holds up to those graces, joiners syncing and
peers out of step. Nothing else would close them — py-libp2p's idle pruning is off with its
auto-connector (transport/host.py), so "left to idle out" would mean kept until the host's hard
cap. A peer discovered through the DHT but not yet in the view is
dialled only while we have room under the bound.

Discovery, sparingly. Every node announces itself under the swarm's one DHT key and reads it
back, and a lookup of that key dials its closest peers: the same few for every node. Read every
15 s and announced every 20 s, that was the bulk of the connections the bound then closed (13
daemons, bound 6: 65–113 closes per daemon in 4 minutes, and a node over its bound at 93% of
reads, docs/benchmarks.md), and at hundreds of daemons it would give the key's holders a
connection from every node. Once the view holds other live members, their gossip brings every
newcomer's membership record, addresses included; the DHT read is then for swarms that never
met (two halves started apart), every 120 s, and every 15 s only while the view holds nobody
else (a node that knows nobody finds the swarm that way) or for 5 minutes after a live member's
lease ran out (not one that left): it may be behind a partition, and once the partition heals
its announcement is how we find it again (the view no longer holds it, and the address book is
dialled only until we meet the swarm): `DiscoveryPace`, node/connections.py. Our announcement,
for newcomers, lives `ANNOUNCE_TTL_S` (a dead node's lingers that long, which costs a newcomer a
failed dial) and is due for a refresh every `ANNOUNCE_REFRESH_S`; in a swarm of more than
`ANNOUNCERS` (4) live members each due refresh is made with chance 4 / members
(`refreshes_announcement`), so the key holds a dozen or so live announcements at any size — a
newcomer needs a few, its first dial brings the rest by gossip — and its holders get about four
stores a minute instead of one per member (13 daemons: DHT queries' connections were two of the
eight a node held over its bound of six, docs/benchmarks.md). Reads alike: while the view holds
others, about `KEY_READERS` (4) members make each due read (`DiscoveryPace`); what one finds it
dials, and the CRDT sync over that connection brings it to everyone. A node alone always reads.

What it answers, from the view and the host:
    trainers()                 live members whose role is "trainer", us included
    roster(round)              the trainers in the round's roster (what its groups are computed
                               from): those whose membership record's `in_from` falls in the
                               round's group round or earlier — agreed by every peer that holds
                               the records, whenever they arrived (node/roster.py)
    enter_roster()             count as a trainer, in the roster from a round announced ahead
                               where the swarm's rounds run in groups (else at once, as before)
    candidates(round)          a round's candidates: the roster's trainers we are connected to,
                               and us (a peer whose connection closed stops being waited for at
                               once); every partner of the round we could reach is among them,
                               as its partners are dialled as soon as the round is asked about
    training_peers(connected)  trainers other than us whose progress record is fresh: they train
                               *now*, not a restarted peer's record from its last life (a
                               trainer's record is rewritten every heartbeat while its node's
                               phase is "training", even while it waits inside a round:
                               `keep_progress_live`, a `Phase` listener). Fresh by our own
                               clock (`SwarmView.age`), never by the peer's: a peer whose clock
                               is minutes off trains and donates like any other
    swarm_step(), front_step() the furthest step a peer training now reports (any / connected)
    is_member(peer)            a live membership record (any role), waiting `MEMBER_WAIT` for one
                               on its way: the data plane's and the state donor's admission rule
    relay_candidates()         whom a private node reserves a relay slot on

Clock offsets (node/clock_offsets.py). Presence also enters `ClockOffsets`, which measures the
offset of every live member we are connected to (NTP's exchange) for the status document and
warns once about a peer more than a few seconds off; nothing here depends on it.

Finding the swarm again (node/state/address_book.py). The re-dial loop also notes the view's live
trainers in the data dir's address book. On a restart their addresses join the DHT's bootstrap
list, and they are re-dialled with backoff until this life first reaches the swarm — a trainer it is
connected to and holds the record of, not a connection alone (`_meets_swarm`) — or each is taken
for gone (`REJOIN_DIALS` failed dials in a row, the `Dialler`'s count). Until then,
`cut_off()` says why the node must not train alone: its book names trainers seen within
`REJOIN_HORIZON_S` that have not been taken for gone (`RunState.enter` waits on it). A restart
whose only bootstrap address was dead trained — and committed rounds — alone before this.

Failures. No bootstrap peer reachable: logged; the DHT is bootstrapped again with backoff while
its routing table is empty, from the configured peers and the address book; with neither, the
node runs alone until peers dial it. A DHT lookup failing is logged at INFO and tried again next
interval; a dial failing is logged at INFO and tried again after its backoff (2 s doubling to 60 s).

Not here: the CRDTs and their replication (`crdt/`), NAT traversal (`transport/nat.py`), the
admission rules themselves (`node/trust/admission.py`), reading the swarm index (`node/spec/listing.py`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from meshtrain.backoff import Backoff
from meshtrain.collective.groups import in_roster
from meshtrain.crdt.replica import Replica
from meshtrain.crdt.swarm_view import MEMBERSHIP, PROGRESS, PeerInfo, PeerProgress, SwarmView, swarm_specs
from meshtrain.crdt.types import now_ms
from meshtrain.dht.discovery import Discovery, DiscoveryConfig
from meshtrain.dht.kademlia import Dht
from meshtrain.dht.mdns import LanDiscovery
from meshtrain.dht.records import DhtError
from meshtrain.dht.swarm_index import DEFAULT_ADVERT_TTL, publish_advert
from meshtrain.errors import MeshtrainError
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.node.bound import ConnectionBound
from meshtrain.node.clock_offsets import ClockOffsets
from meshtrain.node.connections import (
    DEFAULT_MAX_PEERS,
    ConnectionPlan,
    Dialler,
    DiscoveryPace,
    refreshes_announcement,
)
from meshtrain.node.phase import StopRequest
from meshtrain.node.roster import (
    LEAD_BEATS,
    PACE_CHANGES,
    PACE_POLL_S,
    PACE_WINDOW_S,
    StepPace,
    entry_round,
    lead_rounds,
    reported_round_seconds,
)
from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.state.address_book import AddressBook
from meshtrain.node.trust.admission import POW_CAP, Admission, mint_pow
from meshtrain.node.trust.strikes import Standing, StrikeBook
from meshtrain.transport.host import Host, dialable_addrs, peer_id_of
from meshtrain.transport.nat import NatTraversal

log = get_logger(__name__)

CONNECT_INTERVAL = 2.0  # seconds between two passes of re-dialling
ANNOUNCE_REFRESH_S = 60.0  # seconds between two announcements of ours under the swarm's key
ANNOUNCE_TTL_S = 180.0  # an announcement's lifetime (a dead node's lingers this long for newcomers)
PROGRESS_FRESH_BEATS = 3  # a progress record older than this many heartbeat intervals (+5 s): not training
QUIET_BEATS = 2  # no heartbeat from a peer for this many intervals (+1 s): it went quiet (`heartbeats_stopped`)
MEMBER_WAIT = 3.0  # a request from a peer not yet in our membership waits this long for its record
ADVERTISERS = 3  # peers of a swarm (the owner first) that advertise it in the DHT's swarm index
ADVERT_INTERVAL = DEFAULT_ADVERT_TTL / 3  # seconds between two adverts
REJOIN_HORIZON_S = 300.0  # a trainer of our address book seen live this recently may still be there
REJOIN_DIALS = 3  # ... until this many dials of it failed in a row (then it is taken for gone)


class PeerPresence(Service):
    """`async with PeerPresence(host, signed, bootstrap=[...]) as presence:` — the swarm's peers.

    bootstrap: peer multiaddrs to bootstrap the DHT from (the configured peers, then the one we
        join through). mdns: also find peers on the LAN. nat: NAT traversal, if running (relayed
        connections are upgraded in the background). connection: how we are reached, announced
        in our membership record until NAT traversal knows better. pow_nonce: our proof of work
        for an open swarm (`admission.load_or_mint_pow`; None: minted on entry, in a thread).
        data_dir: where the swarm's strikes are kept across restarts (None: only in memory).
        max_peers: the connections we keep (`ConnectionPlan`; a round's partners beyond it too).
    """

    def __init__(
        self,
        host: Host,
        signed: SignedSpec,
        *,
        bootstrap: list[str],
        mdns: bool = False,
        nat: NatTraversal | None = None,
        connection: str = "direct",
        pow_nonce: int | None = None,
        data_dir: Path | None = None,
        max_peers: int = DEFAULT_MAX_PEERS,
    ) -> None:
        self.host = host
        self.signed = signed
        self.bootstrap = list(bootstrap)
        self.mdns = mdns
        self.nat = nat
        self.connection = connection
        self.pow_nonce = pow_nonce
        self.admission = Admission(signed)
        self.capabilities: dict[str, int] = {}
        self.view: SwarmView | None = None  # set once entered
        self.discovery: Discovery | None = None
        self.dht: Dht | None = None
        self.data_dir = data_dir
        self.strikes: StrikeBook | None = None  # set once entered
        self.clock: ClockOffsets | None = None  # set once entered
        self.book = AddressBook(data_dir, signed.swarm_id, host.peer_id)  # node/state/address_book.py
        self.met_swarm = False  # reached the swarm in this life (`_meets_swarm`)
        self.started_ms = now_ms()  # this life's start, on our wall clock (our own records' clock)
        self.plan = ConnectionPlan(host.peer_id, max_peers=max_peers, grouping=signed.spec.group_plan())
        self.dialler: Dialler | None = None  # set once entered
        # Our round (round ids are steps: the collective's `current_round`), set by the node once
        # it trains; None: the swarm's step stands in for it.
        self.current_round: Callable[[], int | None] | None = None
        self._newest_asked = -1  # the newest round index the collective asked about
        self._wake = trio.Event()  # wakes the re-dial loop: a round of new partners
        self.bound = ConnectionBound(self.host, self.plan, self.trainers, self.roster_entries)  # node/bound.py
        self._dht_backoff = Backoff(initial=1.0, cap=30.0)
        self._next_bootstrap = 0.0

    @property
    def me(self) -> str:
        return self.host.peer_id

    async def _start(self, stack: AsyncExitStack) -> None:
        host, swarm_id, spec = self.host, self.signed.swarm_id, self.signed.spec
        if spec.admission.mode == "open" and spec.admission.pow_bits:
            if self.pow_nonce is None:
                self.pow_nonce = await trio.to_thread.run_sync(mint_pow, swarm_id, self.me, spec.admission.pow_bits)
            self.capabilities[POW_CAP] = self.pow_nonce
        stack.callback(host.on_connected(self.bound.opened))
        # A connection a DHT query dialled is hung up after it unless we keep it (transport/one_off.py).
        # Our bootstrap peers stay: a private node reserves its relay slots on them.
        relays = {peer_id_of(a) for a in self.relay_candidates()}
        host.one_off.keep = lambda peer: peer in relays or self.bound.keeps(self.view, peer, self.wanted)
        stack.callback(setattr, host.one_off, "keep", lambda peer: True)
        dht = self.dht = await stack.enter_async_context(Dht(host))
        if self.mdns:

            async def lan_peer(peer: str, addrs: list[str]) -> None:
                if not host.is_connected(peer) and (dialable := dialable_addrs(addrs, peer)):
                    await dht.bootstrap(dialable[:1])

            await stack.enter_async_context(LanDiscovery(host, swarm_id, lan_peer))
        self.book.load()
        stack.callback(self.book.save, force=True)
        await self._bootstrap(dht, first=True)
        self.discovery = await stack.enter_async_context(
            Discovery(
                dht,
                swarm_id,
                DiscoveryConfig(role="trainer", ttl=ANNOUNCE_TTL_S, refresh_interval=ANNOUNCE_REFRESH_S),
                addrs=self.announced_addrs,
                refresh_needed=self._refreshes_announcement,
            )
        )
        replica = await stack.enter_async_context(Replica(host, swarm_id, swarm_specs(self.signed.owner)))
        # Alone (the first node of a swarm), there is nothing to recover: do not wait for it.
        view = SwarmView(
            replica,
            self.signed.owner,
            role="syncing",
            capabilities=self.capabilities,
            connection=self.connection,
            recover_timeout=5.0 if host.connected_peers() else 0.2,
            admit=self._admits,
            keep=self._keeps,
        )
        view.life_ms = self.started_ms  # our records of a last life are then told apart (`training_peers`)
        # Before the view recovers the swarm's state: the gate reads the owner's run-time allows.
        self.admission.view = view
        self.view = await stack.enter_async_context(view)
        # The swarm's verdicts (node/trust/strikes.py): kept strikes first, then they refuse like the rule.
        strikes = self.strikes = StrikeBook(view, spec, admitted=self.admission.admits_reporter, data_dir=self.data_dir)
        strikes.load()
        self.admission.strikes = strikes
        self.clock = await stack.enter_async_context(ClockOffsets(host, self._connected_members))
        if view.is_owner and view.config().get("spec") != self.signed.to_wire():
            view.set_config(spec=self.signed.to_wire())
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self.dialler = Dialler(host, self._nursery, initial=CONNECT_INTERVAL, on_dialled=self._dialled)
        self._nursery.start_soon(self._keep_connected, view, self.discovery, self.dialler)
        self._nursery.start_soon(strikes.keep_saved)
        if spec.admission.mode != "private":  # a private swarm's peers cannot be reached by strangers
            self._nursery.start_soon(self._advertise, view, dht)

    # -- who is there ----------------------------------------------------------------------------

    def _admits(self, peer: PeerInfo) -> bool:
        """The view's filter: the swarm's admission rule; our own record always counts for us."""
        return peer.peer_id == self.me or self.admission.admits(peer)

    def _keeps(self, peer_id: str, capabilities: dict[str, Any]) -> bool:
        """Whose records we store at all (the replica's gate, `SwarmView.keep`): the rule without
        strikes — an identity that paid for admission may have its bounded records stored, and
        verdicts that differ between peers while strikes spread must not split the replicas."""
        return peer_id == self.me or self.admission.base_reason(peer_id, capabilities) is None

    def not_admitted(self) -> str | None:
        """Why the swarm's other peers ignore us (`admission` reasons), or None: they admit us."""
        return self.admission.reason(self.me, self.capabilities)

    def standing(self) -> dict[str, Standing]:
        """Peers with verified strikes against them: rounds counted, excluded or not (node/trust/strikes.py)."""
        return self.strikes.standing() if self.strikes is not None else {}

    def ignored(self) -> list[str]:
        """Peers with a membership record that fails admission (for the status page)."""
        return [p.peer_id for p in self._view().ignored_peers()]

    def _view(self) -> SwarmView:
        if self.view is None:
            raise RuntimeError("PeerPresence is used before it was entered")
        return self.view

    def keep_progress_live(self, node_state: str) -> None:
        """A `Phase` listener: while the node trains, our progress record stays fresh at every
        heartbeat, also while the trainer waits inside a round (`training_peers` reads a record
        older than `PROGRESS_FRESH_BEATS` as "not training")."""
        self._view().progress_live = node_state == "training"

    def _connected_members(self) -> list[str]:
        """Live members other than us that we are connected to (whose clocks we measure)."""
        host = self.host
        return [p.peer_id for p in self._view().live_peers() if p.peer_id != self.me and host.is_connected(p.peer_id)]

    def present(self, peer: str) -> bool:
        """Whether `peer` is still in the swarm, in any role: a live, admitted membership record
        (strikes exclude) and a connection to us (collective/join_wait.py)."""
        return self.host.is_connected(peer) and self._view().is_live(peer)

    def heartbeats_stopped(self, peer: str) -> bool:
        """Whether `peer`'s heartbeats stopped reaching us: no membership record from it for
        `QUIET_BEATS` heartbeat intervals (+1 s), by our monotonic clock, or none at all. With an
        unanswered probe, a coordinator takes it for silent (collective/missing_peers.py,
        "Silent peers"): a live peer on a saturated link answers late, but its heartbeats still arrive.
        The interval stretches with the swarm (22 s at 64 peers, 65 s at 256 before it says
        quiet): there a patient probe decides (collective/probe.py, "Sparse heartbeats")."""
        view = self._view()
        age = view.age(MEMBERSHIP, peer)
        return age is None or age > QUIET_BEATS * view.current_interval() + 1.0

    def trainers(self) -> list[str]:
        """Live trainers per the replicated membership, us included (connected or not), whether
        in a round's roster yet or not (`roster`)."""
        return [p.peer_id for p in self._view().live_peers() if p.role == "trainer"]

    def roster_entries(self) -> dict[str, int]:
        """Live trainers, us included, -> the round id each is in the roster from (0: from the
        start; node/roster.py)."""
        return {p.peer_id: p.in_from for p in self._view().live_peers() if p.role == "trainer"}

    def roster(self, round_id: int) -> list[str]:
        """Round `round_id`'s roster, what its groups are computed from: the live trainers in by
        then (`in_roster`, collective/groups.py "Failures"), connected to us or not."""
        return sorted(p for p, r in self.roster_entries().items() if in_roster(r, round_id, self.plan.period))

    def candidates(self, round_id: int | None = None) -> list[str]:
        """A round's candidates: live trainers we are connected to, and us — of round `round_id`'s
        roster, if given (a joiner is expected from its round on). A peer whose connection
        closed (killed, partitioned) stops being waited for at once, not when its lease runs out;
        the re-dial loop brings it back, and it is a candidate again as soon as it is. Asked about
        a new round (the collective's `membership(round_id)`), it wakes the re-dial loop: a new
        round has new group partners, to be dialled now rather than at the next pass."""
        if round_id is not None and round_id // self.plan.period > self._newest_asked:
            self._newest_asked = round_id // self.plan.period
            self._wake.set()
        return [
            p.peer_id
            for p in self._view().live_peers()
            if p.role == "trainer"
            and (p.peer_id == self.me or self.host.is_connected(p.peer_id))
            and (round_id is None or in_roster(p.in_from, round_id, self.plan.period))
        ]

    def rounds_grouped(self) -> bool:
        """Whether the swarm's rounds run in groups with us in, counting every live member (a
        joiner still syncing too: it is a trainer soon). Then a trainer's entry into the roster is
        announced ahead (`enter_roster`), and a re-sync keeps its place in it (node/training_run.py):
        leaving it would regroup every peer's rounds, each when the record arrives."""
        grouping = self.plan.grouping
        members = {p.peer_id for p in self._view().live_peers()} | {self.me}
        return grouping is not None and grouping.splits(len(members))

    async def enter_roster(self, stop: StopRequest) -> int:
        """Count as a trainer from now on, in the roster from a round every peer agrees on: where
        the swarm's rounds run in groups once we are in (`rounds_grouped`), `LEAD_BEATS`
        heartbeats ahead of the swarm's round at its pace (node/roster.py), else from round 0 at
        once, as before; already a trainer, where we are. Returns the round id we are in from.
        Peers then expect us in that round: the caller brings our state there
        (node/state/download.py `download`)."""
        view = self._view()
        if view.role == "trainer":  # in already: a re-sync keeps its place (`rounds_grouped`)
            return view.in_from
        in_from = 0
        if self.rounds_grouped() and self.swarm_step() is not None:
            pace, start = StepPace(), trio.current_time()
            pace.saw(start, self.swarm_step())
            while pace.changes < PACE_CHANGES and trio.current_time() - start < PACE_WINDOW_S and not stop.is_set():
                await trio.sleep(PACE_POLL_S)
                pace.saw(trio.current_time(), self.swarm_step())
            round_s = pace.round_seconds(trio.current_time() - start, self.plan.period)
            if pace.changes < 2:  # a lower bound only: rounds longer than the watch
                reported = reported_round_seconds(self._reported_step_rates(), self.plan.period)
                round_s = max(round_s, reported or 0.0)
            lead_s = LEAD_BEATS * view.current_interval()
            step = self.swarm_step() or 0
            in_from = entry_round(step, self.plan.period, lead_rounds(lead_s, round_s))
            log.info(
                kv(
                    "entering the roster ahead",
                    in_from=in_from,
                    swarm_step=step,
                    round_s=round(round_s, 3),
                    lead_s=round(lead_s, 1),
                )
            )
        view.role, view.in_from = "trainer", in_from
        view.heartbeat()
        return in_from

    def _reported_step_rates(self) -> list[float]:
        """The `steps_per_s` rate every peer training now reports (node/pace.py reads the same)."""
        metrics = self._view().metrics()
        rates = (metrics[p].rate("steps_per_s") for p in self.training_peers(connected=False) if p in metrics)
        return [r for r in rates if r is not None]

    def training_peers(self, *, connected: bool) -> dict[str, PeerProgress]:
        """Trainers other than us that train *now*: their progress record is fresh (a training
        node refreshes it every heartbeat) and of this life. A trainer that is starting or
        downloading — perhaps restarted, its record left over from its last life — does not
        count: after the last training peer died, restarted nodes waited on each other's stale
        records for minutes; and a record of a last life stays fresh for a few heartbeats after
        the restart, when a round alone beside the restart was taken for a lineage of its own."""
        view = self._view()
        peers = set(self.candidates() if connected else self.trainers()) - {self.me}
        at = time.monotonic()
        return {p: pr for p, pr in view.progress().items() if p in peers and self._trains(view, pr, at)}

    def _trains(self, view: SwarmView, record: PeerProgress, at: float) -> bool:
        """Whether `record` says its peer trains now: written in the peer's present life (its
        membership record's `life_ms`, ours `started_ms`; swarm_records.py, "A peer's life") and
        refreshed within a few heartbeats."""
        peer = record.peer_id
        if record.updated_ms < (self.started_ms if peer == self.me else view.life_of(peer)):
            return False
        age = view.age(PROGRESS, peer, at)
        return age is not None and age <= PROGRESS_FRESH_BEATS * view.current_interval() + 5.0

    def heard_since_connected(self, peer: str) -> bool:
        """Whether `peer`'s latest progress record reached us after our connection to it opened:
        a process connected anew may be the peer restarted (node/state/parity.py, solo rounds)."""
        since, now = self.host.connected_since(peer), time.monotonic()
        age = self._view().age(PROGRESS, peer, now)
        return since is not None and age is not None and now - age >= since

    def swarm_step(self) -> int | None:
        """The furthest step a peer training now reports, or None if nobody trains."""
        steps = [pr.step for pr in self.training_peers(connected=False).values()]
        return max(steps) if steps else None

    def reported_step(self, peer: str) -> int | None:
        """The inner step `peer` reports in the swarm's progress records while it trains (None:
        no fresh record of its present life — a peer restarted from an older checkpoint must not
        be taken for past a round by the record of its last life). Ours too: held from our last
        life, it is dated fresh when the view starts, and our coordinator would take our
        trainer, fetching a state, for one that trains (collective/missing_peers.py
        `_own_trainer_away`)."""
        view = self._view()
        record = view.progress_of(peer)
        return record.step if record is not None and self._trains(view, record, time.monotonic()) else None

    def front_step(self) -> int | None:
        """The furthest step a connected peer training now reports (None: nobody)."""
        steps = [pr.step for pr in self.training_peers(connected=True).values()]
        return max(steps) if steps else None

    async def is_member(self, peer: str) -> bool:
        """A live membership record, any role (a joiner downloading state is "syncing"); its
        record may still be on its way, so wait up to `MEMBER_WAIT` seconds for it."""
        return await self._view().wait_live(peer, MEMBER_WAIT)

    def relay_candidates(self) -> list[str]:
        """Relays a private node reserves on: bootstrap peers, then members announced public."""
        out = [a for a in self.bootstrap if "/p2p/" in a]
        if self.view is not None:
            for p in self.view.live_peers():
                if p.connection == "public" and p.peer_id != self.me:
                    out.extend(dialable_addrs(p.addrs, p.peer_id)[:1])
        return list(dict.fromkeys(out))

    # -- how we are reached ----------------------------------------------------------------------

    def announced_addrs(self) -> list[str]:
        """What we announce we are reached at (our membership record's addresses, which NAT
        traversal keeps: circuit addresses while private), before the view: the host's."""
        return self.view.announced_addrs if self.view is not None else self.host.addrs

    def announce_connection(self, connection: str, addrs: list[str]) -> None:
        """How we are reached changed (transport/nat.py `on_announce`): our record says so at once,
        and so does our DHT announcement (whoever finds the swarm there dials what it names)."""
        self._view().set_connection(connection, addrs)
        if self.discovery is not None:
            self.discovery.readdress()

    def _refreshes_announcement(self) -> bool:
        """Whether this due refresh of our announcement is ours to make (`refreshes_announcement`)."""
        live = len(self.view.live_peers()) if self.view is not None else 0
        return refreshes_announcement(live, random.random())

    # -- advertising -----------------------------------------------------------------------------

    def advertisers(self) -> list[str]:
        """Who advertises the swarm now: the owner if live, then the first other live peers."""
        live = [p.peer_id for p in self._view().live_peers()]
        owner = self.signed.owner
        first = [owner] if owner in live else []
        return first + [p for p in live if p != owner][: ADVERTISERS - len(first)]

    async def _advertise(self, view: SwarmView, dht: Dht) -> None:
        """Store the swarm's advert while we are one of its advertisers (and admitted)."""
        while True:
            if self.me in self.advertisers() and self.not_admitted() is None:
                steps = [pr.step for pr in view.progress().values()]
                try:
                    await publish_advert(
                        dht,
                        swarm_id=self.signed.swarm_id,
                        spec=self.signed.to_wire(),
                        peers=len(view.live_peers()),
                        step=max(steps, default=0),
                        proof=self.capabilities.get(POW_CAP),
                        excluded=sum(s.excluded for s in self.standing().values()),
                        addrs=view.announced_addrs,
                    )
                except DhtError as e:  # InvalidRecord included: an oversized spec stays unlisted
                    log.info(kv("swarm advert not stored", error=str(e)))
            await trio.sleep(ADVERT_INTERVAL)

    # -- finding the swarm again (node/state/address_book.py) ----------------------------------------

    def known_trainers(self) -> list[str]:
        """Trainers of our address book seen live within `REJOIN_HORIZON_S` whose dials have not
        failed `REJOIN_DIALS` times in a row: the swarm as we last knew it, probably still there."""
        return [k.peer_id for k in self.book.fresh(REJOIN_HORIZON_S) if self._failed_dials(k.peer_id) < REJOIN_DIALS]

    def _failed_dials(self, peer: str) -> int:
        return self.dialler.failures(peer) if self.dialler is not None else 0

    def _meets_swarm(self) -> bool:
        """Whether this life has reached the swarm (`met_swarm`, set once): a trainer is a round
        candidate, or a peer of our address book is connected and its membership record reached
        us (it may be restarting too). A connection alone is not enough: a 5-minute soak's
        restart connected to three peers in its DHT bootstrap, a partition cut them off before
        the replicated records came, and the node, counting itself met and seeing nobody, trained
        from step 0 and published φ for 52 rounds of a lineage of its own."""
        if not self.met_swarm:
            others = [p for p in self.candidates() if p != self.me]
            live = {p.peer_id for p in self._view().live_peers()}
            self.met_swarm = bool(others) or any(
                p in live and self.host.is_connected(p) for p in self.book.peers if p != self.me
            )
        return self.met_swarm

    def cut_off(self) -> str | None:
        """Why this node must not train alone yet, or None. Until it first reaches another trainer
        of the swarm in this life, a node whose address book names trainers that are probably
        still there (`known_trainers`) is cut off from its swarm, not alone in it: training now
        would commit rounds alone, a fork of the swarm's φ. Once it reached one (`met_swarm`), the
        replicated membership decides who is in a round, as for every node."""
        if self._meets_swarm():
            return None
        known = self.known_trainers()
        if not known:
            return None
        age = (now_ms() - max(k.seen_ms for k in self.book.fresh(REJOIN_HORIZON_S))) / 1000
        return (
            f"cut off from the swarm: none of the {len(known)} trainers this node last saw "
            f"{age:.0f} s ago answers yet; re-dialling them (a trainer is taken for gone after "
            f"{REJOIN_DIALS} failed dials)"
        )

    def _rejoin_addrs(self) -> list[str]:
        """Addresses to bootstrap the DHT from: the configured ones, then one per known trainer."""
        book = [a for k in self.book.fresh(REJOIN_HORIZON_S) for a in k.dial_addrs()[:1]]
        return list(dict.fromkeys([*self.bootstrap, *book]))

    async def _bootstrap(self, dht: Dht, *, first: bool = False) -> None:
        """Bootstrap the DHT from `_rejoin_addrs`; while none answers, try again with backoff
        (called from the re-dial loop while the routing table is empty)."""
        addrs = self._rejoin_addrs()
        if not addrs or time.monotonic() < self._next_bootstrap:
            return
        try:
            await dht.bootstrap(addrs)
            self._dht_backoff.reset()
        except DhtError as e:
            delay = self._dht_backoff.next()
            self._next_bootstrap = time.monotonic() + delay
            if first:
                known = len(self.book.fresh(REJOIN_HORIZON_S))
                log.warning(
                    kv(
                        "no bootstrap peer reachable; re-dialling the swarm's trainers this node knew"
                        if known
                        else "no bootstrap peer reachable; running alone until peers dial us",
                        known=known,
                        error=str(e),
                    )
                )
            else:
                log.info(kv("DHT bootstrap failed again", retry_in_s=round(delay, 1), error=str(e)))

    def _book_peers_to_dial(self) -> dict[str, list[str]]:
        """Until we meet the swarm, the known trainers (past `REJOIN_DIALS` failures they are
        taken for gone, but still tried, more slowly: the `Dialler`'s backoff). Once we met it,
        none: the view holds the live ones, and the book's dead entries (up to `MAX_PEERS`)
        would only take dial slots from the members."""
        if self._meets_swarm():
            return {}
        return {k.peer_id: k.dial_addrs() for k in self.book.fresh(REJOIN_HORIZON_S)}

    # -- staying connected -----------------------------------------------------------------------

    def wanted(self) -> list[str]:
        """The peers we keep connected now, most wanted first (`ConnectionPlan.wanted`)."""
        view = self._view()
        members = [p.peer_id for p in view.live_peers()]
        ours = self.current_round() if self.current_round is not None else None
        rounds = self.bound.rounds_under_way(ours if ours is not None else (self.swarm_step() or 0), view.in_from)
        return self.plan.wanted(members, self.trainers(), rounds, in_from=self.roster_entries())

    def connection_counts(self) -> dict[str, int]:
        """What the status document shows of the bound (node/bound.py `ConnectionBound.counts`)."""
        return self.bound.counts()

    def _dialled(self, peer: str, ok: bool) -> None:
        """A dial ended: a relayed connection is upgraded (DCUtR) in the background."""
        if ok and self.nat is not None and self.host.connection_type(peer) == "relayed":
            assert self._nursery is not None  # dials run in it
            self._nursery.start_soon(self.nat.upgrade, peer)

    async def _keep_connected(self, view: SwarmView, discovery: Discovery, dialler: Dialler) -> None:
        """Dial the peers we want and are not connected to, and the address book's trainers that
        the view does not hold; close the surplus over the bound; keep the book up to date."""
        host = self.host
        dht = self.dht
        assert dht is not None  # entered before this task starts
        pace = DiscoveryPace()
        while True:
            self._wake = trio.Event()  # before the pass: a round asked during it wakes the next
            left = {p.peer_id for p in view.peers() if p.left}
            self.book.note(view.live_peers(), left=sorted(left))
            self.book.save()
            if not dht.routing_table_peers():
                await self._bootstrap(dht)
            addrs = {p.peer_id: p.addrs for p in view.live_peers()}
            wanted = self.wanted()
            for rank, peer in enumerate(wanted):  # DEBUG: who dials whom, and why (the churn's census)
                if dialler.dial(peer, addrs.get(peer, [])):
                    log.debug(kv("dialling", peer=peer[-8:], why="plan", rank=rank))
            for peer, book_addrs in self._book_peers_to_dial().items():
                if peer not in addrs and dialler.dial(peer, book_addrs):
                    log.debug(kv("dialling", peer=peer[-8:], why="address book"))
            if pace.due(host.peer_id, set(addrs), left, time.monotonic(), random.random()):
                try:
                    found = await discovery.peers()
                except MeshtrainError as e:
                    log.info(kv("discovery lookup failed", error=str(e)))
                    found = []
                room = self.plan.max_peers - len(host.connected_peers())
                for a in found:  # not in the view yet: how a node that knows nobody finds the swarm
                    if a.peer_id not in addrs and room > 0 and dialler.dial(a.peer_id, a.addrs):
                        log.debug(kv("dialling", peer=a.peer_id[-8:], why="discovery"))
                        room -= 1
            await self.bound.close_surplus(view, wanted)
            with trio.move_on_after(CONNECT_INTERVAL):
                await self._wake.wait()
