"""Screening: each part's owner flags contributions whose norm is far outside the
group's or whose direction disagrees with the robust aggregate, and the collective returns the
flags with the round. Among real hosts on loopback, and as a pure function; and the strike
format the flags become (crdt/strikes.py), as a property."""

from __future__ import annotations

import dataclasses
from contextlib import AsyncExitStack
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.aggregation import reduce_contributions, screen_contributions
from meshtrain.collective.allreduce import AllReduceConfig
from meshtrain.crdt.entries import CrdtError
from meshtrain.crdt.strikes import Strike
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.trust.strikes import StrikeBook, excluded_at
from meshtrain.transport.identity import Identity

from .test_allreduce import mesh, run_all

SCREENED = AllReduceConfig(join_timeout=5, robust="trimmed_mean", screen_norm=4.0, screen_alignment=0.25)


def honest_updates(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    """Pseudo-gradients of peers training one model on different data: a shared direction, each
    with its own noise and scale."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g)
    return [(common + 0.5 * torch.randn(numel, generator=g)) * (0.8 + 0.4 * i / n) for i in range(n)]


async def screened_round(updates: list[torch.Tensor]):
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, len(updates), SCREENED)
        results = await run_all(cols, [{"w": u.reshape(50, -1)} for u in updates], round_id=3)
    return [p.id for p in peers], results


async def test_owners_flag_a_sign_flipped_scaled_contribution_and_no_honest_one():
    updates = honest_updates(4, 4000, seed=1)
    updates[2] = -10 * updates[2]
    ids, results = await screened_round(updates)
    liar = ids[2]
    for i, r in enumerate(results):
        s = r.screening
        assert s is not None and s.round_id == 3 and s.group == tuple(sorted(ids)) and s.digest == r.digest
        if i == 2:
            continue  # the liar's own screening is its business
        # Every honest owner flags the liar on its own part (by norm: 10x), and nobody else.
        assert [f.peer for f in s.flags] == [liar], s.flags
        (flag,) = s.flags
        assert flag.part == s.group.index(ids[i]) and flag.rule == "norm" and flag.norm_ratio > 4
        assert flag.alignment < 0  # against the others


async def test_owners_flag_a_free_rider_sending_zeros():
    updates = honest_updates(4, 4000, seed=2)
    updates[0] = torch.zeros_like(updates[0])
    ids, results = await screened_round(updates)
    for i in (1, 2, 3):
        flags = results[i].screening.flags
        assert [(f.peer, f.rule, f.norm_ratio) for f in flags] == [(ids[0], "norm", 0.0)]


async def test_honest_rounds_are_not_flagged_and_two_peers_still_reduce():
    ids, results = await screened_round(honest_updates(4, 4000, seed=3))
    assert all(r.screening.flags == () for r in results)
    # Fewer than three contributors: the robust rule is the mean and nothing is screened.
    updates = honest_updates(2, 4000, seed=4)
    ids, results = await screened_round(updates)
    assert torch.allclose(results[0].tensors["w"].reshape(-1), (updates[0] + updates[1]) / 2)
    assert all(r.screening.flags == () for r in results)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(3, 9),
    seed=st.integers(0, 2**16),
    scale=st.floats(8.0, 1e6),  # beyond screen_norm (4) x the honest spread of norms (1.5)
    liar=st.integers(0, 8),
    flip=st.booleans(),
)
def test_screening_flags_exactly_the_scaled_row(n, seed, scale, liar, flip):
    """Honest rows (one direction, moderate spread of norms) are never flagged; a row scaled beyond
    `screen_norm` is, whatever its sign."""
    liar %= n
    rows = honest_updates(n, 300, seed)
    rows[liar] = rows[liar] * (-scale if flip else scale)
    stack = torch.stack(rows)
    aggregate = stack.sort(dim=0).values[1 : n - 1].mean(dim=0)
    peers = [f"p{i}" for i in range(n)]
    flags = screen_contributions(peers, stack, aggregate, SCREENED, part=0)
    assert [f.peer for f in flags] == [f"p{liar}"]
    assert screen_contributions(peers, torch.stack(honest_updates(n, 300, seed)), aggregate, SCREENED, 0) == []


@settings(max_examples=30, deadline=None)
@given(n=st.integers(4, 9), seed=st.integers(0, 2**16), liar=st.integers(0, 8))
def test_noise_of_an_updates_norm_is_flagged_for_its_direction(n, seed, liar):
    """Noise with an honest update's norm passes the norm rule; its alignment with the trimmed
    aggregate (which keeps a little of it) is far below the honest rows'."""
    liar %= n
    rows = honest_updates(n, 3000, seed)
    noise = torch.randn(3000, generator=torch.Generator().manual_seed(seed + 1))
    rows[liar] = noise * rows[liar].norm() / noise.norm()
    stack = torch.stack(rows)
    aggregate = stack.sort(dim=0).values[1 : n - 1].mean(dim=0)
    flags = screen_contributions([f"p{i}" for i in range(n)], stack, aggregate, SCREENED, part=0)
    assert [(f.peer, f.rule) for f in flags] == [(f"p{liar}", "direction")]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(4, 9), seed=st.integers(0, 2**16), liar=st.integers(0, 8))
