"""The parity rule (`node/state/parity.py`) as a pure function: which φ wins a round, when a round is
judged, and that every peer holding the same records picks the same winner."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.backoff import Backoff
from meshtrain.crdt.entries import CrdtError
from meshtrain.crdt.swarm_view import MAX_PHI_DIGESTS, PeerProgress
from meshtrain.node.state.parity import (
    MIN_SETTLE_S,
    AloneRounds,
    BesideAlone,
    ParityMonitor,
    judge,
    phi_digest,
    winning_digest,
)
from meshtrain.optim.outer_round import RoundReport

A, B, C, D = b"A" * 16, b"B" * 16, b"C" * 16, b"D" * 16


def test_majority_wins_and_the_minority_is_told():
    others = {"p2": [(5, A)], "p3": [(5, B)], "p4": [(5, B)], "p5": [(5, B)]}
    v = judge("p1", [(5, A)], others, completed_at={}, now=0.0)
    assert v.status == "minority" and v.majority == B and v.holders == ("p3", "p4", "p5")
    assert (v.agreeing, v.compared) == (2, 5)
    assert (
        judge(
            "p3", [(5, B)], {"p1": [(5, A)], "p2": [(5, A)], "p4": [(5, B)], "p5": [(5, B)]}, completed_at={}, now=0.0
        ).status
        == "ok"
    )


def test_a_tie_goes_to_the_side_of_the_lowest_peer_id():
    # Two groups of two (the soak's split round): the group holding the lowest id wins.
    assert (
        judge("p1", [(3, A)], {"p2": [(3, A)], "p3": [(3, B)], "p4": [(3, B)]}, completed_at={}, now=0.0).status == "ok"
    )
    v = judge("p3", [(3, B)], {"p1": [(3, A)], "p2": [(3, A)], "p4": [(3, B)]}, completed_at={}, now=0.0)
    assert v.status == "minority" and v.holders == ("p1", "p2")
    # No majority at all (everyone alone): still exactly one winner, the lowest id's.
    v = judge("p2", [(3, B)], {"p1": [(3, A)], "p3": [(3, C)]}, completed_at={}, now=0.0)
    assert v.status == "minority" and v.majority == A


def test_judges_the_newest_round_everyone_reached_and_waits_for_stragglers():
    # p2 is a round behind: round 4 is compared, not 5.
    v = judge("p1", [(4, A), (5, B)], {"p2": [(3, C), (4, A)]}, completed_at={}, now=0.0)
    assert (v.status, v.outer_round) == ("ok", 4)
    # p2 has not reached any round we keep: pending until settle_s, then judged without it.
    v = judge("p1", [(5, A)], {"p2": [(3, C)], "p3": [(5, B)]}, completed_at={5: 0.0}, now=1.0, settle_s=10)
    assert v.status == "pending"
    v = judge(
        "p1", [(5, A)], {"p2": [(3, C)], "p3": [(5, B)], "p0": [(5, B)]}, completed_at={5: 0.0}, now=11.0, settle_s=10
    )
    assert v.status == "minority" and v.compared == 3
    # A peer that joined after the round (its digests start later) is not counted.
    v = judge("p1", [(5, A)], {"p2": [(6, B)]}, completed_at={}, now=0.0)
    assert (v.status, v.compared) == ("ok", 1)


def test_a_stalled_peer_holds_each_round_open_for_settle_s_not_for_ever():
    """Rounds shorter than settle_s: our newest round is always fresh, yet a peer stalled at round
    3 must not keep every verdict pending (a soak saw two lineages run 13 rounds apart that way)."""
    mine = [(r, A if r < 6 else B) for r in range(4, 12)]  # we split off at round 6
    done = {r: 0.5 * r for r in range(4, 12)}  # one round every 0.5 s; now is round 11's end
    others = {"stalled": [(3, A)], "p2": [(r, A) for r in range(4, 12)], "p3": [(r, A) for r in range(4, 12)]}
    v = judge("p1", mine, others, completed_at=done, now=5.5, settle_s=3.0)
    assert (v.status, v.outer_round, v.compared) == ("ok", 5, 3)  # the newest round >= 3 s old: before the split
    v = judge("p1", mine, others, completed_at=done, now=6.5, settle_s=3.0)
    assert (v.status, v.outer_round, v.compared) == ("minority", 7, 3)  # judged without the stalled peer
    v = judge("p1", mine, others, completed_at=done, now=5.0, settle_s=3.0)
    assert v.status == "ok" and v.outer_round == 4  # round 4 is the newest 3 s old: still one lineage


def test_the_settle_time_follows_fast_rounds_but_not_below_a_floor():
    m = ParityMonitor("me", settle_s=3.0)
    assert m.settle() == 3.0  # no rounds yet
    m.completed_at = {r: 0.4 * r for r in range(8)}  # rounds every 0.4 s
    assert m.settle() == MIN_SETTLE_S  # two rounds (0.8 s), floored
    m.completed_at = {r: 0.9 * r for r in range(8)}
    assert abs(m.settle() - 1.8) < 1e-9
    m.completed_at = {r: 60.0 * r for r in range(8)}  # slow rounds: settle_s
    assert m.settle() == 3.0


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from([f"p{i}" for i in range(8)]), st.sampled_from([A, B, C, D]), min_size=1))
def test_every_peer_holding_the_same_records_picks_the_same_winner(held):
    """Whoever judges, the winning digest is the same, and it is held by a plurality."""
    winners = set()
    for me, mine in held.items():
        others = {p: [(7, d)] for p, d in held.items() if p != me}
        v = judge(me, [(7, mine)], others, completed_at={}, now=0.0)
        winners.add(v.majority)
        assert (v.status == "ok") == (mine == v.majority)
    assert len(winners) == 1
    counts = {d: sum(1 for x in held.values() if x == d) for d in held.values()}
    assert counts[winners.pop()] == max(counts.values())


def test_winning_digest_is_deterministic():
    assert winning_digest({A: {"p5"}, B: {"p2"}}) == B
    assert winning_digest({A: {"p5", "p6"}, B: {"p2"}}) == A


def test_monitor_keeps_rounds_increasing_across_a_resync():
    m = ParityMonitor("me")
    for r in range(12):
        m.record(r, bytes([r]) * 16)
    assert [r for r, _ in m.history] == list(range(12 - MAX_PHI_DIGESTS, 12))
    m.record(9, b"x" * 16)  # a re-sync to the swarm's round 9
    assert [r for r, _ in m.history] == [4, 5, 6, 7, 8, 9] and m.history[-1][1] == b"x" * 16
    off = ParityMonitor("me", enabled=False)
    assert off.check({"p": [(1, A)]}).status == "unchecked"


def test_phi_digest_sees_every_bit_and_ignores_order():
    phi = {"b": torch.zeros(3), "a": torch.ones(2)}
    d = phi_digest(phi)
    assert d == phi_digest(dict(reversed(list(phi.items()))))
    phi["b"][1] = 1e-30
    assert phi_digest(phi) != d and len(d) == 16


def test_progress_records_check_their_phi_digests():
    from meshtrain.crdt.swarm_records import phi_digests

    assert phi_digests([[1, A], [2, B]]) == ((1, A), (2, B))
    for bad in (
        [[2, A], [1, B]],
        [[1, "not bytes"]],
        [[1, A, 3]],
        [[1, A]] * (MAX_PHI_DIGESTS + 1),
        "x",
        [[-1, A]],
        [[1, b""]],
    ):
        with pytest.raises(CrdtError):
            phi_digests(bad)
    assert PeerProgress("p", 1, 2, 3, 4, ((1, A),)).phi_at(1) == A


def test_backoff_grows_jittered_and_never_spins():
    b = Backoff(initial=1.0, cap=8.0, rng=random.Random(1))
    waits = [b.next() for _ in range(8)]
    assert min(waits) >= 0.5 and max(waits) <= 8.0
    assert waits[4] >= 4.0 and len({round(w, 6) for w in waits}) == len(waits)
    with pytest.raises(ValueError):
        Backoff(initial=0)


def test_rounds_alone_are_solo_only_while_a_partner_trains_and_is_connected():
    monitor = ParityMonitor("me")
    assert monitor.completed_alone(AloneRounds(formed=3), []) is False  # partners killed or silent: ours is the only φ
    assert monitor.completed_alone(AloneRounds(formed=2), ["peer-b"]) is True  # peer-b trains and is reachable: a fork
    assert monitor.completed_alone(AloneRounds(failed=4), ["peer-b"]) is False  # failed rounds: withheld, re-synced
    assert monitor.status()["alone_rounds"] == 9 and monitor.status()["solo_rounds"] == 2
    # Retries shrank the group to us: the dropped partners were told, withhold and re-sync.
    assert monitor.completed_alone(AloneRounds(survived=2), ["peer-b"]) is False
    status = monitor.status()
    assert status["alone_rounds"] == 11 and status["solo_rounds"] == 2 and status["survived_rounds"] == 2


def test_a_trainer_that_carries_our_own_state_is_no_lineage_beside_our_round_alone():
    """Rounds of 20 steps, window 80; we completed round 34800 alone. The trainers beside it:
    a joiner that took our state of round 34780 20 ms before and has not trained past it
    (stop 64's 30-minute soak: counted solo, though it was refused, withheld and re-synced);
    one that took an older state of ours and trained on (it may hold a φ of its own now); one
    that never took ours, in the round; one further behind than the window."""
    steps = {"joiner": 34780, "older": 34790, "other": 34790, "far": 34700, "passed": 34810}
    taken = {"joiner": 34780, "older": 34700, "passed": 34780}
    beside = BesideAlone.of(steps, first=34800, window=80, period=20, taken=taken)
    assert beside.ours == ("joiner",)
    assert beside.behind == ("far",)
    # "passed" took our state of the round before, but reports a step past the round: it
    # completed the round without us, so may hold a φ of its own
    assert beside.partners == ("older", "other", "passed")
    monitor = ParityMonitor("me")
    assert (
        monitor.completed_alone(AloneRounds(formed=1), BesideAlone.of({"joiner": 34780}, 34800, 80, 20, taken).partners)
        is False
    )


def test_rounds_alone_are_sorted_by_how_they_came_to_be():
    def report(step, peers, error=""):
        return RoundReport(step, 0, 1, 0, 0, 0.1, 0.0, error=error, peers=peers, alone=True)

    rounds = [
        report(10, ("me",)),  # a group of one from the start
        report(30, ("me", "peer-b")),  # peer-b was dropped by a retry: excluded, in `peers`
        report(40, ("me",), error="refused by the coordinator"),  # failed: proceeded alone
    ]
    assert AloneRounds.of(rounds, "me") == AloneRounds(formed=1, survived=1, failed=1)
    assert AloneRounds.of([], "me") == AloneRounds()


def test_a_withheld_round_is_marked_until_a_digest_for_it_is_recorded():
    m = ParityMonitor("me")
    m.record(4, b"a" * 16)
    m.withhold(5)  # we went on alone in round 5: our donor marks that state
    assert m.is_withheld(5) and not m.is_withheld(4) and m.withheld == 1
    m.record(5, b"b" * 16)  # a re-sync landed at round 5: the swarm's φ, published
    assert not m.is_withheld(5) and m.withheld_round == 5 and m.withheld == 1
    m.withhold(7)
    assert not ParityMonitor("me", enabled=False).is_withheld(7) and m.is_withheld(7)
