"""Streaming DiLoCo: strided fragments, the offset schedule, the overlapped exchange and its
α-merge against a hand computation, 4-bit outer gradients, peak bytes ≈ total/P, and training."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from meshtrain.collective import LocalSwarm
from meshtrain.models import GPT, GPTConfig
from meshtrain.optim import DiLoCo, OuterStateError, StreamingDiLoCo, strided_fragments
from meshtrain.optim.outer import StaleStateError

from .test_outer_diloco import CORPUS, backward, eval_loss, simulate, tiny


class TwoBlocks(torch.nn.Module):
    """Two one-weight "transformer blocks": fragment p holds exactly blocks.p.weight."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(2))
        for b in self.blocks:
            torch.nn.init.constant_(b.weight, 1.0)

    def set(self, w0: float, w1: float) -> None:
        with torch.no_grad():
            self.blocks[0].weight.fill_(w0)
            self.blocks[1].weight.fill_(w1)

    def get(self) -> tuple[float, float]:
        return self.blocks[0].weight.item(), self.blocks[1].weight.item()


def test_fragments_are_strided_blocks_and_partition_the_model():
    model = GPT(GPTConfig.small(CORPUS.vocab_size))
    frags = strided_fragments(model, 2)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for f in frags for n in f) == sorted(names)
    blocks = [{int(n.split(".")[1]) for n in f if n.startswith("blocks.")} for f in frags]
    assert blocks == [{0, 2}, {1, 3}]
    sizes = [sum(dict(model.named_parameters())[n].numel() for n in f) for f in frags]
    assert max(sizes) / min(sizes) < 1.15  # embeddings and the final norm balance the two
    # Without `block_groups`, numbered containers are found from the names.
    assert strided_fragments(TwoBlocks(), 2) == [["blocks.0.weight"], ["blocks.1.weight"]]


def test_schedule_requirements_are_checked_with_clear_errors():
    c = LocalSwarm(1).member(0)
    with pytest.raises(ValueError, match="H % P"):
        StreamingDiLoCo(tiny(), None, c, H=9, fragments=2)
    with pytest.raises(ValueError, match="τ < H/P"):
        StreamingDiLoCo(tiny(), None, c, H=8, fragments=2, delay=4)
    with pytest.raises(ValueError, match="alpha"):
        StreamingDiLoCo(tiny(), None, c, H=8, fragments=2, alpha=1.5)
    with pytest.raises(ValueError, match="blocks"):
        StreamingDiLoCo(tiny(), None, c, H=9, fragments=3)  # the tiny GPT has 2 blocks
    with pytest.raises(ValueError, match="partition"):
        DiLoCo(TwoBlocks(), None, c, H=2, fragments=[["blocks.0.weight"]])


async def test_overlapped_merge_matches_hand_computation():
    """H=4, P=2, τ=1, α=0.5, one peer, Nesterov (lr 0.5, μ 0.5), lossless. Fragment p is sent at
    steps s ≡ p·H/P (mod H) — fragment 1 at 2, 6; fragment 0 at 4 — and merged at s + 1:
    b ← μb + Δ; φ ← φ − lr(Δ + μb); θ ← αθ + (1−α)φ. Worked by hand from φ = (1, 1):
      step 2  θ=(.7,.6)    send f1: Δ1 = 1 − .6 = .4
      step 3  θ=(.5,.45)   merge f1: b1 = .4, φ1 = 1 − .5(.4+.2) = .7, θ1 = .5·.45 + .5·.7 = .575
      step 4  θ=(.4,.3)    send f0: Δ0 = 1 − .4 = .6
      step 5  θ=(.35,.25)  merge f0: b0 = .6, φ0 = 1 − .5(.6+.3) = .55, θ0 = .5·.35 + .5·.55 = .45
      step 6  θ=(.3,.2)    send f1: Δ1 = .7 − .2 = .5
      step 7  θ=(.25,.15)  merge f1: b1 = .2+.5 = .7, φ1 = .7 − .5(.5+.35) = .275, θ1 = .075+.1375 = .2125
    """
    model = TwoBlocks()
    outer = StreamingDiLoCo(
        model, None, LocalSwarm(1).member(0), H=4, fragments=2, delay=1, alpha=0.5, codec="none", lr=0.5, momentum=0.5
    )
    inner = {
        1: (0.9, 0.8),
        2: (0.7, 0.6),
        3: (0.5, 0.45),
        4: (0.4, 0.3),
        5: (0.35, 0.25),
        6: (0.3, 0.2),
        7: (0.25, 0.15),
    }
    expect_theta = {
        1: (0.9, 0.8),
        2: (0.7, 0.6),
        3: (0.5, 0.575),
        4: (0.4, 0.3),
        5: (0.45, 0.25),
        6: (0.3, 0.2),
        7: (0.25, 0.2125),
    }
    expect_phi = {1: (1, 1), 2: (1, 1), 3: (1, 0.7), 4: (1, 0.7), 5: (0.55, 0.7), 6: (0.55, 0.7), 7: (0.55, 0.275)}
    async with outer:
        for step in range(1, 8):
            model.set(*inner[step])  # what the inner optimizer did
            await outer.astep()
            assert model.get() == pytest.approx(expect_theta[step], abs=1e-6), step
            phi = tuple(outer.outer_params[f"blocks.{p}.weight"].item() for p in (0, 1))
            assert phi == pytest.approx(expect_phi[step], abs=1e-6), step
            assert outer.in_flight == (step in (2, 4, 6))
    assert [(r.step, r.fragment) for r in outer.history] == [(2, 1), (4, 0), (6, 1)]


