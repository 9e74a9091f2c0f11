"""Replay screening (collective/echoes.py): an owner flags a contribution that repeats
an earlier round's contribution or aggregate of its part, and nothing else. As a property of
`EchoMemory` (parts that move between rounds, honest updates that share a direction), among real
hosts on loopback through the robust all-reduce, and the echo strike's record and re-check."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.allreduce import AllReduceConfig
from meshtrain.collective.contract import ContributionFlag
from meshtrain.collective.echoes import ECHO, MIN_OVERLAP, EchoMemory, PartSketch, echo_stride
from meshtrain.collective.flat import part_bounds
from meshtrain.crdt.entries import CrdtError
from meshtrain.crdt.strikes import Strike
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.trust.strikes import echo_flagged

from .test_allreduce import mesh, run_all
from .test_screening import PEERS, honest_updates

ECHOED = AllReduceConfig(
    join_timeout=5, robust="trimmed_mean", screen_norm=4.0, screen_alignment=0.25, screen_echo=0.9999
)


def correlated_rounds(rounds: int, n: int, numel: int, seed: int, carry: float) -> list[list[torch.Tensor]]:
    """`rounds` rounds of `n` honest updates: each peer's update keeps `carry` of its last one
    (an inner optimizer's momentum) and adds fresh work in the swarm's drifting direction."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g)
    last = [torch.randn(numel, generator=g) for _ in range(n)]
    out = []
    for _ in range(rounds):
        common = 0.8 * common + 0.6 * torch.randn(numel, generator=g)
        last = [carry * u + (1 - carry) * (common + torch.randn(numel, generator=g)) for u in last]
        out.append(list(last))
    return out


def sketch_of(rnd: int, updates: list[torch.Tensor], bounds: tuple[int, int]) -> PartSketch:
    a, b = bounds
    rows = {f"p{i}": u[a:b] for i, u in enumerate(updates)}
    return PartSketch.of(rnd, bounds, len(updates[0]), rows).with_aggregate(torch.stack(updates).mean(dim=0)[a:b])


def judged(memory: EchoMemory, tag: str, sketch: PartSketch, part: int = 0) -> list[ContributionFlag]:
    """What an owner does with a round: its echoes (as flags), then the round remembered."""
    echoes = memory.match(tag, sketch)
    memory.remember(tag, sketch)
    return [sketch.flag(e, part) for e in echoes]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(3, 8),
    seed=st.integers(0, 2**16),
    carry=st.floats(0.0, 0.9),
    liar=st.integers(0, 7),
    replayed=st.sampled_from(["own", "other", "aggregate"]),
    cuts=st.lists(st.integers(0, 400), min_size=6, max_size=6),
)
def test_exactly_the_replayed_contribution_is_flagged_while_parts_move(n, seed, carry, liar, replayed, cuts):
    """Over 6 rounds of honest updates that share a direction and carry much of their last round
    (cosines with earlier rounds up to ~0.99), with the owner's part moving every round, nobody is
    flagged; then one peer sends an earlier round's contribution (its own or another's) or
    aggregate, and it alone is flagged, naming that round, on whatever part the owner holds now."""
    numel = 3000
    liar %= n
    memory = EchoMemory(0.9999)
    rounds = correlated_rounds(7, n, numel, seed, carry)
    for r, updates in enumerate(rounds[:6], 1):
        bounds = (cuts[r - 1], cuts[r - 1] + 1500)
        assert judged(memory, "t", sketch_of(r, updates, bounds), 0) == []
    earlier = 3
    source = {
        "own": rounds[earlier - 1][liar],
        "other": rounds[earlier - 1][(liar + 1) % n],
        "aggregate": torch.stack(rounds[earlier - 1]).mean(dim=0),
    }[replayed]
    final = list(rounds[6])
    final[liar] = source.clone()
    flags = judged(memory, "t", sketch_of(7, final, (cuts[0] + 700, cuts[0] + 2200)), 2)
    assert [(f.peer, f.rule, f.part) for f in flags] == [(f"p{liar}", ECHO, 2)]
    (flag,) = flags
    assert flag.echo >= 0.9999
    if replayed != "aggregate":  # an aggregate of round 3 may equal no row, but it is round 3's
        assert flag.earlier == earlier