def test_alignment_zero_turns_the_direction_rule_off_even_for_a_flipped_update(n, seed, liar):
    """`screen_alignment` 0 is no direction rule, as `screen_norm` 0 is no screening: a flipped
    update (negative cosine, within the norm bounds) is not flagged, where the default flags it."""
    liar %= n
    rows = honest_updates(n, 300, seed)
    rows[liar] = -rows[liar]
    stack = torch.stack(rows)
    aggregate = stack.sort(dim=0).values[1 : n - 1].mean(dim=0)
    peers = [f"p{i}" for i in range(n)]
    off = AllReduceConfig(join_timeout=5, robust="trimmed_mean", screen_norm=4.0, screen_alignment=0.0)
    assert screen_contributions(peers, stack, aggregate, off, part=0) == []
    (flag,) = screen_contributions(peers, stack, aggregate, SCREENED, part=0)
    assert (flag.peer, flag.rule) == (f"p{liar}", "direction") and flag.alignment < 0


def test_a_direction_strike_counts_only_where_the_spec_screens_direction() -> None:
    """Every peer re-checks a screening strike against its own spec (node/trust/strikes.py): a
    negative alignment breaks the default `screen_alignment` and no threshold where it is 0."""
    view = SimpleNamespace(me=PEERS[0], replica=SimpleNamespace(on_change=lambda callback: None))
    book = StrikeBook(view, SwarmSpec(model="gpt-tiny"), admitted=lambda peer, caps: True)  # type: ignore[arg-type]
    group = tuple(PEERS)
    flipped = Strike(PEERS[1], 40, "f0", PEERS[2], group, b"\x05" * 32, 1, 1.0, -0.5)
    assert book.why_not_counted(flipped, True) is None
    book.spec = SwarmSpec(model="gpt-tiny", screen_alignment=0.0)
    assert book.why_not_counted(flipped, True) == "no evidence: the scores break no threshold"
    assert book.why_not_counted(dataclasses.replace(flipped, norm_ratio=9.0), True) is None  # the norm rule stays


PEERS = sorted(Identity.generate().peer_id_str for _ in range(4))
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    field=st.sampled_from(["round", "tag", "peer", "group", "digest", "part", "norm", "align", None]),
    junk=JUNK,
    rnd=st.integers(0, 2**40),
    norm=st.floats(0, 1e6),
    align=st.floats(-10, 10),
)
def test_a_strike_record_round_trips_and_any_other_is_refused_with_a_crdt_error(field, junk, rnd, norm, align):
    """The strike format (crdt/strikes.py): a well-formed strike survives its record; a record with
    any field replaced by junk is either still well-formed or refused with `CrdtError`, never
    another exception (the record comes from the network)."""
    reporter, peer = PEERS[1], PEERS[3]
    strike = Strike(reporter, rnd, "f0", peer, tuple(PEERS), b"\x05" * 32, 1, norm, align)
    assert Strike.from_record(reporter, strike.to_record()) == strike
    record = strike.to_record() if field is None else {**strike.to_record(), field: junk}
    try:
        parsed = Strike.from_record(reporter, record)
    except CrdtError:
        return
    assert Strike.from_record(reporter, parsed.to_record()) == parsed  # what passed is a strike


