"""The connection bound: which connections over `max_peers` a node closes, when, and which a DHT
query's it keeps.

Problem. The presence plan (node/connections.py `ConnectionPlan`) says whom a node wants; what it
holds is also what others opened — a peer whose plan wants us, a DHT query's, a joiner fetching
the spec — and what it wanted a round ago. Closed too soon, a query fails or a round loses a
partner it is about to need; kept, the node sits over its bound.

Design. `ConnectionBound` is presence's (node/presence.py): every pass of its connection loop
`close_surplus` is told the plan, and while the host holds more than `max_peers` connections it
closes those not wanted for a grace (`grace`):
- `CLOSE_GRACE_S` (10 s) for a trainer: a connection someone else opened (an inbound dial of a
  peer whose view differs, whose query or RPC finishes first: closing at once made every lookup
  fail and py-libp2p churn), and a past round's partner (`UnwantedSince.was_wanted`) while the
  swarm's rounds are shorter than that grace;
- `FORMER_GRACE_S` (2 s) for a past round's partner once rounds last `CLOSE_GRACE_S` or longer
  (the swarm's pace as the front step moves, `StepPace`): a partner needed again is then in the
  plan, and dialled, a whole round — at least that long — before its round. Past partners were
  half of what held 13 daemons at 25 s rounds over their bound (the DEBUG census below). Where
  rounds take under a second, a 2 s grace closed a partner needed again two rounds later, which
  then averaged alone (tests/test_grouped_daemons.py): there the 10 s grace stays;
- `STRANGER_GRACE_S` (30 s) for a peer not in the view (a joiner fetching the spec);
never a syncing member's (it may be downloading the state from us), nor a trainer whose own plan
keeps us (`needing_us`: `ConnectionPlan.wanted_by`, computed from our view with the rounds under
way at the step it reports, a joiner not training yet at its roster round): it dials us again
when we close it, and a peer a round ahead or behind ours still needs us in its round (closing
it stalled both). Kept for every partner of its next three rounds, as before, a peer held 43
connections at 256 members where every plan kept 32.
The grace counts from when a connection was last wanted, not from when it opened: a partner of a
round two rounds ahead is wanted again a round before it, and where rounds take under a second
it is still held then.

`keeps(peer)` is the host's policy for one-off connections (transport/one_off.py): in a swarm
larger than the bound, a connection one of our DHT queries dialled to a trainer stays only where
the bound would not close it — in the plan as it is now, needing us —; in the full mesh every
one stays; one to a peer that is not a live trainer (a syncing member, a joiner not
in the view yet, which may be fetching the spec over it; a node of another swarm) stays too,
for the bound's own graces; and every one stays before the connection loop's first plan (nothing
to judge by yet: closed then, a pipeline swarm's first hops lost their connections). Not because
we hold fewer than `max_peers`: the other end may not.

What it shows (`counts`, the status document's `node.connections`): connections, the bound, the
plan's size, those held outside it, closes over the bound since start (one that keeps climbing
much faster than rounds go by is churn) and one-off connections hung up. At DEBUG, every pass over
the bound logs what holds the node there: the census that found the one-off connections.

Not here: whom the plan wants (node/connections.py), dialling (`Dialler`), the one-off
connections themselves (transport/one_off.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from meshtrain.crdt.swarm_view import SwarmView
from meshtrain.log import get_logger, kv
from meshtrain.node.connections import ConnectionPlan, UnwantedSince
from meshtrain.node.roster import StepPace
from meshtrain.transport.host import Host

log = get_logger(__name__)

CLOSE_GRACE_S = 10.0  # a trainer's connection is not closed over the bound before this,
FORMER_GRACE_S = 2.0  # a past partner's, where rounds last CLOSE_GRACE_S or more, before this,
STRANGER_GRACE_S = 30.0  # a peer's not in the view before this


class ConnectionBound:
    """A node's connections held to `plan.max_peers` (module docstring). `trainers` and
    `roster_entries` are presence's: the view's trainers and their roster rounds."""

    def __init__(
        self,
        host: Host,
        plan: ConnectionPlan,
        trainers: Callable[[], list[str]],
        roster_entries: Callable[[], dict[str, int]],
    ) -> None:
        self.host, self.plan = host, plan
        self.trainers, self.roster_entries = trainers, roster_entries
        self.unwanted = UnwantedSince()
        self.closed = 0  # connections closed over the bound since start (the churn)
        self.last_wanted: frozenset[str] = frozenset()  # the plan at the connection loop's last pass
        self.planned = False  # whether the loop has made a plan yet (before it, keep every connection)
        self.pace = StepPace()  # the swarm's front step as the loop saw it move: its rounds' length

    def rounds_under_way(self, round_id: int, in_from: int) -> list[int]:
        """The rounds a peer in `round_id`, in the roster from `in_from`, keeps its partners of:
        its round, the one whose join is prepared ahead, and — a joiner waiting for its roster
        round — that round (its partners there, and donors)."""
        rounds = [round_id, round_id + self.plan.period]
        if in_from > round_id:
            rounds.append(in_from)
        return rounds

    def opened(self, peer: str) -> None:
        """A host listener: a connection opened again counts as unwanted from now, not from when
        its last one went unwanted (else one reopened between two passes was closed at once)."""
        self.unwanted.opened(peer, time.monotonic())

    def needing_us(self, view: SwarmView, peers: list[str]) -> set[str]:
        """Those of `peers` whose own plan keeps us (module docstring)."""
        steps = {p: pr.step for p, pr in view.progress().items()}
        members = [p.peer_id for p in view.live_peers()]
        trainers, entries = self.trainers(), self.roster_entries()
        steps |= {p: e for p, e in entries.items() if e > 0 and p not in steps}  # a joiner not training yet
        return {
            p
            for p in peers
            if p in steps
            and self.plan.wanted_by(
                p, members, trainers, self.rounds_under_way(steps[p], entries.get(p, 0)), in_from=entries
            )
        }

    def keeps(self, view: SwarmView | None, peer: str, wanted: Callable[[], list[str]]) -> bool:
        """Whether a connection a DHT query dialled to `peer` stays open after it (module
        docstring); `wanted` is the plan now (the last pass's may be 2 s old)."""
        if view is None or not self.planned or peer in self.last_wanted:
            return True
        live = {p.peer_id: p.role for p in view.live_peers()}
        if len(live) <= self.plan.max_peers + 1 or live.get(peer) != "trainer":
            return True  # the full mesh (every member wanted), or not a live trainer
        return peer in wanted() or bool(self.needing_us(view, [peer]))

    def round_seconds(self) -> float | None:
        """How long the swarm's rounds take, as the front step was seen to move (None: not yet
        seen to move twice)."""
        return self.pace.round_seconds(0.0, self.plan.period) if self.pace.changes >= 2 else None

    def grace(self, peer: str, live: dict[str, str]) -> float:
        """How long `peer`'s connection goes unwanted before it is closed over the bound."""
        if peer not in live:
            return STRANGER_GRACE_S
        round_s = self.round_seconds()
        if self.unwanted.was_wanted(peer) and round_s is not None and round_s >= CLOSE_GRACE_S:
            return FORMER_GRACE_S
        return CLOSE_GRACE_S

    async def close_surplus(self, view: SwarmView, wanted: list[str]) -> None:
        """A pass of the connection loop with this plan: while over `max_peers` connections,
        close those past their grace that nothing keeps (module docstring)."""
        self.last_wanted, self.planned = frozenset(wanted), True
        connected = self.host.connected_peers()
        live = {p.peer_id: p.role for p in view.live_peers()}
        now = time.monotonic()
        self.pace.saw(now, max((pr.step for pr in view.progress().values()), default=None))
        self.unwanted.note(connected, self.last_wanted, now)
        surplus = len(connected) - self.plan.max_peers
        if surplus <= 0:
            return
        unwanted = [
            p
            for p in connected
            if p not in self.last_wanted
            and live.get(p, "trainer") == "trainer"
            and self.unwanted.seconds(p, now) > self.grace(p, live)
        ]
        needs_us: set[str] = set()
        if unwanted:
            needs_us = self.needing_us(view, unwanted)
            self.unwanted.wanted_now(needs_us, now)
            unwanted = [p for p in unwanted if p not in needs_us]
        if log.isEnabledFor(logging.DEBUG):
            self._log_census(connected, live, needs_us, unwanted[:surplus], now)
        for peer in unwanted[:surplus]:
            log.debug(kv("closing a connection over the bound", peer=peer[-8:], max_peers=self.plan.max_peers))
            self.closed += 1
            await self.host.disconnect(peer)

    def _log_census(
        self, connected: list[str], live: dict[str, str], needs_us: set[str], closing: list[str], now: float
    ) -> None:
        """What holds the node over its bound at this pass (DEBUG)."""
        kept = [p for p in connected if p not in self.last_wanted and p not in closing]
        graced = [p for p in kept if p not in needs_us and live.get(p, "trainer") == "trainer"]
        log.debug(
            kv(
                "over the bound",
                held=len(connected),
                wanted=len(self.last_wanted & set(connected)),
                needs_us=len(needs_us),
                syncing=sum(live.get(p, "trainer") != "trainer" for p in kept),
                graced=",".join(
                    f"{p[-8:]}:{'former' if self.unwanted.was_wanted(p) else 'other'}:{self.unwanted.seconds(p, now):.0f}"
                    for p in graced
                ),
                closing=len(closing),
            )
        )

    def counts(self) -> dict[str, int]:
        """The status document's `node.connections`: `connections` (every libp2p connection the
        host holds: members, relays, DHT strangers), `max_peers`, `wanted` (the plan's size at the
        last pass: at most the bound, or the partners of the rounds under way where they are
        more), `unwanted` (connected, not in that plan: within a grace, a syncing member, a peer
        whose plan keeps us, or while we are under the bound), `closed` (closed over the bound
        since start) and `one_off_closed` (DHT queries' connections hung up after them)."""
        connected = set(self.host.connected_peers())
        return {
            "connections": len(connected),
            "max_peers": self.plan.max_peers,
            "wanted": len(self.last_wanted),
            "unwanted": len(connected - self.last_wanted),
            "closed": self.closed,
            "one_off_closed": self.host.one_off.closed,
        }
