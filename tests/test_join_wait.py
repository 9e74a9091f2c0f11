"""A member waiting for its join's reply stops waiting once the coordinator leaves the round's
candidates (collective/join_wait.py): the rule on trio's MockClock, and a round of real hosts on
loopback whose coordinator is excluded while it holds the others' joins."""

from __future__ import annotations

import contextlib
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from meshtrain.collective import join_wait
from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.contract import CollectiveError, RoundRequest
from meshtrain.collective.join_wait import await_join_reply
from meshtrain.collective.protocol import RoundKey

from .test_allreduce import connected_peers, exact_mean


async def reply_after(seconds: float) -> str:
    await trio.sleep(seconds)  # sleep: the reply's delay is what is tested (virtual time: MockClock)
    return "joined"


async def test_the_reply_is_returned_while_the_coordinator_stays(autojump_clock):
    async with trio.open_nursery() as nursery:
        assert await await_join_reply(lambda: reply_after(30.0), lambda: True, nursery) == "joined"
        assert trio.current_time() == 30.0


async def test_the_wait_ends_once_the_coordinator_has_left_for_gone_s(autojump_clock):
    left_at = 4.0
    async with trio.open_nursery() as nursery:
        got = await await_join_reply(lambda: reply_after(60.0), lambda: trio.current_time() < left_at, nursery)
        assert got is None
        # Seen gone at the first check past left_at, given up GONE_S later (checks are CHECK_S apart).
        assert left_at + join_wait.GONE_S <= trio.current_time() <= left_at + join_wait.GONE_S + join_wait.CHECK_S
        assert not nursery.child_tasks  # the watcher ended with the wait


async def test_a_coordinator_missing_from_one_read_of_the_view_is_kept(autojump_clock):
    def is_candidate() -> bool:  # gone for one check at t = 2.0, back at the next
        return not 1.9 < trio.current_time() < 2.1

    async with trio.open_nursery() as nursery:
        assert await await_join_reply(lambda: reply_after(10.0), is_candidate, nursery) == "joined"


async def test_a_join_given_up_on_or_cancelled_is_withdrawn_and_one_answered_or_refused_is_not(autojump_clock):
    withdrawn: list[float] = []

    async def withdraw() -> None:
        withdrawn.append(trio.current_time())

    async def refused() -> str:
        raise RuntimeError("refused")

    async with trio.open_nursery() as nursery:
        assert await await_join_reply(lambda: reply_after(3.0), lambda: True, nursery, withdraw) == "joined"
        with pytest.raises(RuntimeError):
            await await_join_reply(refused, lambda: True, nursery, withdraw)
        await trio.sleep(0.1)  # sleep: virtual time: a withdrawal would run now
        assert withdrawn == []
        given_up = await await_join_reply(
            lambda: reply_after(60.0), lambda: trio.current_time() < 5.0, nursery, withdraw
        )
        assert given_up is None
        await trio.sleep(0.1)  # sleep: virtual time: the withdrawal runs in the nursery
        assert (
            len(withdrawn) == 1 and 5.0 + join_wait.GONE_S <= withdrawn[0] <= 5.0 + join_wait.GONE_S + join_wait.CHECK_S
        )
        with trio.move_on_after(2.0):  # cancelled from outside: its coordinator went silent, or the exchange ended
            await await_join_reply(lambda: reply_after(60.0), lambda: True, nursery, withdraw)
        await trio.sleep(0.1)  # sleep: virtual time: the withdrawal runs in the nursery
        assert len(withdrawn) == 2 and withdrawn[1] == pytest.approx(trio.current_time() - 0.1)


async def test_a_joiner_that_gives_up_a_coordinator_still_counting_it_withdraws_its_join_there():
    """The 30-minute soak's class (coordinator.py "Withdrawn joins"), with real hosts: peer 1's
    join is in at the lowest id, which drops out of peer 1's view (a restarted coordinator's
    record, not live for a moment); peer 1 leaves for the next candidate. The coordinator, whose
    own view still counts peer 1, used to keep its join and fix a group with it."""
    config = AllReduceConfig(join_timeout=20, part_timeout=20)
    async with AsyncExitStack() as stack:
        peers = await connected_peers(stack, 3)
        ids = [p.id for p in peers]
        theirs = list(ids)  # peer 1's view; the others' stay whole
        cols = [
            SwarmCollective(p.host, p.ts, (lambda _r: list(theirs)) if i == 1 else (lambda _r: list(ids)), config)
            for i, p in enumerate(peers)
        ]
        tensors = [{"w": torch.full((1000,), float(i))} for i in range(3)]
        at_lowest = RoundKey(7, "f0", ids[0])
        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:

                async def one(i: int) -> None:  # its round may end alone meanwhile: not what is tested
                    with contextlib.suppress(CollectiveError):
                        await cols[i].all_reduce(RoundRequest(tensors[i], round_id=7, tag="f0"))

                for i in (1, 2):  # the coordinator's own trainer is away (fetching a state)
                    nursery.start_soon(one, i)
                while cols[0].coordinator.local.joined(at_lowest) != {ids[1], ids[2]}:  # both joins are in ...
                    await trio.sleep(0.02)  # sleep: poll interval
                theirs.remove(ids[0])  # ... when peer 1 stops counting the coordinator
                gone = trio.current_time()
                while ids[1] in cols[0].coordinator.local.joined(at_lowest):
                    await trio.sleep(0.02)  # sleep: poll interval
                assert trio.current_time() - gone <= join_wait.GONE_S + join_wait.CHECK_S + 1.0
                assert cols[0].coordinator.local.joined(at_lowest) == {ids[2]}
                nursery.cancel_scope.cancel()


