"""`RoundSchedule` (optim/schedule.py): the one statement of when fragments are sent and merged,
checked as properties over every valid (H, P, τ) and against its rules' edges."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshtrain.optim.schedule import RoundSchedule


@st.composite
def schedules(draw: st.DrawFn) -> RoundSchedule:
    P = draw(st.integers(1, 8))
    H = P * draw(st.integers(1, 12))
    return RoundSchedule(H, P, draw(st.integers(0, H // P - 1)))


@given(schedules(), st.integers(0, 200))
def test_each_fragment_is_sent_once_in_every_window_of_H_steps(s, start):
    sent: list[int] = []
    for step in range(start + 1, start + s.H + 1):
        sent += s.sends_at(step)
    assert sorted(sent) == list(range(s.fragments))


@given(schedules(), st.integers(0, 200))
def test_next_send_step_is_the_first_step_that_sends(s, step):
    nxt = s.next_send_step(step)
    assert nxt > step and s.sends_at(nxt)
    assert not any(s.sends_at(k) for k in range(step + 1, nxt))


@given(schedules(), st.integers(1, 200))
def test_a_fragment_is_merged_before_the_next_fragment_is_sent(s, step):
    for _ in s.sends_at(step):
        assert s.merge_step(step) < s.next_send_step(step) or s.merge_step(step) == step


@given(schedules(), st.integers(0, 200))
def test_last_merge_step_is_the_latest_merge_at_or_before_the_step(s, step):
    """The step an offered state dates from (node/state/run_state.py `donor_snapshot`): a merge
    (or 0, the start), at or before `step`, with no merge after it up to `step`."""
    merges = {s.merge_step(sent) for sent in range(1, step + 1) if s.sends_at(sent)}
    last = s.last_merge_step(step)
    assert last <= step
    assert last == max((m for m in merges if m <= step), default=0)
    assert last == 0 or last in merges


def test_nothing_is_sent_at_step_zero():
    assert RoundSchedule(4).sends_at(0) == [] and RoundSchedule(4).sends_at(4) == [0]


@pytest.mark.parametrize(
    ("H", "P", "delay", "rule"),
    [
        (0, 1, 0, "H"),
        (5, 2, 0, "multiple"),
        (4, 2, 2, "delay"),
        (4, 0, 0, "fragments"),
        (4, 1, -1, "delay"),
        (True, 1, 0, "H"),
    ],
)
def test_an_impossible_schedule_names_its_rule(H, P, delay, rule):
    with pytest.raises(ValueError, match=rule):
        RoundSchedule(H, P, delay)
