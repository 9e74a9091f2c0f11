"""DiLoCo and the OuterOptimizer base: docs/algorithms.md's identities, a hand-computed outer step,
failures and joiners in a simulated swarm, state round trips, and training on real hosts with
torch in worker threads."""

from __future__ import annotations

import copy
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from meshtrain.collective import AllReduceConfig, LocalSwarm
from meshtrain.models import GPT, Corpus, GPTConfig
from meshtrain.optim import (
    DataParallel,
    DiLoCo,
    OuterStateError,
)
from meshtrain.optim.outer import JOIN_WARMUP_STEPS

from .test_allreduce import mesh

CORPUS = Corpus.default()


def tiny(seed: int = 0) -> GPT:
    return GPT(GPTConfig.tiny(CORPUS.vocab_size), seed=seed)


def sgd(model: torch.nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


def backward(model: torch.nn.Module, worker: int, step: int) -> float:
    x, y = CORPUS.batch(8, 16, seed=0, peer=worker, step=step)
    loss = model(x, y).loss
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.item()


async def simulate(outers, models, steps: int, *, start: int = 0) -> None:
    """All workers do one inner step, then their outer bookkeeping, concurrently (a round needs
    everyone to call in)."""
    for step in range(start, start + steps):
        async with trio.open_nursery() as nursery:
            for i, (o, m) in enumerate(zip(outers, models, strict=True)):

                async def one(i=i, o=o, m=m, step=step):
                    backward(m, i, step)
                    await o.astep()

                nursery.start_soon(one)


def workers(k: int, make, *, inner=sgd, timeout: float | None = None):
    swarm = LocalSwarm(k, timeout=timeout)
    models = [tiny() for _ in range(k)]
    outers = [make(m, inner(m), swarm.member(i)) for i, m in enumerate(models)]
    return swarm, models, outers


def eval_loss(model: torch.nn.Module) -> float:
    return model.evaluate(CORPUS.eval_batches(4, 16, 16))


async def test_one_peer_outer_sgd_lr1_momentum0_is_plain_training():
    _, models, outers = workers(1, lambda m, o, c: DiLoCo(m, o, c, H=4, lr=1.0, momentum=0.0))
    await simulate(outers, models, 12)
    plain = tiny()
    opt = sgd(plain)
    for step in range(12):
        backward(plain, 0, step)
        opt.step()
    for p, q in zip(models[0].parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


async def test_inner_sgd_h1_outer_lr1_is_synchronous_data_parallel():
    k = 3
    _, models, outers = workers(k, lambda m, o, c: DiLoCo(m, o, c, H=1, lr=1.0, momentum=0.0))
    await simulate(outers, models, 5)
    _, dp_models, dps = workers(k, lambda m, o, c: DataParallel(m, o, c))
    await simulate(dps, dp_models, 5)
    for p, q in zip(models[0].parameters(), dp_models[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    for p, q in zip(dp_models[0].parameters(), dp_models[2].parameters(), strict=True):
        assert torch.equal(p, q)


async def test_outer_sgd_lr1_at_any_h_is_fedavg():
    """Outer (lr 1, momentum 0): after a round every peer holds the mean of the local weights."""
    k = 3
    swarm = LocalSwarm(k)
    models = [tiny() for _ in range(k)]
    inners = [sgd(m) for m in models]
    outers = [DiLoCo(m, None, swarm.member(i), H=3, lr=1.0, momentum=0.0) for i, m in enumerate(models)]
    for step in range(3):
        for i in range(k):
            backward(models[i], i, step)
            inners[i].step()
        local = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
        async with trio.open_nursery() as nursery:
            for o in outers:
                nursery.start_soon(o.astep)
    for n, p in models[1].named_parameters():
        torch.testing.assert_close(p, torch.stack([loc[n] for loc in local]).mean(0), atol=1e-6, rtol=0)


async def test_nesterov_outer_step_matches_hand_computation():
    """docs/algorithms.md: b ← μb + Δ; φ ← φ − lr(Δ + μb); θ ← φ — two rounds, one parameter."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    outer = DiLoCo(model, None, LocalSwarm(1).member(0), H=1, lr=0.7, momentum=0.9)
    phi, b = 1.0, 0.0
    for local in (0.8, 0.5):
        with torch.no_grad():
            model.weight.fill_(local)
        await outer.astep()
        delta = phi - local
        b = 0.9 * b + delta
        phi = phi - 0.7 * (delta + 0.9 * b)
        assert model.weight.item() == pytest.approx(phi, abs=1e-6)
        assert outer.outer_params["weight"].item() == pytest.approx(phi, abs=1e-6)


async def test_a_step_that_runs_a_round_drops_the_spent_gradients_before_it():
    """optim/outer.py, "Memory": after the inner step of a step that runs a round the gradients are
    None before the round's Δ is taken (they would be held beside the round's buffers); on the
    other steps they stay as the loop left them. Training is unchanged: `zero_grad()` and the
    next backward make new ones."""
    swarm = LocalSwarm(1)
    model = tiny()
    seen: list[bool] = []

    class Watching(DiLoCo):
        def pseudo_gradient(self, names):
            seen.append(all(p.grad is None for p in self.model.parameters()))
            return super().pseudo_gradient(names)

    outer = Watching(model, sgd(model), swarm.member(0), H=3)
    kept = []
    for step in range(6):
        backward(model, 0, step)
        await outer.astep()
        kept.append(all(p.grad is not None for p in model.parameters()))
    assert seen == [True, True]  # rounds at steps 3 and 6
    assert kept == [True, True, False, True, True, False]


def scalar_peers(**outer: float) -> tuple[list[torch.nn.Linear], list[DiLoCo]]:
    """Two peers of a one-weight model (φ = θ = 2, no inner optimizer) and their DiLoCo (`outer`)."""
    swarm = LocalSwarm(2)
    models = [torch.nn.Linear(1, 1, bias=False) for _ in range(2)]
    for m in models:
        with torch.no_grad():
            m.weight.fill_(2.0)
    return models, [DiLoCo(m, None, swarm.member(i), **outer) for i, m in enumerate(models)]  # type: ignore[arg-type]


async def test_two_peers_average_pseudo_gradients_then_step():
    """Δ = mean_i(φ − θ_i) over the peers, then the same Nesterov step on every peer."""
    models, outers = scalar_peers(H=1, lr=0.5, momentum=0.5)
    with torch.no_grad():
        models[0].weight.fill_(1.0)  # Δ_0 = 1
        models[1].weight.fill_(1.5)  # Δ_1 = 0.5
    async with trio.open_nursery() as nursery:
        for o in outers:
            nursery.start_soon(o.astep)
    delta = 0.75
    b = delta
    expected = 2.0 - 0.5 * (delta + 0.5 * b)
    for m in models:
        assert m.weight.item() == pytest.approx(expected, abs=1e-7)


async def test_round_that_loses_a_peer_averages_over_survivors():
    swarm = LocalSwarm(3)
    models = [tiny() for _ in range(3)]
    inners = [sgd(m) for m in models]
    outers = [DiLoCo(m, None, swarm.member(i), H=1, lr=1.0, momentum=0.0) for i, m in enumerate(models)]
    for i in range(3):
        backward(models[i], i, 0)
        inners[i].step()
    local = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
    swarm.kill(swarm.members[2])  # dies before calling in
    reports = [None, None]
    async with trio.open_nursery() as nursery:
        for i in range(2):

            async def one(i=i):
                reports[i] = await outers[i].astep()

            nursery.start_soon(one)
    assert reports[0][0].contributors == reports[1][0].contributors == 2
    for n, p in models[0].named_parameters():  # FedAvg of the two survivors
        torch.testing.assert_close(p, (local[0][n] + local[1][n]) / 2, atol=1e-6, rtol=0)
        assert torch.equal(p, dict(models[1].named_parameters())[n])


async def test_joiner_contributes_weight_zero_and_gets_identical_outer_state():
    swarm, models, outers = workers(
        2, lambda m, o, c: DiLoCo(m, o, c, H=3), inner=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)
    )
    await simulate(outers, models, 4)  # one round done, one step into the next
    state = outers[0].state_dict(inner=False)
    joiner_model = tiny(seed=5)
    joiner = DiLoCo(joiner_model, torch.optim.AdamW(joiner_model.parameters(), lr=1e-3), swarm.add(), H=3)
    joiner.join(state)
    assert joiner.inner_steps == 4
    for n, p in joiner_model.named_parameters():
        assert torch.equal(p, outers[0].outer_params[n])
    await simulate([*outers, joiner], [*models, joiner_model], 2, start=4)  # step 6: a round
    reports = [o.history[-1] for o in (*outers, joiner)]
    assert [r.contributors for r in reports] == [2, 2, 2]  # the joiner had weight 0
    for n in outers[0].outer_params:
        assert torch.equal(outers[0].outer_params[n], joiner.outer_params[n])
    for a, b in zip(
        outers[0].outer_optimizer.state_dict()["state"].values(),
        joiner.outer_optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    await simulate([*outers, joiner], [*models, joiner_model], 3, start=6)  # a full H of its own...
    assert joiner.history[-1].contributors == 2  # ...but its fresh AdamW is still warming up
    await simulate([*outers, joiner], [*models, joiner_model], 15, start=9)  # step 24: 20 steps of its own
    assert JOIN_WARMUP_STEPS == 20 and [r.contributors for r in joiner.history][-2:] == [2, 3]


async def test_peer_cut_off_proceeds_alone_and_asks_for_resync():
    swarm, models, outers = workers(2, lambda m, o, c: DiLoCo(m, o, c, H=2), timeout=0.2)
    await simulate(outers, models, 2)
    # Peer 1 is slow: the round completes without it, and it arrives late.
    backward(models[0], 0, 2)
    await outers[0].astep()
    backward(models[0], 0, 3)
    await outers[0].astep()
    assert outers[0].history[-1].contributors == 1 and not outers[0].needs_resync
    for step in (2, 3):
        backward(models[1], 1, step)
        reports = await outers[1].astep()
    assert reports[0].error and outers[1].needs_resync and outers[1].history[-1].contributors == 1


async def test_state_round_trips_bit_exactly():
    _, models, outers = workers(
        2, lambda m, o, c: DiLoCo(m, o, c, H=4), inner=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)
    )
    await simulate(outers, models, 9)
    state = outers[0].state_dict()
    fresh_model = tiny(seed=9)
    fresh = DiLoCo(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-3), LocalSwarm(1).member(0), H=4)
    fresh.load_state_dict(copy.deepcopy(state))
    again = fresh.state_dict()
    assert again["inner_steps"] == 9 and again["rounds"] == 2
    for n in state["outer_params"]:
        assert torch.equal(state["outer_params"][n], again["outer_params"][n])
    for k, v in state["outer_optimizer"]["state"].items():
        assert torch.equal(v["momentum_buffer"], again["outer_optimizer"]["state"][k]["momentum_buffer"])
    for k, v in state["inner"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(v[name], again["inner"]["state"][k][name])
    # The restored optimizer continues exactly as the original does (same weights, same data).
    fresh_model.load_state_dict(models[0].state_dict())
    outers[0].collective = LocalSwarm(1).member(0)
    fresh.collective = LocalSwarm(1).member(0)
    await simulate([outers[0]], [models[0]], 4, start=9)
    await simulate([fresh], [fresh_model], 4, start=9)
    for a, b in zip(outers[0].outer_params.values(), fresh.outer_params.values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(models[0].parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_from_another_algorithm_or_schedule_is_refused():
    m = tiny()
    a = DiLoCo(m, None, LocalSwarm(1).member(0), H=4)
    with pytest.raises(OuterStateError, match="different H"):
        DiLoCo(tiny(), None, LocalSwarm(1).member(0), H=5).load_state_dict(a.state_dict())
    with pytest.raises(OuterStateError):
        DiLoCo(tiny(), None, LocalSwarm(1).member(0), H=4).load_state_dict({"format": "x"})
    with pytest.raises(ValueError, match="H"):
        DiLoCo(m, None, LocalSwarm(1).member(0), H=0)


async def test_step_from_the_trio_thread_says_what_to_do():
    m = tiny()
    outer = DiLoCo(m, sgd(m), LocalSwarm(1).member(0), H=1)
    backward(m, 0, 0)
    with pytest.raises(RuntimeError, match="astep"):
        outer.step()


async def test_diloco_on_real_hosts_trains_in_worker_threads_with_identical_outer_state():
    """Three hosts on loopback; each peer's loop runs in its own worker thread and calls the
    blocking `outer.step()`, which hops onto trio for the all-reduce."""
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, 3, AllReduceConfig(join_timeout=10))
        models = [tiny() for _ in peers]
        outers = [
            DiLoCo(m, torch.optim.AdamW(m.parameters(), lr=3e-3), c, H=10) for m, c in zip(models, cols, strict=True)
        ]
        before = eval_loss(models[0])

        def train(i: int) -> None:
            for step in range(60):
                backward(models[i], i, step)
                outers[i].step()

        async with trio.open_nursery() as nursery:
            for i, o in enumerate(outers):

                async def run(i=i, o=o):
                    async with o:
                        await trio.to_thread.run_sync(train, i)

                nursery.start_soon(run)
        assert eval_loss(models[0]) < before - 0.3
        for n in outers[0].outer_params:
            assert torch.equal(outers[0].outer_params[n], outers[1].outer_params[n])
            assert torch.equal(outers[0].outer_params[n], outers[2].outer_params[n])
        assert outers[0].rounds == 6 and outers[0].bytes_sent > 0
        assert all(r.contributors == 3 for r in outers[1].history)


async def test_a_peer_that_skips_steps_to_keep_the_swarms_pace_weighs_the_share_it_trained():
    """pace "swarm" (optim/outer.py, "Swarm pace"): peer 1 skips 3 of a round's 4 steps — the
    round still runs at step 4 for both — and its Δ weighs 1/4 in the mean; the next round, all
    trained, weighs 1 again. φ stays identical on both."""
    models, outers = scalar_peers(H=4, lr=1.0, momentum=0.0)

    async def peer(i: int, skips: int, theta: float) -> None:
        with torch.no_grad():
            models[i].weight.fill_(theta)
        for s in range(4):
            await (outers[i].askip() if s < skips else outers[i].astep())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer, 0, 0, 1.0)  # Δ_0 = 1, weight 1
        nursery.start_soon(peer, 1, 3, 1.8)  # Δ_1 = 0.2, weight 1/4
    expected = 2.0 - (1.0 * 1.0 + 0.25 * 0.2) / 1.25
    for m, o in zip(models, outers, strict=True):
        assert m.weight.item() == pytest.approx(expected, abs=1e-6)
        assert o.inner_steps == 4 and o.rounds == 1
    assert outers[1].skipped_steps == 3 and outers[0].skipped_steps == 0
    assert outers[1].stats()["skipped_steps"] == 3
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer, 0, 0, expected - 0.4)  # Δ 0.4 and 0.2, both weight 1
        nursery.start_soon(peer, 1, 0, expected - 0.2)
    for m in models:
        assert m.weight.item() == pytest.approx(expected - 0.3, abs=1e-6)


async def test_blocked_on_names_what_the_training_thread_waits_on_and_for_how_long():
    """A node's status says what its trainer waits on (node/status/document.py): the round logic's
    call that blocks the training thread now — here a `before_state_change` hook held open, then
    nothing once it returns."""
    _, models, outers = workers(1, lambda m, o, c: DiLoCo(m, o, c, H=2))
    outer, model = outers[0], models[0]
    held = trio.Event()

    class Donor:  # a hook as the node's donor registers one: a bound method, named by its qualname
        async def reclaim(self) -> None:
            await held.wait()

    outer.before_state_change.append(Donor().reclaim)
    assert outer.blocked_on() is None

    def train() -> None:
        for step in range(2):
            backward(model, 0, step)
            outer.step()

    async with outer, trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, train)
        while (blocked := outer.blocked_on()) is None or "reclaim" not in blocked[0]:
            await trio.sleep(0.01)  # sleep: the training thread reaches the round
        assert blocked[0].endswith("Donor.reclaim") and blocked[1] >= 0
        await trio.sleep(0.05)  # sleep: time passes while it waits
        later = outer.blocked_on()
        assert later is not None and later[0] == blocked[0] and later[1] >= blocked[1] + 0.04
        held.set()
    assert outer.blocked_on() is None and outer.rounds == 1
