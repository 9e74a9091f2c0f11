"""Grouped averaging's grouping (collective/groups.py): a partition every peer computes alike, groups
no larger than g, and every peer's update reaching every other within one epoch (d + 1 rounds)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.groups import (
    AUTO_GROUP_SIZE,
    AUTO_WHOLE_SWARM,
    GroupPlan,
    effective_group_size,
    epoch_length,
    grid_sides,
    round_groups,
)


def peers(n: int) -> list[str]:
    return [f"12D3Koo{i:05d}" for i in range(n)]


def spread(n: int, group_size: int, seed: int, start_round: int) -> int:
    """Rounds from `start_round` until every peer holds every peer's update (who-heard-whom sets
    merged inside each group), or -1 if 3 epochs do not get there."""
    members = peers(n)
    heard = {p: {p} for p in members}
    first = round_groups(members, start_round, group_size, seed)
    limit = 3 * epoch_length(n, first.sides)
    for r in range(limit):
        for grp in round_groups(members, start_round + r, group_size, seed).groups:
            union = set().union(*(heard[p] for p in grp))
            for p in grp:
                heard[p] = set(union)
        if all(len(h) == n for h in heard.values()):
            return r + 1
    return -1


sizes = st.integers(min_value=1, max_value=300)
group_sizes = st.one_of(st.just(0), st.integers(min_value=2, max_value=20))


@settings(max_examples=200, deadline=None)
@given(n=sizes, g=group_sizes, seed=st.integers(0, 2**31 - 1), rnd=st.integers(0, 10_000))
def test_groups_partition_the_members_and_respect_the_size(n, g, seed, rnd):
    members = peers(n)
    rg = round_groups(members, rnd, g, seed)
    flat = [p for grp in rg.groups for p in grp]
    assert sorted(flat) == members  # every peer in exactly one group
    limit = effective_group_size(n, g)
    assert all(1 <= len(grp) <= limit for grp in rg.groups)
    if n <= limit:
        assert rg.groups == (tuple(members),) and rg.whole_swarm


@settings(max_examples=100, deadline=None)
@given(n=sizes, g=group_sizes, seed=st.integers(0, 2**31 - 1), rnd=st.integers(0, 10_000), data=st.data())
def test_every_peer_computes_the_same_groups_from_the_same_snapshot(n, g, seed, rnd, data):
    members = peers(n)
    shuffled = data.draw(st.permutations(members))
    assert round_groups(members, rnd, g, seed) == round_groups(shuffled + shuffled[:3], rnd, g, seed)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 300), g=group_sizes, seed=st.integers(0, 2**31 - 1), epoch=st.integers(0, 1000))
def test_every_update_reaches_every_peer_within_one_epoch(n, g, seed, epoch):
    sides = grid_sides(n, effective_group_size(n, g))
    d = len(sides)
    rounds = spread(n, g, seed, epoch * epoch_length(n, sides))
    assert 1 <= rounds <= epoch_length(n, sides) <= d + 1


@pytest.mark.parametrize("n,g", [(16, 4), (64, 8), (256, 16), (27, 3)])
def test_full_grid_mixes_in_exactly_d_rounds(n, g):
    sides = grid_sides(n, g)
    assert epoch_length(n, sides) == len(sides)
    assert spread(n, g, seed=7, start_round=0) == len(sides)


def test_automatic_size_keeps_small_swarms_whole_and_groups_large_ones():
    assert round_groups(peers(AUTO_WHOLE_SWARM), 5, 0).whole_swarm
    big = round_groups(peers(256), 5, 0)
    assert len(big.sides) == 2 and max(len(x) for x in big.groups) <= AUTO_GROUP_SIZE
    assert len(big.groups) == 256 // AUTO_GROUP_SIZE


def test_groups_change_between_rounds_and_epochs():
    members = peers(64)
    plan = GroupPlan(group_size=8, seed=1, period=10)
    r0, r1 = plan.groups(members, 0), plan.groups(members, 10)
    assert plan.groups(members, 9) == r0  # one outer round: every fragment in the same groups
    assert r0.dimension != r1.dimension and r0.groups != r1.groups
    again = plan.groups(members, 20)  # next epoch: same dimension as round 0, re-shuffled
    assert again.dimension == r0.dimension and again.groups != r0.groups
    assert plan.tag("f0", r0, members[0]).startswith("f0~g")
    assert GroupPlan().tag("f0", GroupPlan().groups(members[:4], 0), members[0]) == "f0"


def test_bad_group_size_is_refused():
    with pytest.raises(ValueError, match="group_size"):
        GroupPlan(group_size=1)


def test_spec_group_size_reaches_the_collective_only_where_rounds_can_be_grouped():
    from meshtrain.errors import ConfigError
    from meshtrain.node.spec.swarm import parse_spec

    assert parse_spec({}).group_plan() == GroupPlan(group_size=0, seed=0, period=50)
    assert parse_spec({"group_size": 8, "H": 20, "seed": 3}).group_plan() == GroupPlan(8, 3, 20)
    assert parse_spec({"optimizer": "noloco"}).group_plan() is None
    assert parse_spec({"optimizer": "dp"}).group_plan() is None
    assert parse_spec({"optimizer": "sparseloco"}).group_plan() is None
    refused = [{"group_size": 1}] + [{"optimizer": o, "group_size": 4} for o in ("noloco", "dp", "sparseloco")]
    for bad in refused:
        with pytest.raises(ConfigError, match="group_size"):
            parse_spec(bad)


def test_parity_is_unchecked_while_rounds_run_in_groups():
    from meshtrain.node.state.parity import ParityMonitor

    monitor = ParityMonitor("me", settle_s=0)
    monitor.record(1, b"mine")
    grouped = [True]
    monitor.paused_by = lambda: "rounds run in groups" if grouped[0] else ""
    assert monitor.check({"other": [(1, b"theirs")]}).status == "unchecked"
    grouped[0] = False
    assert monitor.check({"other": [(1, b"theirs")], "third": [(1, b"theirs")]}).status == "minority"
