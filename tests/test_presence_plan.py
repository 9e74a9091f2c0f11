"""Whom a node keeps connected (node/connections.py `ConnectionPlan`), without a network: the full
mesh while the swarm is small, and above the bound a set that holds every partner of this round
and of the next, and does not grow with the swarm; and how often it reads the swarm's DHT key
(`DiscoveryPace`)."""

from __future__ import annotations

import random
from itertools import pairwise

from meshtrain.collective.groups import GroupPlan
from meshtrain.node.bound import CLOSE_GRACE_S, FORMER_GRACE_S, STRANGER_GRACE_S, ConnectionBound
from meshtrain.node.connections import (
    ANNOUNCERS,
    DISCOVERY_AFTER_LOSS_S,
    DISCOVERY_INTERVAL,
    DISCOVERY_SETTLED_INTERVAL,
    KEY_READERS,
    ConnectionPlan,
    DiscoveryPace,
    UnwantedSince,
    refreshes_announcement,
)
from meshtrain.transport.identity import Identity


def peer_ids(n: int) -> list[str]:
    return [Identity.from_seed(i.to_bytes(32, "big")).peer_id_str for i in range(1, n + 1)]


IDS = peer_ids(256)


def test_a_swarm_within_the_bound_is_the_full_mesh():
    me, members = IDS[0], IDS[:33]
    plan = ConnectionPlan(me, max_peers=32, grouping=GroupPlan(group_size=4, period=2))
    assert sorted(plan.wanted(members, members, rounds=[8])) == sorted(members[1:])


def test_a_large_swarm_keeps_the_partners_of_rounds_under_way_and_of_the_next_within_the_bound():
    grouping = GroupPlan(group_size=0, seed=3, period=2)  # automatic: groups of 16 above 32 peers
    plans = {p: ConnectionPlan(p, max_peers=32, grouping=grouping) for p in IDS}
    wanted = {p: set(plan.wanted(IDS, IDS, rounds=[8, 10])) for p, plan in plans.items()}
    for me in IDS[:16]:
        under_way = {*grouping.partners(IDS, 8, me), *grouping.partners(IDS, 10, me)}
        ahead = set(grouping.partners(IDS, 12, me)) - under_way
        assert under_way <= wanted[me] and me not in wanted[me] and len(wanted[me]) <= 32
        assert all(me in wanted[b] for b in wanted[me] & ahead)  # the next round's: where both ends keep them
    # what one peer holds is its plan and the plans that keep it: within the bound too (every
    # partner of three rounds, kept for the other end whatever its plan, was 43 of 256)
    held = {me: wanted[me] | {p for p in IDS if me in wanted[p]} for me in IDS}
    assert max(len(h) for h in held.values()) <= 32
    # gossip samples are mutual: neither end of a sampled pair closes what the other wants
    a, b = ConnectionPlan(IDS[0], max_peers=10_000), ConnectionPlan(IDS[1], max_peers=10_000)
    assert a._sampled(IDS[1], 255) == b._sampled(IDS[0], 255)


def test_the_next_rounds_partners_are_kept_where_there_is_room_at_both_ends():
    members = IDS[:64]
    grouping = GroupPlan(group_size=4, seed=3, period=2)
    plans = {p: ConnectionPlan(p, max_peers=32, grouping=grouping) for p in members}
    for me in members[:8]:
        ahead = set(grouping.partners(members, 12, me))
        assert ahead <= set(plans[me].wanted(members, members, rounds=[8, 10]))


def test_a_peer_is_kept_where_its_own_plan_keeps_us_as_it_reports_its_round():
    """`wanted_by`: the other end's plan, computed here from the round it reports. A peer a round
    ahead keeps the partners of its rounds, not of ours: closed, it would dial them again."""
    members = IDS[:64]
    grouping = GroupPlan(group_size=4, seed=3, period=2)
    plans = {p: ConnectionPlan(p, max_peers=8, grouping=grouping, sample=0, neighbours=0) for p in members}
    me = members[0]
    for peer in members[1:]:
        its_plan = plans[peer].wanted(members, members, rounds=[10, 12])
        assert plans[me].wanted_by(peer, members, members, [10, 12]) == (me in its_plan)
    ahead_of_us = [p for p in members if me in grouping.partners(members, 12, p) and p != me]
    assert ahead_of_us and all(plans[me].wanted_by(p, members, members, [10, 12]) for p in ahead_of_us)


