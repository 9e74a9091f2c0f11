"""Averaging with one partner (NoLoCo's step) between real hosts."""

from __future__ import annotations

from contextlib import AsyncExitStack

import torch
import trio

from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.contract import RoundRequest

from .conftest import start_peers


async def pair_collectives(stack, config=None):
    peers = await start_peers(stack, 2)
    ids = sorted(p.id for p in peers)
    return peers, [SwarmCollective(p.host, p.ts, lambda r: ids, config) for p in peers]


async def test_pair_average_is_exact_and_bit_identical():
    async with AsyncExitStack() as stack:
        peers, cols = await pair_collectives(stack)
        x = [{"w": torch.randn(1000), "h": torch.randn(9).half()} for _ in range(2)]
        res = [None, None]
        async with trio.open_nursery() as nursery:
            for i in range(2):

                async def one(i=i):
                    res[i] = await cols[i].average_with(peers[1 - i].id, RoundRequest(x[i], round_id=3))

                nursery.start_soon(one)
        assert res[0].digest == res[1].digest
        assert res[0].contributors == tuple(sorted(p.id for p in peers))
        assert torch.equal(res[0].tensors["w"], res[1].tensors["w"])
        assert torch.allclose(res[0].tensors["w"], (x[0]["w"] + x[1]["w"]) / 2)
        assert res[0].tensors["h"].dtype == torch.float16


async def test_pair_average_with_codec_stays_identical():
    async with AsyncExitStack() as stack:
        peers, cols = await pair_collectives(stack)
        x = [{"w": torch.randn(4096)} for _ in range(2)]
        res = [None, None]
        async with trio.open_nursery() as nursery:
            for i in range(2):

                async def one(i=i):
                    res[i] = await cols[i].average_with(peers[1 - i].id, RoundRequest(x[i], round_id=1, codec="int4"))

                nursery.start_soon(one)
        assert res[0].digest == res[1].digest
        assert (res[0].tensors["w"] - (x[0]["w"] + x[1]["w"]) / 2).abs().max() < 0.5


async def test_absent_partner_means_proceeding_alone_within_the_deadline():
    async with AsyncExitStack() as stack:
        peers, cols = await pair_collectives(stack, AllReduceConfig(part_timeout=1.0))
        x = {"w": torch.randn(100)}
        with trio.fail_after(5):
            res = await cols[0].average_with(peers[1].id, RoundRequest(x, round_id=9))
        assert res.contributors == (peers[0].id,)
        assert torch.equal(res.tensors["w"], x["w"]) and peers[1].id in res.excluded


async def test_no_partner_returns_own_input():
    async with AsyncExitStack() as stack:
        peers, cols = await pair_collectives(stack)
        x = {"w": torch.randn(10)}
        res = await cols[0].average_with(None, RoundRequest(x, round_id=1))
        assert res.contributors == (peers[0].id,) and torch.equal(res.tensors["w"], x["w"])


async def test_a_partner_that_reports_a_step_past_the_round_is_not_waited_for():
    """The daemon matrix's NoLoCo case: a restarted peer waited out the whole deadline at a round
    its partner had passed (and the partner, pairing with it again later, waited out its own)."""
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 2)
        ids = sorted(p.id for p in peers)
        reported: dict[str, int] = {}
        config = AllReduceConfig(part_timeout=30.0)
        col = SwarmCollective(peers[0].host, peers[0].ts, lambda r: ids, config, reported_step=reported.get)
        x = {"w": torch.randn(100)}
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            got: dict = {}

            async def wait_at_round_8() -> None:
                got["r"] = await col.average_with(peers[1].id, RoundRequest(x, round_id=8, overlap=4))

            nursery.start_soon(wait_at_round_8)
            reported[peers[1].id] = 12  # inside round 8's overlap (8 + 4): it may still come
            await trio.sleep(1.0)  # sleep: the waiting side must keep waiting through this
            assert "r" not in got
            reported[peers[1].id] = 13  # past it
        res = got["r"]
        assert res.contributors == (peers[0].id,) and torch.equal(res.tensors["w"], x["w"])
        assert "past round 8" in res.excluded[peers[1].id]
        assert trio.current_time() - started < 5


async def test_a_partner_inside_the_overlap_still_averages():
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 2)
        ids = sorted(p.id for p in peers)
        reported = {p.id: 10 for p in peers}  # both trained on into round 8's overlap
        cols = [SwarmCollective(p.host, p.ts, lambda r: ids, reported_step=reported.get) for p in peers]
        x = [{"w": torch.randn(100)} for _ in range(2)]
        res: list = [None, None]
        async with trio.open_nursery() as nursery:
            for i in range(2):

                async def one(i=i):
                    if i:
                        await trio.sleep(0.6)  # sleep: the partner arrives after a few polls
                    res[i] = await cols[i].average_with(peers[1 - i].id, RoundRequest(x[i], round_id=8, overlap=4))

                nursery.start_soon(one)
        assert res[0].contributors == res[1].contributors == tuple(ids) and res[0].digest == res[1].digest


async def test_a_partner_killed_while_we_wait_means_proceeding_alone_not_an_error():
    """Its connection closes under our transfer (PeerGone, a TransferError, from inside the
    exchange's nurseries): we go on alone. A daemon once exited on it (the error came nested one
    group deeper than the check looked)."""
    dies = trio.Event()

    async def run_partner(task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with AsyncExitStack() as partner_stack:
            task_status.started((await start_peers(partner_stack, 1))[0])
            await dies.wait()  # then its host closes: every connection to it drops

    async with AsyncExitStack() as stack:
        me = (await start_peers(stack, 1))[0]
        got: dict = {}
        async with trio.open_nursery() as nursery:
            partner = await nursery.start(run_partner)
            await me.host.connect(partner.host.addrs[0])
            ids = sorted((me.id, partner.id))
            col = SwarmCollective(me.host, me.ts, lambda r: ids, AllReduceConfig(part_timeout=20.0))
            x = {"w": torch.randn(1 << 20)}

            async def wait_for_partner() -> None:
                got["r"] = await col.average_with(partner.id, RoundRequest(x, round_id=4))

            nursery.start_soon(wait_for_partner)
            await trio.sleep(0.5)  # sleep: our side is waiting on the partner when it dies
            dies.set()
        res = got["r"]
        assert res.contributors == (me.id,) and torch.equal(res.tensors["w"], x["w"]) and partner.id in res.excluded