async def test_exchange_overlaps_inner_steps_and_only_the_merge_step_waits():
    class SlowCollective:
        """A LocalCollective whose all-reduce takes 0.3 s, like a slow link."""

        def __init__(self, inner):
            self.inner, self.peer_id = inner, inner.peer_id

        def group(self, r):
            return self.inner.group(r)

        async def all_reduce(self, request):
            await trio.sleep(0.3)  # sleep: a slow link's 0.3 s all-reduce (the delay is what is tested)
            return await self.inner.all_reduce(request)

    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = StreamingDiLoCo(model, opt, SlowCollective(LocalSwarm(1).member(0)), H=4, fragments=2, delay=1)

    def train(log: list) -> None:
        for step in range(4):
            backward(model, 0, step)
            t = time.monotonic()
            reports = outer.step()
            log.append((step + 1, time.monotonic() - t, [r.fragment for r in reports], outer.in_flight))

    log: list = []
    async with outer:
        await trio.to_thread.run_sync(train, log)
        with pytest.raises(OuterStateError, match="in flight"):
            outer.state_dict()  # fragment 0 is still being exchanged
    # Step 2 sends fragment 1 and returns at once (exchange in flight); step 3 merges it, having
    # waited for the rest of the 0.3 s; step 4 sends fragment 0.
    step2, step3, step4 = log[1], log[2], log[3]
    assert step2[1] < 0.15 and step2[3] and step2[2] == []
    assert step3[2] == [1] and step3[1] > 0.1
    assert step4[1] < 0.15 and step4[3]


async def test_overlap_needs_the_async_context():
    model = TwoBlocks()
    outer = StreamingDiLoCo(model, None, LocalSwarm(1).member(0), H=4, fragments=2, delay=1)
    await outer.astep()
    with pytest.raises(RuntimeError, match="async with"):
        await outer.astep()  # step 2 sends fragment 1 in the background