def test_this_rounds_partners_are_kept_even_beyond_the_bound_and_whole_swarm_rounds_keep_every_trainer():
    members = IDS[:40]
    grouped = ConnectionPlan(IDS[0], max_peers=3, grouping=GroupPlan(group_size=8))
    wanted = grouped.wanted(members, members, rounds=[0])
    partners = GroupPlan(group_size=8).partners(members, 0, IDS[0])
    assert len(partners) > 3 and list(wanted) == list(partners)  # over the bound: the round needs them all
    ungrouped = ConnectionPlan(IDS[0], max_peers=3, grouping=None)  # NoLoCo, pipelines
    assert sorted(ungrouped.wanted(members, members[:20], rounds=[0])) == sorted(members[1:20])


def test_a_connection_counts_as_unwanted_from_when_it_was_last_wanted_not_from_when_it_opened():
    """Presence closes a connection over the bound once it has gone unwanted for a grace. Counted
    from when the connection opened, an old connection to a partner of a round two rounds ahead
    was closed the moment it left the plan, and had to be re-dialled within one round."""
    a, b, c = IDS[:3]
    unwanted = UnwantedSince()
    unwanted.note([a, b], wanted={a, b}, now=0.0)
    unwanted.note([a, b], wanted={a, b}, now=58.0)  # b, connected for a minute, wanted at 58 s
    unwanted.note([a, b, c], wanted={a}, now=60.0)  # ... and no longer at 60 s; c just connected
    assert unwanted.seconds(a, 61.0) == 1.0 and unwanted.seconds(b, 61.0) == 3.0
    assert unwanted.seconds(c, 61.0) == 1.0  # never wanted: counted from when it was first seen
    unwanted.note([a, b, c], wanted={a}, now=75.0)
    assert unwanted.seconds(b, 75.0) == 17.0
    unwanted.wanted_now({b, "not connected"}, now=75.0)  # b's own round needs us after all
    assert unwanted.seconds(b, 75.0) == 0.0 and unwanted.seconds("not connected", 80.0) == 0.0
    unwanted.note([a], wanted={a}, now=80.0)  # b and c closed: forgotten
    unwanted.note([a, b], wanted=set(), now=90.0)
    assert unwanted.seconds(b, 90.0) == 0.0 and unwanted.seconds(a, 90.0) == 10.0
    # b's connection closed and opened again between two passes: unwanted from its opening
    unwanted.opened(b, now=99.0)
    unwanted.note([a, b], wanted=set(), now=100.0)
    assert unwanted.seconds(b, 100.0) == 1.0 and unwanted.seconds(a, 100.0) == 20.0


def test_a_past_partner_closes_sooner_only_where_rounds_outlast_the_grace():
    """node/bound.py: a past round's partner gets `FORMER_GRACE_S` once the swarm's rounds (its
    front step, watched) last `CLOSE_GRACE_S` or more; where they are shorter, or not yet seen,
    and for a connection someone else opened, the full grace; a peer not in the view, its own."""
    me, partner, stranger_trainer, outsider = IDS[:4]
    plan = ConnectionPlan(me, max_peers=3, grouping=GroupPlan(group_size=3, period=40))
    bound = ConnectionBound(None, plan, lambda: [], dict)  # type: ignore[arg-type]  # grace needs no host
    live = {me: "trainer", partner: "trainer", stranger_trainer: "trainer"}
    bound.unwanted.note([partner, stranger_trainer], wanted={partner}, now=0.0)  # a partner, then not
    bound.unwanted.note([partner, stranger_trainer], wanted=set(), now=1.0)
    assert bound.round_seconds() is None  # the step not yet seen to move twice
    assert bound.grace(partner, live) == CLOSE_GRACE_S
    for t, step in [(0.0, 0), (0.5, 40), (1.0, 80), (1.5, 120)]:  # sub-second rounds
        bound.pace.saw(t, step)
    assert bound.round_seconds() == 0.5 and bound.grace(partner, live) == CLOSE_GRACE_S
    for t, step in [(30.0, 160), (55.0, 200), (80.0, 240), (105.0, 280), (130.0, 320)]:  # 25 s rounds
        bound.pace.saw(t, step)
    assert bound.round_seconds() is not None and bound.round_seconds() >= CLOSE_GRACE_S
    assert bound.grace(partner, live) == FORMER_GRACE_S
    assert bound.grace(stranger_trainer, live) == CLOSE_GRACE_S  # never our partner: its query finishes first
    assert bound.grace(outsider, live) == STRANGER_GRACE_S
    for t, step in enumerate(range(360, 360 + 40 * 20, 40), start=131):  # rounds of a second again
        bound.pace.saw(float(t), step)
    assert bound.round_seconds() == 1.0 and bound.grace(partner, live) == CLOSE_GRACE_S


