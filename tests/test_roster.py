"""The roster of a round (collective/groups.py "Failures", node/roster.py): a trainer is in the
roster from the round its membership record announces (`in_from`), so every peer computes a
round's groups from the same trainers whenever the record reached it; the joiner picks that round
a lead ahead, in time converted to rounds; the record's field is untrusted input, checked alike on
every peer, and a record without it (a peer that predates it) is in from round 0. The record's
other capability field, when the peer's life began (`life`), is checked and read alike."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.groups import GroupPlan, in_roster
from meshtrain.crdt import CrdtError, Replica, SwarmView, swarm_specs
from meshtrain.crdt.swarm_records import IN_FROM, INT64_MAX, LIFE, MEMBERSHIP, check_membership, peer_info
from meshtrain.crdt.types import LWWRegister, now_ms
from meshtrain.node.connections import ConnectionPlan
from meshtrain.node.roster import (
    MAX_LEAD_ROUNDS,
    MIN_LEAD_ROUNDS,
    StepPace,
    entry_round,
    lead_rounds,
    reported_round_seconds,
)
from meshtrain.transport.identity import Identity

from .test_crdt_replica import SWARM, start_hosts
from .test_presence_plan import peer_ids

OWNER = Identity.generate()


def peers(n: int) -> list[str]:
    return [f"12D3Koo{i:05d}" for i in range(n)]


# --- the rule: a function of the round ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 64))
def test_a_trainer_is_in_every_round_of_its_group_round_and_after_and_in_none_before(in_from, round_id, period):
    inside = in_roster(in_from, round_id, period)
    assert inside == (round_id // period >= in_from // period)
    # every round id of one group round (its fragments) sees the same roster
    start = round_id - round_id % period
    assert all(in_roster(in_from, r, period) == inside for r in range(start, start + period))
    assert not inside or in_roster(in_from, round_id + period, period)  # once in, in for good
    assert in_roster(0, round_id, period)  # a record without the field: in from the start


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(peers(40)), st.integers(0, 400), max_size=40), st.integers(0, 400))
def test_the_roster_of_a_round_is_the_same_whatever_order_the_records_arrived_in(entries, round_id):
    plan = GroupPlan(group_size=4, seed=3, period=2)
    arrived = dict(reversed(list(entries.items())))  # another peer heard them in another order
    assert plan.roster(entries, round_id) == plan.roster(arrived, round_id)
    assert plan.groups(plan.roster(entries, round_id), round_id) == plan.groups(
        plan.roster(arrived, round_id), round_id
    )
    # a joiner whose record is known but whose round has not come changes no group
    before = {p: r for p, r in entries.items() if r // 2 <= round_id // 2}
    assert plan.roster(entries, round_id) == plan.roster(before, round_id)


def test_whether_a_round_splits_follows_the_groups():
    for group_size in (0, 2, 3, 16):
        plan = GroupPlan(group_size=group_size)
        for n in range(1, 80):
            assert plan.splits(n) == (not plan.groups(peers(n), 0).whole_swarm), (group_size, n)


# --- the lead -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.floats(0.0, 600.0), st.one_of(st.floats(0.0, 3600.0), st.just(float("nan")), st.just(float("inf"))))
def test_the_lead_in_rounds_covers_the_lead_in_time_between_the_floor_and_the_cap(lead_s, round_s):
    rounds = lead_rounds(lead_s, round_s)
    assert MIN_LEAD_ROUNDS <= rounds <= MAX_LEAD_ROUNDS
    if round_s > 0 and round_s != float("inf") and rounds < MAX_LEAD_ROUNDS:
        assert rounds * round_s >= lead_s  # the lead in time is covered unless capped


def test_the_lead_is_seconds_of_heartbeats_whatever_the_rounds_last():
    assert lead_rounds(6.0, 0.5) == 12  # fast rounds: many of them
    assert lead_rounds(6.0, 600.0) == MIN_LEAD_ROUNDS  # ten-minute rounds: the floor
    assert lead_rounds(6.0, 0.02) == MAX_LEAD_ROUNDS  # a swarm of one's rounds: the cap
    assert lead_rounds(6.0, 0.0) == MAX_LEAD_ROUNDS  # a pace of no time says nothing


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**7), st.integers(1, 500), st.integers(MIN_LEAD_ROUNDS, MAX_LEAD_ROUNDS))
def test_a_joiner_enters_at_a_group_rounds_start_after_the_swarm_ran_the_lead_without_it(step, period, ahead):
    in_from = entry_round(step, period, ahead)
    assert in_from % period == 0
    next_round = step // period + 1  # the group round the swarm runs next
    assert in_from // period == next_round + ahead
    assert not in_roster(in_from, step, period) and not in_roster(in_from, next_round * period, period)


def test_the_pace_is_measured_between_changes_and_bounded_below_without_two():
    pace = StepPace()
    pace.saw(0.0, 100)  # the first reading: no change yet
    assert pace.changes == 0 and pace.round_seconds(2.0, period=2) == 2.0  # not one move in 2 s
    pace.saw(0.1, 100)
    pace.saw(0.5, 102)
    assert pace.changes == 1 and pace.round_seconds(2.0, period=2) == 1.0  # one move in 2 s
    pace.saw(0.9, 104)
    pace.saw(1.7, 108)
    pace.saw(1.8, 107)  # a staler record read later: no step back
    assert pace.changes == 3
    assert pace.round_seconds(2.0, period=2) == pytest.approx((1.7 - 0.5) * 2 / 6)
    pace.saw(1.9, None)  # nobody trains for a moment: nothing to learn
    assert pace.changes == 3


def test_rounds_longer_than_the_watch_are_bounded_by_the_step_rate_peers_report():
    """A 2 s watch of 25 s rounds (a benchmark's: 40 steps of 0.5 s, 5 s of rounds' waits) sees
    no change, a lower bound of 2 s, and a 6.5 s lead counted as 4 rounds where 2 cover it; the
    median reported step rate reads a round as 20 s (its waits left out: still short of 25), and
    the lead as the floor."""
    watched = StepPace()
    watched.saw(0.0, 400)
    lower = watched.round_seconds(2.0, period=40)
    reported = reported_round_seconds([2.0, 2.1, 1.9, float("nan"), 0.0, -1.0], period=40)
    assert lower == 2.0 and reported == pytest.approx(20.0)
    assert lead_rounds(6.5, lower) == 4 and lead_rounds(6.5, max(lower, reported)) == MIN_LEAD_ROUNDS
    assert reported_round_seconds([], period=40) is None
    assert reported_round_seconds([float("inf"), 0.0], period=40) is None
    assert reported_round_seconds([1.0, 4.0], period=8) == 8.0  # the lower median: the slower peer


# --- the record's field ---------------------------------------------------------------------------


def membership(caps: dict) -> list:
    return [1_000, {"addrs": [], "role": "trainer", "caps": caps, "conn": "direct", "lease": 60_000, "left": False}]


def entry_with(caps: dict):
    record = membership(caps)
    return LWWRegister(SWARM, MEMBERSHIP).set(OWNER, record[1], timestamp=record[0])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, INT64_MAX))
def test_a_records_roster_round_is_read_once_into_peer_info(in_from):
    info = peer_info(entry_with({"pow": 7, IN_FROM: in_from}))
    check_membership(entry_with({"pow": 7, IN_FROM: in_from}))
    assert info.in_from == in_from
    assert info.capabilities == {"pow": 7}  # parsed out of the capabilities, not left in them


@settings(max_examples=100, deadline=None)
@given(st.integers(0, INT64_MAX), st.integers(0, INT64_MAX))
def test_a_records_life_is_read_once_into_peer_info_beside_its_roster_round(life, in_from):
    entry = entry_with({"pow": 7, LIFE: life, IN_FROM: in_from})
    check_membership(entry)
    info = peer_info(entry)
    assert (info.life_ms, info.in_from, info.capabilities) == (life, in_from, {"pow": 7})


def test_a_record_without_the_fields_is_in_from_round_0_of_an_unknown_life():
    entry = entry_with({"pow": 7})
    check_membership(entry)
    assert (peer_info(entry).in_from, peer_info(entry).life_ms) == (0, 0)


HOSTILE = st.one_of(  # what msgpack can carry, and a peer sign
    st.integers(-(2**63), -1),
    st.integers(INT64_MAX + 1, 2**64 - 1),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.none(),
    st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
)


@pytest.mark.parametrize("field", [IN_FROM, LIFE])
@settings(max_examples=300, deadline=None)
@given(value=HOSTILE)
def test_a_hostile_roster_round_or_life_refuses_the_record_cleanly(field, value):
    with pytest.raises(CrdtError, match=field):
        check_membership(entry_with({field: value}))


async def test_the_view_writes_the_field_only_when_it_is_set():
    """Records of peers that do not announce a round are the records a peer that predates the
    field writes and checks: the same keys, the same capabilities."""
    async with AsyncExitStack() as stack:
        (host,) = await start_hosts(stack, 1)
        replica = await stack.enter_async_context(Replica(host, SWARM, swarm_specs(host.peer_id)))
        view = await stack.enter_async_context(SwarmView(replica, host.peer_id, capabilities={"gpu": "x"}))
        raw = replica.crdt(MEMBERSHIP).entry(view.me).body[1]
        assert raw["caps"] == {"gpu": "x"} and set(raw) == {"addrs", "role", "caps", "conn", "lease", "left"}
        view.in_from = 420
        view.heartbeat()
        entry = replica.crdt(MEMBERSHIP).entry(view.me)
        assert entry.body[1]["caps"] == {"gpu": "x", IN_FROM: 420}
        assert peer_info(entry).in_from == 420 and view.capabilities == {"gpu": "x"}
        assert [p.in_from for p in view.live_peers()] == [420]
        view.life_ms = started = now_ms()
        view.heartbeat()
        assert replica.crdt(MEMBERSHIP).entry(view.me).body[1]["caps"] == {"gpu": "x", IN_FROM: 420, LIFE: started}
        assert view.life_of(view.me) == started and view.life_of("12D3KooWnobody") == 0


async def test_a_life_is_lowered_with_a_clock_set_back_before_it():
    """A clock set back below the life's start would date every later record of ours before it
    (of a last life, to every reader): the next heartbeat lowers the life to the clock."""
    async with AsyncExitStack() as stack:
        (host,) = await start_hosts(stack, 1)
        replica = await stack.enter_async_context(Replica(host, SWARM, swarm_specs(host.peer_id)))
        view = await stack.enter_async_context(SwarmView(replica, host.peer_id))
        view.life_ms = now_ms() + 3_600_000  # as if our clock had just been set back an hour
        view.heartbeat()
        view.report_progress(step=1, outer_round=0, announce=True)
        view.heartbeat()
        progress = view.progress_of(view.me)
        assert progress is not None and view.life_of(view.me) <= progress.updated_ms


# --- whom a node connects to ----------------------------------------------------------------------


def test_a_joiner_has_no_partners_before_its_round_and_its_partners_from_then_on():
    ids = peer_ids(12)
    me, joiner = ids[0], ids[11]
    grouping = GroupPlan(group_size=3, seed=1, period=2)
    in_from = {p: 0 for p in ids} | {joiner: 40}
    now = ConnectionPlan(joiner, max_peers=1, grouping=grouping, sample=0, neighbours=0)
    assert now.wanted(ids, ids, [30], in_from=in_from) == []  # not in round 30's roster: nobody to keep
    partners = grouping.partners(grouping.roster(in_from, 40), 40, joiner)
    assert now.wanted(ids, ids, [40], in_from=in_from) == list(partners)
    # the others group round 38 without the joiner, whatever they know of it
    others = ConnectionPlan(me, max_peers=1, grouping=grouping, sample=0, neighbours=0)
    waiting = [36, 38, 40]  # the joiner's rounds under way at step 36: 36, 38, and its roster round
    assert me not in partners and not others.wanted_by(joiner, ids, ids, waiting, in_from=in_from)
    # while it waits for round 40 it dials its partners there: they keep it (presence judges a
    # joiner by its roster round too, not by its step alone; closed, it was dialled again every 12 s)
    assert all(
        ConnectionPlan(p, max_peers=1, grouping=grouping).wanted_by(joiner, ids, ids, waiting, in_from=in_from)
        for p in partners
    )
    assert others.wanted(ids, ids, [38], in_from=in_from) == list(grouping.partners(ids[:11], 38, me))
