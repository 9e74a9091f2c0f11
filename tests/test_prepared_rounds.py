"""Prepared rounds (collective/prepared.py, outer_round.py "Prepared rounds"): a round's join sent
ahead of its data is taken by the round, and one that is never taken is withdrawn so the others
are not held up — real hosts on loopback."""

from __future__ import annotations

from contextlib import AsyncExitStack

import blake3
import torch
import trio

from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.contract import RoundRequest
from meshtrain.collective.protocol import RoundKey
from meshtrain.optim import NoLoCo, SparseLoCo, StreamingDiLoCo

from .test_allreduce import exact_mean, mesh, run_all


async def joins_in(coordinator: SwarmCollective, key: RoundKey, peers: set[str]) -> None:
    """Wait until the joins of `peers` are in at `coordinator`, in its round `key`."""
    with trio.fail_after(10):
        while coordinator.coordinator.local.joined(key) != peers:
            await trio.sleep(0.02)  # sleep: poll interval


async def test_prepared_joins_are_taken_by_their_round():
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 3)
        for col in cols:
            await col.prepare(round_id=5, tag="f0", within=0.2)
        # The joins went out; they wait at the coordinator, which did not prepare.
        await joins_in(cols[0], RoundKey(5, "f0", peers[0].id), {p.id for p in peers[1:]})
        tensors = [{"w": torch.randn(3000), "b": torch.randn(5)} for _ in cols]
        results = await run_all(cols, tensors, round_id=5, tag="f0")
        assert len({r.digest for r in results}) == 1
        expected = exact_mean([tensors[i] for i in range(3)])  # peers are sorted by id
        for r in results:
            assert r.contributors == tuple(p.id for p in peers)
            assert all(torch.equal(r.tensors[k], expected[k]) for k in expected)
        # The coordinator (the lowest id) prepares nothing: its join is a local call, and the group
        # must still wait for it to reach the round's data (prepared.py).
        assert [(c.prepared.prepared, c.prepared.used, c.prepared.withdrawn) for c in cols] == [(0, 0, 0)] + [
            (1, 1, 0)
        ] * 2
        # A round nobody prepared joins as before.
        results = await run_all(cols, tensors, round_id=6, tag="f0")
        assert len({r.digest for r in results}) == 1 and [c.prepared.used for c in cols] == [0, 1, 1]


async def test_an_unused_prepared_join_is_withdrawn_and_the_round_goes_on_without_it():
    # part_timeout is long: without the withdrawal the two would wait 30 s for the third's data.
    config = AllReduceConfig(join_timeout=5, part_timeout=30)
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 3, config)
        for col in cols:
            col.prepared.slack = 0.5
            await col.prepare(round_id=9, tag="f1", within=0.0)
        tensors = [{"w": torch.full((100,), float(i + 1))} for i in range(3)]
        with trio.fail_after(10):
            results = await run_all(cols[:2], tensors[:2], round_id=9, tag="f1")
        assert [r.contributors for r in results] == [(peers[0].id, peers[1].id)] * 2
        assert torch.equal(results[0].tensors["w"], torch.full((100,), 1.5))
        assert [c.prepared.withdrawn for c in cols] == [0, 0, 1]


async def test_a_prepared_join_outlives_its_expiry_while_our_trainer_is_still_coming():
    """A loaded machine slowed a peer's trainer past its prepared join's expiry: withdrawn as the
    group formed, the join left its partner a round of one. While our trainer's step is still
    before the round, the join is kept, and the slow peer's data joins the round late."""
    config = AllReduceConfig(join_timeout=5, part_timeout=30)
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 3, config)
        ids = [p.id for p in peers]
        step = [8]  # the slow peer's trainer: still before round 9
        cols[2] = SwarmCollective(peers[2].host, peers[2].ts, lambda r: ids, config, trainer_step=lambda: step[0])
        for col in cols:
            col.prepared.slack = 0.3
            await col.prepare(round_id=9, tag="f0", within=0.0)  # expires after 0.3 s
        tensors = [{"w": torch.full((10,), float(i + 1))} for i in range(3)]
        results: list = [None] * 3

        async def slow_peer() -> None:
            await trio.sleep(1.5)  # sleep: the trainer reaches the round five expiries late
            step[0] = 9
            results[2] = await cols[2].all_reduce(RoundRequest(tensors[2], round_id=9, tag="f0"))

        async def quick_pair() -> None:
            results[:2] = await run_all(cols[:2], tensors[:2], round_id=9, tag="f0")

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow_peer)
                nursery.start_soon(quick_pair)
        assert [r.contributors for r in results] == [tuple(ids)] * 3
        assert torch.equal(results[0].tensors["w"], torch.full((10,), 2.0))
        assert [(c.prepared.used, c.prepared.withdrawn) for c in cols] == [(0, 0), (1, 0), (1, 0)]


