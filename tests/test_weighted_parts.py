"""Bandwidth-weighted parts (for links of different speeds): the part-size rule, its wire fields, and a real all-reduce
whose slow member owns nothing."""

from __future__ import annotations

import math
from contextlib import AsyncExitStack

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.attempt_outcomes import POLL_S
from meshtrain.collective.contribution import Contribution
from meshtrain.collective.data_phase import MAX_SCATTER_SLOTS, scatter_slots
from meshtrain.collective.flat import STRIPE_TAPER, all_finite, part_bounds, stripe_bounds
from meshtrain.collective.protocol import (
    DONE,
    FAIL,
    Commit,
    Joined,
    JoinRequest,
    Report,
    Retry,
    RoundKey,
    parse_join_reply,
    parse_outcome,
)
from meshtrain.collective.shares import MAX_PART_FACTOR, MIN_MEASURED_BYTES, NEAR_EQUAL, egress_rate, part_shares
from meshtrain.transport.validate import Malformed

from .test_allreduce import connected_peers, exact_mean, run_all
from .test_coordinator import coordinator

MBIT = 1e6 / 8
rates = st.lists(st.floats(min_value=1e3, max_value=1e11), min_size=1, max_size=24)


@settings(max_examples=300, deadline=None)
@given(rates, st.integers(min_value=0, max_value=10**9))
def test_part_sizes_cover_the_vector_and_a_slower_peer_never_owns_more(rs, numel):
    shares = part_shares(rs)
    assert shares == part_shares(list(rs))  # deterministic
    bounds = part_bounds(numel, len(rs), shares)
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert bounds[0] == 0 and bounds[-1] == numel and min(sizes) >= 0
    if shares:
        assert len(shares) == len(rs) and min(shares) >= 0 and sum(shares) > 0
        assert max(shares) / sum(shares) <= MAX_PART_FACTOR / len(rs) + 1e-3  # a claim buys little
        for i in range(len(rs)):
            for j in range(len(rs)):
                if rs[i] < rs[j]:
                    assert shares[i] <= shares[j]
                    assert sizes[i] <= sizes[j] + 1  # integer floors may differ by one element
    else:  # equal parts: rates near-equal, or too few peers for the split to matter
        assert bounds == part_bounds(numel, len(rs))
        assert len(rs) <= 2 or max(rs) <= NEAR_EQUAL * min(rs)


@given(st.floats(min_value=1.0, max_value=1e12), st.floats(min_value=1.0, max_value=1e12), st.integers(4096, 1 << 30))
def test_the_scatter_window_follows_the_uplink_within_its_bounds(u1, u2, stripe):
    """Known uplink: as many stripes as it sends in `scatter_horizon`, 2..MAX_SCATTER_SLOTS, never
    fewer for a faster link; unknown: the configured window."""
    cfg = AllReduceConfig()
    lo, hi = sorted((u1, u2))
    assert 2 <= scatter_slots(cfg, lo, stripe) <= scatter_slots(cfg, hi, stripe) <= MAX_SCATTER_SLOTS
    assert scatter_slots(cfg, None, stripe) == scatter_slots(cfg, 0.0, stripe) == cfg.scatter_window


def test_scatter_window_of_the_wan_lab_links():
    cfg, stripe = AllReduceConfig(), AllReduceConfig().stripe_bytes
    assert scatter_slots(cfg, 100 * MBIT, stripe) == 6  # 12.5 MB/s x 1 s / 2 MiB
    assert scatter_slots(cfg, 20 * MBIT, stripe) == 2  # the floor: round trips hide behind data
    assert scatter_slots(cfg, 10_000 * MBIT, stripe) == MAX_SCATTER_SLOTS
    assert scatter_slots(AllReduceConfig(scatter_horizon=2.0), 100 * MBIT, stripe) == 12


@pytest.mark.parametrize("horizon", [0.0, -1.0, math.nan])
def test_scatter_horizon_must_be_positive(horizon):
    with pytest.raises(ValueError, match="scatter_horizon"):
        AllReduceConfig(scatter_horizon=horizon)


