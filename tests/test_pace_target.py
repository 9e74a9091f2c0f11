"""`SwarmPace`'s rule (node/pace.py), on paces given directly: the target is the median of the
other peers' steps carried forward, never past their next round; a peer skips while `SLACK`
behind, or while most others wait at a round it has not reached. Real daemons: tests/test_pace.py."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.node.pace import SLACK, PeerPace, SwarmPace


def pace_of(peers: list[PeerPace]) -> SwarmPace:
    pace = SwarmPace(None, None)  # type: ignore[arg-type]  # the rule reads only the paces given
    pace.update(peers)
    return pace


def test_a_record_is_carried_forward_at_its_rate_up_to_its_next_round():
    t = time.monotonic()
    assert PeerPace(10, t - 2.0, 3.0, 20).now(t) == 16  # 2 s at 3 steps/s
    assert PeerPace(10, t - 9.0, 3.0, 20).now(t) == 20  # never past its next send step
    assert PeerPace(20, t - 9.0, 3.0, 20).now(t) == 20  # waiting in its round: stays there


def test_nobody_else_training_means_no_target_and_no_skip():
    pace = pace_of([])
    assert pace.target() is None and not pace.behind(0)


def test_a_peer_slack_behind_skips_and_one_just_behind_trains():
    t = time.monotonic()
    pace = pace_of([PeerPace(15, t, 0.0, 20), PeerPace(15, t, 0.0, 20)])
    assert pace.behind(15 - SLACK) and not pace.behind(15 - SLACK + 1)


def test_the_last_steps_of_a_round_most_others_wait_at_are_skipped():
    t = time.monotonic()
    waiting = pace_of([PeerPace(20, t, 0.0, 20), PeerPace(20, t, 0.0, 20), PeerPace(17, t, 0.0, 20)])
    assert waiting.waiting_at() == 20 and waiting.behind(19) and not waiting.behind(20)
    minority = pace_of([PeerPace(20, t, 0.0, 20), PeerPace(18, t, 0.0, 20), PeerPace(18, t, 0.0, 20)])
    assert minority.waiting_at() is None and not minority.behind(19)


@settings(max_examples=200, deadline=None)
@given(
    honest=st.lists(st.integers(0, 1000), min_size=2, max_size=9),
    lie=st.integers(0, 10**9),
    H=st.integers(1, 100),
)
def test_one_peer_reporting_any_step_moves_the_target_no_further_than_the_honest_ones(honest, lie, H):
    """With at least two honest others, a liar's step (any value) leaves the target within the
    honest peers' steps carried to their next round: it cannot make a peer skip a round."""
    t = time.monotonic()

    def cap(step: int) -> int:
        return step if step % H == 0 else step + H - step % H

    peers = [PeerPace(s, t, 0.0, cap(s)) for s in honest]
    target = pace_of([*peers, PeerPace(lie, t, 0.0, cap(lie))]).target()
    assert target is not None and min(honest) <= target <= max(cap(s) for s in honest)


def test_a_peer_looks_ahead_by_its_own_step_time():
    """The others move 10 steps a second from step 10; our trained step took 0.3 s. Before the
    next, we look 0.3 s ahead, where they will be at 16: from 11 that is SLACK or more behind
    (skip), from 15 it is not (train)."""
    t = 1000.0
    pace = pace_of([PeerPace(10, t, 10.0, 50), PeerPace(10, t, 10.0, 50)])
    assert not pace.behind(10, at=t)  # no step time yet: they are at 10, so are we
    assert pace.behind(11, at=t + 0.3)  # that step took 0.3 s: at t + 0.6 they are at 16
    assert not pace.behind(15, at=t + 0.3)