async def test_an_unprepared_round_is_withdrawn_at_once():
    config = AllReduceConfig(join_timeout=5, part_timeout=30)
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 3, config)
        for col in cols:
            await col.prepare(round_id=4, tag="f0", within=10.0)  # would expire only after 25 s
        await joins_in(cols[0], RoundKey(4, "f0", peers[0].id), {p.id for p in peers[1:]})
        await cols[2].unprepare(round_id=4, tag="f0")  # its training ended
        tensors = [{"w": torch.full((10,), float(i))} for i in range(2)]
        with trio.fail_after(5):
            results = await run_all(cols[:2], tensors, round_id=4, tag="f0")
        assert [r.contributors for r in results] == [(peers[0].id, peers[1].id)] * 2
        assert [c.prepared.withdrawn for c in cols] == [0, 0, 1]


async def test_a_prepared_join_under_a_stale_coordinator_is_dropped():
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 3)
        ids = [p.id for p in peers]
        view = ids[1:]  # the highest id has not heard of the lowest yet: it would join at the middle one
        cols[2] = SwarmCollective(peers[2].host, peers[2].ts, lambda r: view, AllReduceConfig(join_timeout=5))
        await cols[2].prepare(round_id=3, tag="f0", within=0.1)
        assert cols[2].prepared.prepared == 1
        view.insert(0, ids[0])  # now it has: the round runs at the lowest id
        tensors = [{"w": torch.full((10,), float(i))} for i in range(3)]
        results = await run_all(cols, tensors, round_id=3, tag="f0")
        assert [r.contributors for r in results] == [tuple(ids)] * 3
        assert cols[2].prepared.used == 0  # its first join went to the lowest id, afresh


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))


async def test_streaming_diloco_prepares_its_fragment_rounds_over_real_peers():
    steps, H, P, tau = 22, 8, 2, 2  # sends at steps 4, 8, …, 20; step 24's is prepared at 21
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 2)
        outers = []
        for col in cols:
            model = _model(0)
            outers.append(
                StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), col, H=H, fragments=P, delay=tau)
            )
        assert all(o.prepares_rounds for o in outers)

        async def train(i: int) -> None:
            outer = outers[i]
            gen = torch.Generator().manual_seed(i)
            async with outer:
                for _ in range(steps):
                    x = torch.randn(16, 8, generator=gen)
                    loss = outer.model(x).pow(2).mean()
                    outer.zero_grad()
                    loss.backward()
                    await outer.astep()
                    await trio.sleep(0.01)  # sleep: an inner step of ~10 ms, so rounds are due well within the lead
                await outer.afinish()

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(train, i)
        # Both `afinish`es have returned: every exchange is merged into `history`, and step 24's
        # prepared join was dropped (at once, in `unprepare`), so nothing below waits for a task.
        for outer in outers:
            assert [r.contributors for r in outer.history] == [2] * 5
            assert not [r.error for r in outer.history if r.error]
        # The peer that does not coordinate prepared every round (the first send is at step H/P,
        # after a timed step) and took it; the one of step 24, which training did not reach, was
        # dropped by `afinish` (withdrawn if the coordinator ever admits it). The coordinator
        # prepares nothing.
        assert [(c.prepared.prepared, c.prepared.used) for c in cols] == [(0, 0), (6, 5)]
        assert (24, "f0") not in cols[1].prepared

        def digest(outer) -> str:
            h = blake3.blake3()
            for n in sorted(outer.outer_params):
                h.update(outer.outer_params[n].numpy().tobytes())
            return h.hexdigest()

        assert digest(outers[0]) == digest(outers[1])


def test_optimizers_with_their_own_exchange_do_not_prepare():
    from meshtrain.collective.local import LocalSwarm

    swarm = LocalSwarm(2)
    model = _model(0)
    # A collective that cannot prepare: nothing to prepare with.
    assert not StreamingDiLoCo(model, None, swarm.member(0), H=8, fragments=2).prepares_rounds

    class Preparing:
        """A collective that prepares (only the optimizer's side is judged here)."""

        peer_id = "me"

        async def prepare(self, *, round_id: int, tag: str = "", within: float = 1.0) -> None: ...

        async def unprepare(self, *, round_id: int, tag: str = "") -> None: ...

    col = Preparing()
    assert not NoLoCo(_model(0), None, col, H=8).prepares_rounds  # pairs, not one all-reduce
    assert not SparseLoCo(_model(0), None, col, H=8).prepares_rounds  # a gather, then a choice
    assert StreamingDiLoCo(_model(0), None, col, H=8, fragments=2).prepares_rounds
