"""Properties of the rules that decide an attempt from its members' reports (attempt_rules.py),
over any mix of reports a group can send: honest, failed, self-accusing, lying with or without
proof, missing. The coordinator's timers around them are tests/test_coordinator.py's."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshtrain.collective.attempt_rules import Attempt, commit_of, next_group, whom_to_drop
from meshtrain.collective.protocol import DONE, FAIL, Abort, Report, RoundKey

KEY = RoundKey(7, "", "a")
PEERS = tuple("abcdefg")


@st.composite
def attempts(draw: st.DrawFn) -> Attempt:
    """An attempt among 1–7 members, each of which reported done (one of two digests), failed
    (suspecting any members, itself included, with or without proof) or not at all."""
    group = PEERS[: draw(st.integers(1, len(PEERS)))]
    a = Attempt(group, started=0.0)
    for p in group:
        kind = draw(st.sampled_from(["done", "fail", "missing"]))
        if kind == "done":
            digest = draw(st.sampled_from([b"\x01" * 16, b"\x02" * 16, None]))
            a.take(p, Report(KEY, 0, DONE, digest, (), (), False))
        elif kind == "fail":
            suspects = tuple(draw(st.lists(st.sampled_from(PEERS), max_size=3, unique=True)))
            a.take(p, Report(KEY, 0, FAIL, None, suspects, (), draw(st.booleans())))
    a.first_fail = 0.0 if a.failed else None
    return a


@given(attempts())
def test_a_commit_accounts_for_every_member_once_and_follows_the_plurality(a: Attempt) -> None:
    commit = commit_of(a)
    votes = [rep.digest for rep in a.reports.values() if not rep.failed and rep.digest is not None]
    if not votes:
        assert commit is None
        return
    assert commit is not None
    failed = {p for p, rep in a.reports.items() if rep.failed}
    parts = [set(commit.holders), set(commit.resync), set(commit.unconfirmed), failed]
    assert sum(len(x) for x in parts) == len(a.group) and set().union(*parts) == set(a.group)
    assert votes.count(commit.digest) == max(votes.count(d) for d in votes)


@given(attempts(), st.booleans())
def test_a_failure_drops_someone_blamed_and_every_member_that_left(a: Attempt, past_deadline: bool) -> None:
    blamed = {s for rep in a.reports.values() if rep.failed for s in rep.suspects}
    drop = whom_to_drop(a, live=lambda _p: True, now=100.0 if past_deadline else 0.0, report_timeout=10.0)
    if drop is None:  # a slow member is heard first — never once the report deadline passed
        assert not past_deadline
        return
    assert drop <= blamed and (drop or not blamed)
    leavers = {p for p, rep in a.reports.items() if rep.failed and p in rep.suspects and rep.evidence}
    assert leavers <= drop  # a member that accused itself with its evidence flag set is leaving
    gone = {s for s in blamed if s not in a.reports}
    assert gone <= drop  # blamed and never reported


@given(attempts(), st.sets(st.sampled_from(PEERS)), st.integers(1, 4), st.booleans())
def test_a_retry_always_shrinks_the_group_and_never_leaves_one_after_a_leaver_or_beside_others(
    a: Attempt, suspects: set[str], attempts_so_far: int, others_train: bool
) -> None:
    group = next_group(a, suspects, attempts_so_far, max_attempts=3, others_train=others_train)
    if isinstance(group, Abort):
        return
    assert set(group) < set(a.group) and not set(group) & suspects
    assert attempts_so_far < 3
    left = [p for p in suspects if (rep := a.reports.get(p)) is not None and rep.failed and p in rep.suspects]
    assert not (len(group) == 1 and (left or others_train))