def test_a_robust_part_whose_every_contributor_just_joined_is_zeros_not_an_error():
    """Joiners contribute with weight 0 until they trained H steps of their own; a part with only
    such contributions has nothing to combine (the robust path stacked an empty list)."""
    parts = {f"p{i}": torch.randn(8) for i in range(3)}
    rejected: dict[str, str] = {}
    out = reduce_contributions(parts, dict.fromkeys(parts, 0.0), SCREENED, rejected, [], 0)
    assert torch.equal(out, torch.zeros(8)) and rejected == {}


@settings(max_examples=100, deadline=None)
@given(n=st.integers(3, 40), liars=st.integers(0, 10), seed=st.integers(0, 2**31 - 1))
def test_the_default_trim_keeps_a_quarter_of_a_round_of_liars_on_one_side_out(n, liars, seed):
    """With the spec's default `aggregation_trim` (0: a quarter of the contributors, at least one),
    up to that many liars sending x10 values on the same side never move a coordinate outside the
    honest values' range; a trim of 1 let the second of two liars among 8 through."""
    liars = min(liars, max(1, n // 4), (n - 1) // 2)
    g = torch.Generator().manual_seed(seed)
    parts = {f"p{i:02d}": torch.randn(16, generator=g) for i in range(n)}
    honest = torch.stack([parts[p] for p in sorted(parts)[liars:]])
    for p in sorted(parts)[:liars]:
        parts[p] = honest.abs().max(dim=0).values * 10
    config = AllReduceConfig(robust="trimmed_mean")  # the default trim, as the spec gives it
    assert SwarmSpec().aggregation_options()["trim"] == config.trim == 0
    out = reduce_contributions(parts, dict.fromkeys(parts, 1.0), config, {}, None, 0)
    assert (out <= honest.max(dim=0).values + 1e-6).all() and (out >= honest.min(dim=0).values - 1e-6).all()
    if n == 8 and liars == 2:  # the benchmark's case: one trimmed at each end lets one liar in
        one = reduce_contributions(
            parts, dict.fromkeys(parts, 1.0), AllReduceConfig(robust="trimmed_mean", trim=1), {}, None, 0
        )
        assert (one > honest.max(dim=0).values).any()


@settings(max_examples=200, deadline=None)
@given(
    strikes=st.integers(1, 6),
    window=st.integers(0, 12),
    H=st.integers(1, 50),
    gaps=st.lists(st.integers(1, 20), min_size=0, max_size=30),
)
def test_strikes_exclude_only_when_enough_fall_within_the_window(strikes, window, H, gaps):
    """`excluded_at` against a brute-force reading of the rule: the first counted round whose
    latest `strikes` counted rounds span at most `strikes_window` rounds (H steps each)."""
    window = 0 if window == 0 else max(window, strikes)
    spec = SwarmSpec(strikes=strikes, strikes_window=window, H=H, optimizer="diloco")
    rounds, r = [], 0
    for gap in gaps:  # counted rounds at round boundaries (multiples of H), strictly increasing
        r += gap * H
        rounds.append(r)
    expected = None
    for i, at in enumerate(rounds):
        latest = rounds[max(0, i - strikes + 1) : i + 1]
        if len(latest) == strikes and (window == 0 or (latest[-1] - latest[0]) // H < window):
            expected = at
            break
    assert excluded_at(rounds, spec) == expected
    if gaps and window:  # an adversary struck in every round is out after `strikes` rounds
        every = [H * (k + 1) for k in range(strikes)]
        assert excluded_at(every, spec) == every[-1]
