"""The collective's RPC gate (collective/round_gate.py): members of the round, for a round near
ours; a probe that names no round is checked against the round we are at."""

from __future__ import annotations

import pytest
import trio

from meshtrain.collective.protocol import COORDINATOR_BEHIND, NOT_A_MEMBER, OUT_OF_WINDOW, AllReduceConfig
from meshtrain.collective.round_gate import RoundGate
from meshtrain.transport.rpc import RemoteError


def gate(current: int | None = 12) -> RoundGate:
    # "late" is in the roster from round 10 on (a joiner entered ahead in a grouped swarm).
    def membership(round_id: int) -> list[str]:
        return ["a", "b"] + (["late"] if round_id >= 10 else [])

    return RoundGate("a", AllReduceConfig(round_window=4), membership, lambda: current, lambda: None)


async def test_members_pass_strangers_are_refused_and_counted():
    g = gate()
    await g.require_member("b", 12, wait=False)
    with pytest.raises(RemoteError) as refused:
        await g.require_member("stranger", 12, wait=False)
    assert refused.value.code == NOT_A_MEMBER and g.refused == {NOT_A_MEMBER: 1}


async def test_a_probe_naming_no_round_is_checked_against_ours():
    """A download's silence probe asks about round -1: a member of the round we are at passes
    (it used to be refused as not in round -1's roster, and counted as a stranger); a stranger is
    still refused."""
    g = gate()
    await g.require_member("late", -1, wait=False)
    with pytest.raises(RemoteError):
        await g.require_member("stranger", -1, wait=False)
    assert g.refused == {NOT_A_MEMBER: 1}


def test_a_join_far_from_our_round_is_refused_by_direction():
    g = gate()
    g.check_window(15)
    for round_id, code in ((20, COORDINATOR_BEHIND), (2, OUT_OF_WINDOW)):
        with pytest.raises(RemoteError) as refused:
            g.check_window(round_id)
        assert refused.value.code == code
    gate(current=None).check_window(1000)  # our position unknown: nothing to judge


async def test_a_join_waits_briefly_for_its_senders_membership_record(autojump_clock):
    members = ["a"]
    g = RoundGate("a", AllReduceConfig(member_wait=5.0), lambda _r: members, None, lambda: None)

    async def arrives() -> None:
        await trio.sleep(1.0)  # sleep: virtual time, the record arrives a second later
        members.append("b")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(arrives)
        await g.require_member("b", 3)
    assert not g.refused