async def test_fp4_outer_gradients_cut_peak_bytes_by_p_and_keep_peers_identical():
    k = 2
    swarm = LocalSwarm(k)
    models = [GPT(GPTConfig.small(CORPUS.vocab_size)) for _ in range(k)]
    outers = [
        StreamingDiLoCo(m, torch.optim.AdamW(m.parameters(), lr=2e-3), swarm.member(i), H=4, fragments=2, delay=1)
        for i, m in enumerate(models)
    ]
    swarm2 = LocalSwarm(k)
    models2 = [GPT(GPTConfig.small(CORPUS.vocab_size)) for _ in range(k)]
    dilocos = [
        DiLoCo(m, torch.optim.AdamW(m.parameters(), lr=2e-3), swarm2.member(i), H=4) for i, m in enumerate(models2)
    ]
    async with outers[0], outers[1]:
        await simulate(outers, models, 9)
        await simulate(dilocos, models2, 8)
        await trio.sleep(0)  # sleep: a bare checkpoint (afinish below waits for the exchanges in flight)
        async with trio.open_nursery() as nursery:
            for o in outers:
                nursery.start_soon(o.afinish)
    ratio = dilocos[0].peak_bytes_per_sync / outers[0].peak_bytes_per_sync
    # 1/P of the model (±7% balance) at 4.5 bits instead of 32: 2 × 7.1 ≈ 14.
    assert ratio > 12
    for n in outers[0].outer_params:
        assert torch.equal(outers[0].outer_params[n], outers[1].outer_params[n])
    for a, b in zip(
        outers[0].outer_optimizer.state_dict()["state"].values(),
        outers[1].outer_optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


async def test_streaming_diloco_learns():
    k = 2
    swarm = LocalSwarm(k)
    models = [tiny() for _ in range(k)]
    outers = [
        StreamingDiLoCo(m, torch.optim.AdamW(m.parameters(), lr=3e-3), swarm.member(i), H=10, fragments=2, delay=1)
        for i, m in enumerate(models)
    ]
    before = eval_loss(models[0])
    async with outers[0], outers[1]:
        await simulate(outers, models, 60)
        async with trio.open_nursery() as nursery:
            for o in outers:
                nursery.start_soon(o.afinish)
    with outers[0].outer_weights():
        after = eval_loss(models[0])
    assert after < before - 0.3


async def test_a_joiner_whose_state_predates_an_exchange_in_flight_enters_before_it_and_takes_part():
    """The swarm counts a joiner in from its download on, so the exchange the swarm sends next
    waits for it; the swarm reports that send step but publishes no newer state while the
    exchange overlaps training. The joiner enters a step before the send and takes part (weight
    0) instead of refusing the state as a round old and leaving both sides waiting (CI: the
    daemon matrix's streaming case)."""
    swarm = LocalSwarm(2)
    models = [tiny() for _ in range(2)]
    outers = [StreamingDiLoCo(m, sgd_of(m), swarm.member(i), H=4, fragments=2, delay=1) for i, m in enumerate(models)]
    joiner_model = tiny(seed=5)
    async with outers[0], outers[1]:
        await simulate(outers, models, 5)  # sends at 2 and 4, merged at 3 and 5: nothing in flight
        state = outers[0].state_dict(inner=False)
        joiner = StreamingDiLoCo(joiner_model, sgd_of(joiner_model), swarm.add(), H=4, fragments=2, delay=1)
        assert state["inner_steps"] == 5 and outers[0].next_send_step(5) == 6
        await simulate(outers, models, 1, start=5)  # step 6 sends; the round waits for the joiner
        assert outers[0].in_flight
        joiner.join(state, at_step=6)  # what the swarm reports now
        assert joiner.inner_steps == 5
        async with joiner:
            await simulate([joiner], [joiner_model], 1, start=5)  # its step 6 joins the round
            await simulate([*outers, joiner], [*models, joiner_model], 1, start=6)  # step 7 merges
    assert [o.history[-1].contributors for o in (*outers, joiner)] == [2, 2, 2]  # weight 0
    for n in outers[0].outer_params:
        assert torch.equal(outers[0].outer_params[n], joiner.outer_params[n])
    # Blocking rounds (τ = 0) count the send step as they enter its exchange and publish no
    # newer state until it ends: a swarm at the send step is in that exchange, which a joiner
    # enters a step before it; a step past it, the state is a round old.
    diloco = DiLoCo(tiny(), None, LocalSwarm(1).member(0), H=4)
    fresh = DiLoCo(tiny(), None, LocalSwarm(1).member(0), H=4).state_dict(inner=False)
    assert diloco.entry_step(0, 4) == 3
    with pytest.raises(StaleStateError, match="cannot enter at step 5"):
        diloco.join(fresh, at_step=5)
    diloco.join(fresh, at_step=4)
    assert diloco.inner_steps == 3


def sgd_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05)


async def test_a_streaming_peer_that_skips_steps_weighs_each_fragment_by_the_share_it_trained():
    """pace "swarm" with Streaming DiLoCo (H 4, P 2, τ 1, lossless, lr 1, μ 0, α 0): peer 1 skips
    steps 1-3. Fragment 1, sent at step 2, trained 0 of its 2 steps: weight 0, peer 0's Δ alone;
    fragment 0, sent at step 4, 1 of 4: weight 1/4. Both peers hold the same φ throughout."""
    swarm = LocalSwarm(2)
    models = [TwoBlocks(), TwoBlocks()]
    outers = [
        StreamingDiLoCo(
            m, None, swarm.member(i), H=4, fragments=2, delay=1, alpha=0.0, codec="none", lr=1.0, momentum=0.0
        )
        for i, m in enumerate(models)
    ]
    theta = {0: (0.5, 0.6), 1: (0.9, 0.2)}  # what each peer's inner steps reached, from φ = (1, 1)

    async def peer(i: int) -> None:
        for step in range(1, 6):
            if i == 1 and step <= 3:
                await outers[i].askip()
            else:
                if step in (1, 4):
                    models[i].set(*theta[i])
                await outers[i].astep()

    async with AsyncExitStack() as stack:
        for o in outers:
            await stack.enter_async_context(o)
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(peer, i)
    phis = [tuple(o.outer_params[f"blocks.{p}.weight"].item() for p in (0, 1)) for o in outers]
    assert phis[0] == phis[1]
    # fragment 1 (merged at 3): peer 0's Δ = 1 − 0.6 alone; fragment 0 (merged at 5): (1·0.5 + 0.25·0.1) / 1.25
    assert phis[0] == pytest.approx((1 - (0.5 + 0.25 * 0.1) / 1.25, 0.6), abs=1e-6)
    assert outers[1].skipped_steps == 3 and [r.contributors for r in outers[0].history] == [1, 2]
