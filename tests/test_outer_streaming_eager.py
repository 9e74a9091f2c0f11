"""Eager updates for Streaming DiLoCo (arXiv 2502.12996; streaming.py, point 4), against the
paper's identities: with one peer, or with peers whose pseudo-gradients are equal, the local
pseudo-gradient *is* the average, so eager overlap equals the blocking round bit for bit; and in
general the correction leaves θ − φ equal to the local progress of the overlapped steps."""

from __future__ import annotations

import pytest
import torch
import trio

from meshtrain.collective import LocalSwarm
from meshtrain.optim import StreamingDiLoCo

from .test_outer_diloco import CORPUS, eval_loss, tiny
from .test_outer_streaming import TwoBlocks


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=3e-3)


def step_grad(model: torch.nn.Module, worker: int, step: int) -> None:
    x, y = CORPUS.batch(8, 16, seed=0, peer=worker, step=step)
    model.zero_grad(set_to_none=True)
    model(x, y).loss.backward()


async def run(
    k: int,
    *,
    eager: bool,
    delay: int,
    steps: int = 24,
    same_data: bool = False,
    momentum: float = 0.9,
    nesterov: bool = True,
):
    swarm = LocalSwarm(k)
    models = [tiny() for _ in range(k)]
    outers = [
        StreamingDiLoCo(
            m,
            adamw(m),
            swarm.member(i),
            H=8,
            fragments=2,
            delay=delay,
            alpha=0.0,
            codec="none",
            eager=eager,
            momentum=momentum,
            nesterov=nesterov,
        )
        for i, m in enumerate(models)
    ]
    async with trio.open_nursery() as outer_scope:
        for o in outers:
            await outer_scope.start(_enter, o)
        for step in range(steps):
            async with trio.open_nursery() as nursery:
                for i, (o, m) in enumerate(zip(outers, models, strict=True)):

                    async def one(i=i, o=o, m=m, step=step):
                        step_grad(m, 0 if same_data else i, step)
                        await o.astep()

                    nursery.start_soon(one)
        for o in outers:
            await o.afinish()
        outer_scope.cancel_scope.cancel()
    return models, outers


async def _enter(o: StreamingDiLoCo, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with o:
        task_status.started()
        await trio.sleep_forever()


@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.5, False), (0.0, False)])
async def test_one_peer_eager_overlap_is_the_blocking_round_bit_for_bit(momentum, nesterov):
    eager_models, eager = await run(1, eager=True, delay=2, momentum=momentum, nesterov=nesterov)
    block_models, block = await run(1, eager=False, delay=0, momentum=momentum, nesterov=nesterov)
    assert eager[0].rounds == block[0].rounds > 0
    for n in eager[0].outer_params:
        assert torch.equal(eager[0].outer_params[n], block[0].outer_params[n]), n
    for p, q in zip(eager_models[0].parameters(), block_models[0].parameters(), strict=True):
        assert torch.equal(p, q)


async def test_peers_with_equal_pseudo_gradients_eager_is_the_blocking_round():
    eager_models, eager = await run(2, eager=True, delay=1, same_data=True)
    block_models, block = await run(2, eager=False, delay=0, same_data=True)
    for i in range(2):
        for n in eager[i].outer_params:
            assert torch.equal(eager[i].outer_params[n], block[i].outer_params[n]), n
        for p, q in zip(eager_models[i].parameters(), block_models[i].parameters(), strict=True):
            assert torch.equal(p, q)


async def test_correction_keeps_exactly_the_local_progress_of_the_overlapped_steps():
    """Two peers, one weight per fragment, lossless: at the merge θ − φ_new = θ − φ̃ (the τ
    steps' local progress), with φ̃ the tentative step on the local Δ."""
    swarm = LocalSwarm(2)
    models = [TwoBlocks(), TwoBlocks()]
    outers = [
        StreamingDiLoCo(
            m,
            None,
            swarm.member(i),
            H=4,
            fragments=2,
            delay=1,
            alpha=0.0,
            codec="none",
            lr=0.5,
            momentum=0.5,
            eager=True,
        )
        for i, m in enumerate(models)
    ]
    async with outers[0], outers[1]:
        for m, w in zip(models, ((0.9, 0.8), (0.8, 0.9)), strict=True):
            m.set(*w)
        for o in outers:  # step 1: nothing due
            await o.astep()
        for m, w in zip(models, ((0.7, 0.6), (0.6, 0.4)), strict=True):
            m.set(*w)
        async with trio.open_nursery() as nursery:  # step 2: fragment 1 sent, θ1 ← φ̃1
            for o in outers:
                nursery.start_soon(o.astep)
        tilde = [o._tentative["blocks.1.weight"].item() for o in outers]
        # φ̃ = 1 − lr·(Δ + μ·Δ) on a fresh momentum buffer, Δ = 1 − θ1
        assert tilde == pytest.approx([1 - 0.5 * 1.5 * 0.4, 1 - 0.5 * 1.5 * 0.6], abs=1e-6)
        assert [m.get()[1] for m in models] == pytest.approx(tilde, abs=1e-6)
        progress = (-0.05, 0.02)  # what the overlapped inner step did to fragment 1 on each peer
        for m, d in zip(models, progress, strict=True):
            m.set(m.get()[0], m.get()[1] + d)
        async with trio.open_nursery() as nursery:  # step 3: the average arrives, correction
            for o in outers:
                nursery.start_soon(o.astep)
        phi = outers[0].outer_params["blocks.1.weight"].item()
        assert phi == pytest.approx(1 - 0.5 * 1.5 * 0.5, abs=1e-6)  # the mean Δ = 0.5
        for m, d in zip(models, progress, strict=True):
            assert m.get()[1] - phi == pytest.approx(d, abs=1e-6)


async def test_eager_streaming_learns_and_keeps_peers_identical():
    models, outers = await run(3, eager=True, delay=1, steps=32)
    for o in outers[1:]:
        for n, phi in o.outer_params.items():
            assert torch.equal(phi, outers[0].outer_params[n])
    with outers[0].outer_weights():
        assert eval_loss(models[0]) < eval_loss(tiny()) - 0.3


def test_eager_needs_an_overlap():
    with pytest.raises(ValueError, match="delay"):
        StreamingDiLoCo(tiny(), None, LocalSwarm(1).member(0), H=8, fragments=2, delay=0, eager=True)
