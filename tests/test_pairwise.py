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