async def test_peers_waiting_at_a_coordinator_excluded_meanwhile_form_the_round_at_the_next():
    # The lowest id holds both others' joins and never brings its data (a liar that strikes
    # exclude while the joins wait at it: stays connected, keeps the joins open). Without the
    # watcher the two would wait out the 20 s join deadline there.
    config = AllReduceConfig(join_timeout=20, part_timeout=20)
    async with AsyncExitStack() as stack:
        peers = await connected_peers(stack, 3)
        ids = [p.id for p in peers]
        view = list(ids)
        cols = [SwarmCollective(p.host, p.ts, lambda _r: list(view), config) for p in peers]
        tensors = [{"w": torch.full((1000,), float(i))} for i in range(3)]
        results = [None] * 3
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in (1, 2):

                    async def one(i: int = i) -> None:
                        results[i] = await cols[i].all_reduce(RoundRequest(tensors[i], round_id=7, tag="f0"))

                    nursery.start_soon(one)
                at_lowest = RoundKey(7, "f0", ids[0])
                while cols[0].coordinator.local.joined(at_lowest) != {ids[1], ids[2]}:  # both joins are in ...
                    await trio.sleep(0.02)  # sleep: poll interval
                started = trio.current_time()
                view.remove(ids[0])  # ... when the others stop counting it
        assert trio.current_time() - started < 5.0
        expected = exact_mean(tensors[1:])
        for r in results[1:]:
            assert r.contributors == (ids[1], ids[2])
            assert torch.equal(r.tensors["w"], expected["w"])
        assert results[1].digest == results[2].digest


async def test_a_coordinator_out_of_the_candidates_but_still_present_keeps_the_joins():
    """A restarted coordinator's new record says "syncing" for a moment, and can reach the others
    after they joined it at its old one: it is out of their round's candidates, yet it holds
    their joins, counts them and runs the round. Leaving it (as for an excluded one) made a peer
    finish the round alone while the coordinator waited 20 s for its data and then finished it
    alone too: two φ for one round (tests/test_daemon_matrix.py, [py])."""
    config = AllReduceConfig(join_timeout=20, part_timeout=20)
    async with AsyncExitStack() as stack:
        peers = await connected_peers(stack, 3)
        ids = [p.id for p in peers]
        theirs = list(ids)  # peers 1 and 2's view; the coordinator's own stays whole
        present = set(ids)
        cols = [
            SwarmCollective(peers[0].host, peers[0].ts, lambda _r: list(ids), config),
            *(
                SwarmCollective(p.host, p.ts, lambda _r: list(theirs), config, present=present.__contains__)
                for p in peers[1:]
            ),
        ]
        tensors = [{"w": torch.full((1000,), float(i))} for i in range(3)]
        results = [None] * 3
        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:

                async def one(i: int) -> None:
                    results[i] = await cols[i].all_reduce(RoundRequest(tensors[i], round_id=7, tag="f0"))

                for i in (1, 2):
                    nursery.start_soon(one, i)
                at_lowest = RoundKey(7, "f0", ids[0])
                while cols[0].coordinator.local.joined(at_lowest) != {ids[1], ids[2]}:  # both joins are in ...
                    await trio.sleep(0.02)  # sleep: poll interval
                theirs.remove(ids[0])  # ... when its "syncing" record reaches them
                await trio.sleep(3 * join_wait.GONE_S)  # sleep: longer than a coordinator may be gone
                nursery.start_soon(one, 0)  # its own trainer comes back into the round
        expected = exact_mean(tensors)
        assert all(r.contributors == tuple(sorted(ids)) for r in results), [r.contributors for r in results]
        assert all(torch.equal(r.tensors["w"], expected["w"]) for r in results)
        assert len({r.digest for r in results}) == 1