def test_about_four_members_refresh_their_announcement_per_interval_at_any_size():
    """node/connections.py `refreshes_announcement`: every member of a small swarm, about
    `ANNOUNCERS` of a large one (the key holds some dozen live announcements, its holders get
    a few stores a minute instead of one per member)."""
    rng = random.Random(5)
    assert all(refreshes_announcement(n, rng.random()) for n in range(1, ANNOUNCERS + 1) for _ in range(100))
    for members in (13, 64, 256):
        intervals = 300
        made = sum(refreshes_announcement(members, rng.random()) for _ in range(members * intervals))
        assert abs(made / intervals - ANNOUNCERS) < 0.6, (members, made / intervals)


def reads(pace: DiscoveryPace, me: str, live_at, left_at=lambda t: set(), until: float = 900.0) -> list[float]:
    """The times (one connection-loop pass a second) at which `pace` reads the swarm's key."""
    return [float(t) for t in range(int(until)) if pace.due(me, live_at(t), left_at(t), float(t))]


def test_the_swarm_key_is_read_often_only_while_looking_for_the_swarm():
    """Read every 15 s and announced every 20 s, one key's lookups dialled its same few holders
    from every node: most of the connections the bound closed. A node that holds no other member
    reads it every DISCOVERY_INTERVAL; once the view holds members, every
    DISCOVERY_SETTLED_INTERVAL."""
    me, others = IDS[0], set(IDS[1:5])
    alone = reads(DiscoveryPace(), me, lambda t: {me})
    assert alone[0] == 0.0 and all(b - a <= DISCOVERY_INTERVAL + 1 for a, b in pairwise(alone))
    settled = reads(DiscoveryPace(), me, lambda t: {me} if t < 30 else {me} | others)
    later = [t for t in settled if t >= 30]
    assert later and all(b - a > DISCOVERY_SETTLED_INTERVAL for a, b in pairwise(later))
    assert len(later) <= 900 / DISCOVERY_SETTLED_INTERVAL


def test_about_four_members_read_the_swarm_key_per_interval_and_a_node_alone_always_reads():
    """`DiscoveryPace` with real draws: at 13, 64 and 256 live members, settled and after a loss,
    about `KEY_READERS` of them make each due read — not one lookup per member at the key's few
    holders (13 daemons: DHT queries' connections kept nodes over their bound) — while a node
    whose view holds nobody else reads at every due time."""
    rng = random.Random(7)
    for members in (13, 64, 256):
        live = set(IDS[:members])
        for interval, lose_one in ((DISCOVERY_SETTLED_INTERVAL, False), (DISCOVERY_INTERVAL, True)):
            # Every one a due read (after a loss, within DISCOVERY_AFTER_LOSS_S of it).
            times = [
                k * (interval + 1) for k in range(1, 41) if not lose_one or k * (interval + 1) < DISCOVERY_AFTER_LOSS_S
            ]
            made = 0
            for me in IDS[1:members]:
                pace = DiscoveryPace()
                pace.due(me, live, set(), 0.0)  # the first read, at start: always made
                now_live = live - {IDS[0]} if lose_one else live  # a lease ran out: looking for it
                made += sum(pace.due(me, now_live, set(), float(t), rng.random()) for t in times)
            per_interval = made / len(times)
            assert abs(per_interval - KEY_READERS) < 0.8, (members, interval, per_interval)
    me = IDS[0]
    pace = DiscoveryPace()
    made = [t for t in range(900) if pace.due(me, {me}, set(), float(t), 0.99)]
    assert made[0] == 0 and all(b - a <= DISCOVERY_INTERVAL + 1 for a, b in pairwise(made))