@given(st.integers(0, 10**7), st.integers(1, 1 << 22), st.floats(0, 300), st.integers(0, 5))
def test_stripes_cover_the_part_in_order_and_only_the_last_ones_shrink(lo, step, stripes, taper):
    """Every stripe is non-empty (but for an empty part's one), at most `step`, in order, covering
    [lo, hi); with a taper the last ones halve, the rest are near-equal."""
    length = int(step * stripes)
    hi = lo + length
    bounds = stripe_bounds(lo, hi, step, taper)
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert bounds[0] == lo and bounds[-1] == hi and len(sizes) >= 1
    assert all(0 < x <= step for x in sizes) or sizes == [0]
    assert stripe_bounds(lo, hi, step, taper) == bounds  # every member cuts alike
    tail = [step >> i for i in range(1, taper + 1) if step >> i] if length > 2 * step else []
    assert sizes[len(sizes) - len(tail) :] == tail
    body = sizes[: len(sizes) - len(tail)]
    assert max(body) - min(body) <= 1
    if not tail:
        assert bounds == stripe_bounds(lo, hi, step)


def test_the_last_stripes_of_a_wan_part_leave_a_short_all_gather_tail():
    step = AllReduceConfig().stripe_bytes // 4  # 2 MiB of fp32
    part = 100_000_000 // 4 // 8  # one of 8 parts of 100 MB
    bounds = stripe_bounds(0, part, step, STRIPE_TAPER)
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert sizes[-3:] == [step // 2, step // 4, step // 8] and len(sizes) == 9
    assert 7 * sizes[-1] * 4 / (100 * MBIT) < 0.2  # the last all-gather: 7 peers, 100 Mbit/s, seconds


@pytest.mark.parametrize(
    ("value", "finite"),
    [(0.0, True), (3e38, True), (math.nan, False), (math.inf, False), (-math.inf, False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_one_bad_element_anywhere(value, finite, dtype):
    if dtype != torch.float32 and value == 3e38:
        value = 1.0  # out of range for the half types
    for where in (0, 4097, 9999):
        x = torch.zeros(10_000, dtype=dtype)
        x[where] = value
        assert all_finite(x) is finite
    assert all_finite(torch.zeros(0)) and all_finite(torch.arange(5))


async def test_a_contribution_is_flattened_once_and_non_finite_input_gives_zeros_at_weight_zero():
    good = {"a": torch.ones(3, 2), "b": torch.arange(4, dtype=torch.float16)}
    bad = {"a": torch.tensor([1.0, math.nan]), "b": torch.ones(2)}
    async with trio.open_nursery() as nursery:
        c_good, c_bad = Contribution(good, 0.5, 7), Contribution(bad, 1.0, 7)
        c_good.start(nursery)
        c_bad.start(nursery)
        flat, weight = await c_good.ready()
        assert weight == 0.5 and torch.equal(flat, torch.tensor([1.0] * 6 + [0.0, 1.0, 2.0, 3.0]))
        flat, weight = await c_bad.ready()
        assert weight == 0.0 and torch.equal(flat, torch.zeros(4)) and c_bad.numel == 4
        assert math.isnan(float(bad["a"][1]))  # the caller's tensors are untouched


@given(st.floats(min_value=1e3, max_value=1e11), st.integers(min_value=1, max_value=24))
def test_equal_or_unknown_rates_give_the_equal_parts(rate, n):
    assert part_shares([rate] * n) == ()
    assert part_shares([rate] * (n - 1) + [None]) == ()
    assert part_bounds(10**6 + 7, n, (5,) * n) == part_bounds(10**6 + 7, n)


def test_slow_peers_own_nothing_and_the_round_is_bound_by_their_own_input():
    """The bench's case: 2 of 8 peers at 20 Mbit/s, 6 at 100. Every fast peer owns 1/6, so its
    traffic M·(1 + 6/6) at 100 Mbit/s (0.16 s per MB) stays under the slow peers' M at 20 (0.4)."""
    shares = part_shares([100 * MBIT] * 6 + [20 * MBIT] * 2)
    assert shares[6:] == (0, 0) and len(set(shares[:6])) == 1
    # Mildly slower peers still own something, less than the others.
    mild = part_shares([100 * MBIT] * 7 + [60 * MBIT])
    assert 0 < mild[7] < mild[0]


def test_a_claimed_rate_cannot_buy_more_than_twice_an_equal_part():
    """A rate is a member's claim: claiming 8 Tbit/s among 100 Mbit/s peers owns at most 2/n."""
    shares = part_shares([1e12] + [100 * MBIT] * 7)
    assert shares[0] / sum(shares) <= MAX_PART_FACTOR / 8 + 1e-4
    assert len(set(shares[1:])) == 1 and shares[1] > 0


def test_egress_rate_adds_up_the_sends_in_flight_at_once():
    mb = MIN_MEASURED_BYTES
    # Two sends side by side at mb/s each for 1 s, then one alone at the same rate: the link did
    # 2 mb/s for half the busy time, so the high quantile reads 2 mb/s.
    sends = [(0.0, 1.0, mb), (0.0, 1.0, mb), (1.0, 2.0, mb)]
    assert egress_rate(sends) == pytest.approx(2 * mb)
    assert egress_rate([(0.0, 1.0, mb // 2)]) is None  # too little data to tell


@pytest.mark.parametrize("uplink", [-1, 0, math.nan, math.inf, 1e30, "fast", True, [1.0], {"mbit": 1}], ids=repr)
def test_hostile_uplink_in_a_join_is_malformed(uplink):
    key = RoundKey(3, "t", "me")
    wire = JoinRequest(key).to_wire() | {"uplink": uplink}
    with pytest.raises(Malformed):
        JoinRequest.parse(wire, to="me")


def test_uplink_and_shares_round_trip_and_old_messages_mean_equal_parts():
    key = RoundKey(3, "t", "me")
    assert JoinRequest.parse(JoinRequest(key).to_wire(), to="me").uplink is None  # an old peer
    assert "uplink" not in JoinRequest(key).to_wire()
    assert JoinRequest.parse(JoinRequest(key, uplink=12.5e6).to_wire(), to="me").uplink == 12.5e6
    joined = Joined(0, ("a", "b", "c"), (3, 0, 5))
    assert parse_join_reply(joined.to_wire()) == joined
    assert parse_join_reply({"attempt": 0, "group": ["a", "b"]}) == Joined(0, ("a", "b"))
    assert "shares" not in Joined(0, ("a", "b")).to_wire()  # equal parts: the old wire form
    retry = Retry(1, ("a", "c"), ("b",), (0, 7))
    assert parse_outcome(retry.to_wire()) == retry


@pytest.mark.parametrize(
    "shares",
    [[1, 2], [1, 2, 3, 4], [0, 0, 0], [-1, 2, 3], [1, 2, 2**40], [1.5, 2, 3], [True, 1, 1], "123", 7],
    ids=repr,
)
def test_hostile_shares_in_a_join_reply_or_retry_are_malformed(shares):
    with pytest.raises(Malformed):
        parse_join_reply({"attempt": 0, "group": ["a", "b", "c"], "shares": shares})
    with pytest.raises(Malformed):
        parse_outcome({"retry": 1, "group": ["a", "b", "c"], "excluded": [], "shares": shares})


async def test_coordinator_announces_shares_with_the_group_and_recomputes_them_for_a_retry(autojump_clock):
    fast, slow = 100 * MBIT, 20 * MBIT
    uplinks = {"a": fast, "b": slow, "c": fast, "d": fast}
    async with trio.open_nursery() as nursery:
        c = await coordinator(nursery, "a", list(uplinks))
        key = RoundKey(7, "", "a")
        replies = {}

        async def join(p: str, uplink: float | None) -> None:
            replies[p] = await c.join(p, key, (), uplink)

        async with trio.open_nursery() as inner:
            for p, u in uplinks.items():
                inner.start_soon(join, p, u)
        shares = part_shares(list(uplinks.values()))
        assert shares[1] == 0 and {r.shares for r in replies.values()} == {shares}
        # A fast member fails: the survivors' parts are re-sized from the rates they joined with.
        c.host.connected.discard("d")
        outcome = await c.report("a", Report(key, 0, FAIL, None, ("d",)))
        assert outcome == Retry(1, ("a", "b", "c"), ("d",), part_shares([fast, slow, fast]))
        # A member that sent no rate (an old peer): equal parts for everyone.
        key2 = RoundKey(8, "", "a")
        async with trio.open_nursery() as inner:
            for p in uplinks:
                inner.start_soon(c.join, p, key2, (), None if p == "c" else uplinks[p])
        assert c.rounds[key2].attempts[0].shares == ()
        nursery.cancel_scope.cancel()


def test_taper_round_trips_and_old_messages_mean_equal_stripes():
    key = RoundKey(3, "t", "me")
    assert JoinRequest.parse(JoinRequest(key).to_wire(), to="me").taper is None  # an old peer
    assert JoinRequest.parse(JoinRequest(key, taper=STRIPE_TAPER).to_wire(), to="me").taper == STRIPE_TAPER
    for reply in (Joined(0, ("a", "b"), (), 3), Joined(0, ("a", "b"), (1, 2), 2)):
        assert parse_join_reply(reply.to_wire()) == reply
    retry = Retry(1, ("a", "c"), ("b",), (), 3)
    assert parse_outcome(retry.to_wire()) == retry
    assert "taper" not in Joined(0, ("a", "b")).to_wire()  # no taper: the old wire form
    assert parse_join_reply({"attempt": 0, "group": ["a"]}).taper == 0  # an old coordinator


@pytest.mark.parametrize("taper", [-1, 9, 2**40, 2.5, "3", True, [3], None], ids=repr)
def test_hostile_taper_in_a_join_or_a_group_is_malformed(taper):
    key = RoundKey(3, "t", "me")
    if taper is not None:  # absent is fine in a join; an explicit null is not a taper either
        with pytest.raises(Malformed):
            JoinRequest.parse(JoinRequest(key).to_wire() | {"taper": taper}, to="me")
    else:
        assert JoinRequest.parse(JoinRequest(key).to_wire() | {"taper": None}, to="me").taper is None
        return
    with pytest.raises(Malformed):
        parse_join_reply({"attempt": 0, "group": ["a", "b"], "taper": taper})
    with pytest.raises(Malformed):
        parse_outcome({"retry": 1, "group": ["a", "b"], "excluded": [], "taper": taper})


async def test_coordinator_announces_the_smallest_offered_taper_and_none_with_an_old_peer(autojump_clock):
    offers = {"a": 3, "b": 2, "c": 3, "d": 3}
    async with trio.open_nursery() as nursery:
        c = await coordinator(nursery, "a", list(offers))
        key = RoundKey(7, "", "a")
        replies = {}

        async def join(p: str) -> None:
            replies[p] = await c.join(p, key, (), None, offers[p])

        async with trio.open_nursery() as inner:
            for p in offers:
                inner.start_soon(join, p)
        assert {r.taper for r in replies.values()} == {2}  # every member cuts alike
        c.host.connected.discard("d")
        outcome = await c.report("a", Report(key, 0, FAIL, None, ("d",)))
        assert outcome == Retry(1, ("a", "b", "c"), ("d",), (), 2)
        # A member that offered none (an older peer): equal stripes for everyone.
        key2 = RoundKey(8, "", "a")
        async with trio.open_nursery() as inner:
            for p in offers:
                inner.start_soon(c.join, p, key2, (), None, None if p == "c" else offers[p])
        assert c.rounds[key2].attempts[0].taper == 0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("robust", ["none", "trimmed_mean"])
async def test_weighted_allreduce_is_bit_identical_and_exact_with_an_empty_part(robust):
    """Four real hosts on loopback, the second slowest by a factor of 5: it owns no part, yet it
    contributes, and every peer ends with the same bits — the exact mean (or trimmed mean)."""
    async with AsyncExitStack() as stack:
        peers = await connected_peers(stack, 4)
        ids = [p.id for p in peers]
        rates = [100.0, 20.0, 100.0, 80.0]
        screening = {"screen_norm": 3.0, "score_samples": 1} if robust != "none" else {}
        cols = [
            SwarmCollective(
                p.host,
                p.ts,
                lambda r: ids,
                AllReduceConfig(join_timeout=5, uplink_mbit=mbit, robust=robust, stripe_bytes=4096, **screening),
            )
            for p, mbit in zip(peers, rates, strict=True)
        ]
        shares = part_shares([r * MBIT for r in rates])
        assert shares[1] == 0 and 0 < shares[3] < shares[0]
        tensors = [{"w": torch.randn(3001) * (i + 1), "h": torch.randn(77).half()} for i in range(4)]
        results = await run_all(cols, tensors, round_id=1)
        assert len({r.digest for r in results}) == 1
        if robust == "none":
            expected = exact_mean(tensors)
        else:  # the trimmed mean of 4 drops one value at each end: the mean of the middle two
            flat = torch.stack([torch.cat([t["w"], t["h"].float()]) for t in tensors])
            mid = flat.sort(dim=0).values[1:3].mean(dim=0)
            expected = {"w": mid[:3001], "h": mid[3001:].half()}
        for r in results:
            assert r.contributors == tuple(ids)
            for k in expected:
                assert torch.equal(r.tensors[k], expected[k]), k
        # The slow peer received no contributions (its part is empty), only the others' results.
        assert results[1].bytes_received < 0.7 * min(results[i].bytes_received for i in (0, 2, 3))


@pytest.mark.parametrize("old", [None, 1], ids=["all-taper", "one-old-peer"])
async def test_tapered_stripes_are_exact_and_a_peer_without_the_taper_gets_equal_stripes(old):
    """Four real hosts, parts of ~5 stripes: tapered (every peer offers it) or not (one peer
    joins as a version before the taper would, offering none) — every peer cuts alike either
    way, and ends with the exact mean."""
    async with AsyncExitStack() as stack:
        peers = await connected_peers(stack, 4)
        ids = [p.id for p in peers]
        cols = [
            SwarmCollective(p.host, p.ts, lambda r: ids, AllReduceConfig(join_timeout=5, stripe_bytes=4096))
            for p in peers
        ]
        if old is not None:
            cols[old].stripe_taper = None
        tensors = [{"w": torch.randn(20_000) * (i + 1)} for i in range(4)]
        results = await run_all(cols, tensors, round_id=1)
        assert len({r.digest for r in results}) == 1
        expected = exact_mean(tensors)
        for r in results:
            assert r.contributors == tuple(ids) and torch.equal(r.tensors["w"], expected["w"])


@pytest.mark.parametrize("connected", [True, False])
async def test_with_weighted_parts_a_connected_straggler_is_waited_for_not_left_to_resync(autojump_clock, connected):
    """The fast peers report after 30 s; the slow one, still downloading the results, after 50 s.
    With weighted parts it is waited for (as long again as the first report took); one whose
    connection dropped is not, and is left unconfirmed as soon as the others reported (it cannot
    report any more: collective/attempt_outcomes.py), not at the report deadline."""
    uplinks = {"a": 100 * MBIT, "b": 100 * MBIT, "c": 100 * MBIT, "d": 20 * MBIT}
    async with trio.open_nursery() as nursery:
        c = await coordinator(nursery, "a", list(uplinks))
        key = RoundKey(7, "", "a")
        async with trio.open_nursery() as inner:
            for p, u in uplinks.items():
                inner.start_soon(c.join, p, key, (), u)
        assert c.rounds[key].attempts[0].shares
        if not connected:
            c.host.connected.discard("d")
        outcomes = {}

        async def send(p: str, at: float) -> None:
            await trio.sleep(at)  # sleep: virtual time; when each reports is what is tested
            outcomes[p] = (await c.report(p, Report(key, 0, DONE, b"x")), trio.current_time())

        async with trio.open_nursery() as inner:
            for p in "abc":
                inner.start_soon(send, p, 30.0)
            inner.start_soon(send, "d", 50.0)
        commit, t = outcomes["a"]
        if connected:
            assert commit == Commit(b"x", tuple(uplinks), holders=tuple(uplinks)) and t == pytest.approx(50.0)
        else:
            assert commit.unconfirmed == ("d",) and 30.0 < t <= 30.0 + POLL_S
        nursery.cancel_scope.cancel()