def test_a_replay_is_judged_only_against_earlier_rounds_of_its_tag_on_shared_coordinates():
    updates = honest_updates(4, 4000, seed=5)
    memory = EchoMemory(0.9999)
    assert judged(memory, "a", sketch_of(10, updates, (0, 2000)), 0) == []
    # The same round again (a redone round), another tag, a later round on coordinates the
    # earlier sketch never held, or a round id below the remembered one: nothing to compare.
    assert judged(memory, "a", sketch_of(10, updates, (0, 2000)), 0) == []
    assert judged(memory, "b", sketch_of(11, updates, (0, 2000)), 0) == []
    assert judged(memory, "a", sketch_of(12, updates, (2000 - MIN_OVERLAP // 2, 4000)), 0) == []
    assert judged(memory, "a", sketch_of(9, updates, (0, 2000)), 0) == []
    # A later round of tag "a" where p0 and p1 repeat round 10's updates on shared coordinates.
    fresh = honest_updates(4, 4000, seed=9)
    later = [updates[0], updates[1], fresh[2], fresh[3]]
    assert {f.peer for f in judged(memory, "a", sketch_of(13, later, (1000, 3000)), 0)} == {"p0", "p1"}
    # ... but where everyone repeats, the aggregate does too: that tells nothing (weight decay alone
    # does it, test below), and nobody is flagged.
    judged(memory, "c", sketch_of(1, updates, (0, 4000)), 0)
    assert judged(memory, "c", sketch_of(2, updates, (0, 4000)), 0) == []
    # An all-zero contribution is screening's business (its norm), not a replay.
    zeros = [torch.zeros(4000)] + honest_updates(3, 4000, seed=6)
    judged(memory, "z", sketch_of(1, zeros, (0, 4000)), 0)
    again = [zeros[0], zeros[1]] + honest_updates(2, 4000, seed=10)
    assert [f.peer for f in judged(memory, "z", sketch_of(2, again, (0, 4000)), 0)] == ["p1"]  # p1 repeats


def test_a_part_where_every_update_is_weight_decay_alone_flags_nobody():
    """Coordinates no batch reaches move by weight decay alone: every peer's update there is
    proportional to φ, so each round's updates nearly repeat the last round's. The aggregate
    repeats with them, which tells the owner that nobody is replaying there."""
    g = torch.Generator().manual_seed(3)
    phi = torch.randn(3000, generator=g)
    memory = EchoMemory(0.9999)
    for r in range(1, 6):
        updates = [phi * 4e-5 * (1 + 1e-3 * i) for i in range(5)]  # lr x wd x H, peers' tiny float drift
        assert judged(memory, "t", sketch_of(r, updates, (0, 3000)), 0) == []
        phi = phi * (1 - 4e-5)


def test_the_sketch_samples_a_fixed_grid_of_the_flat_input():
    numel = 5 << 16
    stride = echo_stride(numel)
    assert stride == 5 and echo_stride(1000) == 1
    x = torch.arange(numel, dtype=torch.float32)
    s = PartSketch.of(1, (7, 1007), numel, {"p": x[7:1007]}).with_aggregate(2 * x[7:1007])
    assert s.first == 10 and s.stride == 5 and s.rows["p"][0] == 10 and s.last == 1005
    assert torch.equal(s.rows["p"], torch.arange(10, 1007, 5, dtype=torch.float32))
    assert torch.equal(s.aggregate, 2 * s.rows["p"])


async def test_every_honest_owner_drops_and_flags_a_peer_replaying_its_last_contribution_over_loopback():
    """Four real hosts, two robust all-reduces: in the second, peer 2 sends its contribution of the
    first again. Every other owner drops it from its part and flags it as an echo of round 1, and
    nobody else: the round's result is the three others' alone, and the replayer is excluded from
    it like a sender of garbage (its bits would pass the norm and direction rules)."""
    first, second = correlated_rounds(2, 4, 4000, seed=7, carry=0.3)
    second[2] = first[2].clone()
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 4, ECHOED)
        ids = [p.id for p in peers]
        r1 = await run_all(cols, [{"w": u.reshape(40, -1)} for u in first], round_id=1)
        assert all(not r.screening.flags for r in r1)
        r2 = await run_all(cols, [{"w": u.reshape(40, -1)} for u in second], round_id=2)
    for i, r in enumerate(r2):
        if i == 2:
            continue
        (flag,) = r.screening.flags
        assert (flag.peer, flag.rule, flag.earlier, flag.part) == (ids[2], ECHO, 1, r.screening.group.index(ids[i]))
        assert flag.echo >= 0.9999 and flag.alignment > 0
    assert len(set(r.digest for r in r2)) == 1
    for r in r2:
        assert r.contributors == tuple(sorted(p for p in ids if p != ids[2]))
        assert "repeats round 1's contribution" in r.excluded[ids[2]] or r is r2[2]
    # Each honest owner combined its part from the three others (a trimmed mean of three: their
    # median); the replayer's own part is its own business.
    honest = torch.stack([u for i, u in enumerate(second) if i != 2]).median(dim=0).values
    got, group = r2[0].tensors["w"].reshape(-1), r2[0].screening.group
    bounds = part_bounds(got.numel(), len(group))
    for j, owner in enumerate(group):
        if owner != ids[2]:
            assert torch.equal(got[bounds[j] : bounds[j + 1]], honest[bounds[j] : bounds[j + 1]])


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"earlier": 7}, "earlier round"),
        ({"earlier": 9}, "earlier round"),
        ({"earlier": -1}, "earlier round"),
        ({"earlier": 1.5}, "earlier round"),
        ({"echo": float("nan")}, "finite"),
        ({"echo": "1"}, "finite"),
        ({"match": 0.5}, "exactly"),
    ],
)
def test_an_echo_strike_round_trips_and_a_malformed_one_is_refused(change, error):
    strike = Strike(PEERS[1], 7, "f0", PEERS[3], tuple(PEERS), b"\x05" * 32, 1, 1.0, 0.9, ECHO, echo=1.0, earlier=5)
    assert Strike.from_record(PEERS[1], strike.to_record()) == strike
    with pytest.raises(CrdtError, match=error):
        Strike.from_record(PEERS[1], {**strike.to_record(), **change})


def test_an_echo_counts_as_evidence_only_past_the_specs_threshold():
    spec = SwarmSpec(model="gpt-tiny")
    assert spec.aggregation.screen_echo == 0.9999 and spec.aggregation_options()["screen_echo"] == 0.9999
    assert echo_flagged(1.0, spec) and echo_flagged(0.9999, spec) and not echo_flagged(0.9987, spec)
    off = SwarmSpec(model="gpt-tiny", screen_echo=0)
    assert not echo_flagged(1.0, off) and off.aggregation_options()["screen_echo"] == 0
    # dp screens nothing by default, so no echoes either; a plain mean keeps no contributions.
    assert SwarmSpec(model="gpt-tiny", optimizer="dp").aggregation_options()["screen_echo"] == 0
    assert SwarmSpec(model="gpt-tiny", aggregation="mean").aggregation_options()["screen_echo"] == 0