def test_a_member_whose_lease_ran_out_is_looked_for_a_while_and_one_that_left_is_not():
    """It may be behind a partition: once that heals, its announcement is how the halves meet
    again (the view no longer holds it), so the key is read every DISCOVERY_INTERVAL for
    DISCOVERY_AFTER_LOSS_S after. A member that left cleanly is not looked for."""
    me, others = IDS[0], set(IDS[1:5])
    gone = IDS[4]

    def live(t: float) -> set[str]:
        return {me} | (others if t < 200 else others - {gone})

    lost = reads(DiscoveryPace(), me, live)
    after = [t for t in lost if 200 <= t < 200 + DISCOVERY_AFTER_LOSS_S]
    assert after[0] - 200 <= DISCOVERY_INTERVAL + 1 and len(after) >= DISCOVERY_AFTER_LOSS_S / (DISCOVERY_INTERVAL + 1)
    tail = [t for t in lost if t >= 200 + DISCOVERY_AFTER_LOSS_S]
    assert all(b - a > DISCOVERY_SETTLED_INTERVAL for a, b in pairwise(tail))
    left = reads(DiscoveryPace(), me, live, left_at=lambda t: {gone} if t >= 200 else set())
    assert all(b - a > DISCOVERY_SETTLED_INTERVAL for a, b in pairwise(left[1:]))  # after the first, at 0


def test_a_pair_is_kept_at_both_ends_or_at_neither():
    """One end's wish is not the pair's: DHT nearness is one-sided and the cut at the bound falls
    elsewhere at each end. Where a kept b and b did not, b closed the connection over its bound
    and a dialled it again seconds later (65 to 113 closes per daemon in 4 minutes, 13 daemons,
    bound 6). Each end keeps what both wishes keep, within the bound, partners of the round
    under way always."""
    members = IDS[:64]
    grouping = GroupPlan(group_size=4, seed=3, period=2)
    plans = {p: ConnectionPlan(p, max_peers=12, grouping=grouping) for p in members}
    wanted = {p: set(plan.wanted(members, members, rounds=[8, 10])) for p, plan in plans.items()}
    one_sided = 0
    for a in members:
        wish = plans[a].wish(members, members, rounds=[8, 10])
        assert set(wish.partners) <= wanted[a] <= set(wish.all()) and len(wanted[a]) <= 12
        for b in wish.rest:
            b_wish = plans[b].wish(members, members, rounds=[8, 10]).all()
            one_sided += a not in b_wish
            assert (b in wanted[a]) == (a in wanted[b]) == (a in b_wish), (a, b)
    assert one_sided > 0  # the one-sided wishes the rule is for are there to be covered


def test_a_former_partner_is_told_from_a_connection_someone_else_opened():
    """Presence closes a past round's partner sooner (its round has ended) than a connection it
    never wanted (a DHT query's, a peer whose view differs: theirs must finish first)."""
    a, b, c = IDS[:3]
    unwanted = UnwantedSince()
    unwanted.note([a, b], wanted={a, b}, now=0.0)  # b: a partner of this round
    unwanted.note([a, b, c], wanted={a}, now=2.0)  # the round ended; c dialled us
    assert unwanted.was_wanted(b) and not unwanted.was_wanted(c)
    unwanted.opened(b, now=3.0)  # b's connection closed and b dialled us again: not ours
    assert not unwanted.was_wanted(b)
    unwanted.wanted_now({c}, now=3.5)  # c's own plan keeps us: its round's partner
    assert unwanted.was_wanted(c)
    unwanted.note([a, c], wanted={a, c}, now=4.0)
    unwanted.note([a], wanted={a}, now=6.0)  # c disconnected: forgotten, not a former partner
    assert not unwanted.was_wanted(c) and unwanted.was_wanted(a)
