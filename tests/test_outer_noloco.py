"""NoLoCo: the pairing every peer computes alone, the update against a hand computation, the
identity with heavy-ball DiLoCo when the group is everyone, a partner that is gone, and training."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import trio

from meshtrain.collective import LocalSwarm
from meshtrain.optim import DiLoCo, NoLoCo, noloco_groups, noloco_partner

from .test_outer_diloco import eval_loss, sgd, simulate, tiny


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13])
def test_pairing_is_a_valid_matching_that_every_peer_computes_alike(n):
    peers = [f"peer-{i:02d}-{'xyz'[i % 3]}" for i in range(n)]
    for step in range(50, 2050, 50):
        groups = noloco_groups(step, peers)
        members = [p for g in groups for p in g]
        assert sorted(members) == sorted(peers)  # everyone exactly once
        assert [len(g) for g in groups].count(1) == n % 2 and all(len(g) in (1, 2) for g in groups)
        shuffled = list(reversed(peers))
        assert noloco_groups(step, shuffled) == groups  # input order does not matter
        for p in peers:  # each peer's own view agrees with the matching
            partner = noloco_partner(step, shuffled, p)
            assert (partner is None and (p,) in groups) or tuple(sorted((p, partner))) in groups
            if partner is not None:
                assert noloco_partner(step, peers, partner) == p


def test_pairing_follows_the_reference_permutation():
    """gensyn-ai/noloco: perm = default_rng(step + 1).permutation(N); group j = perm[i], i ≡ j (mod N/2)."""
    peers = [f"p{i}" for i in range(6)]
    step = 150
    perm = np.random.default_rng(step + 1).permutation(6)
    expected = sorted(tuple(sorted((peers[perm[j]], peers[perm[j + 3]]))) for j in range(3))
    assert sorted(noloco_groups(step, peers)) == expected
    assert len({tuple(noloco_groups(s, peers)) for s in range(50, 1000, 50)}) > 5  # partners change


async def test_update_matches_hand_computation():
    """Two peers, one weight, μ 0.5, β 0.7, γ 0.3, two rounds (H=1):
    δ ← μδ + β·mean(θ−φ) + γ·(mean φ − φ);  φ ← φ + δ;  θ ← φ."""
    swarm = LocalSwarm(2)
    models = [torch.nn.Linear(1, 1, bias=False) for _ in range(2)]
    for m, w in zip(models, (1.0, 2.0), strict=True):
        with torch.no_grad():
            m.weight.fill_(w)
    outers = [NoLoCo(m, None, swarm.member(i), H=1, lr=0.7, gamma=0.3, momentum=0.5) for i, m in enumerate(models)]
    mu, beta, gamma = 0.5, 0.7, 0.3
    phi, d = [1.0, 2.0], [0.0, 0.0]
    for theta in ((0.8, 2.4), (0.5, 1.9)):
        for m, t in zip(models, theta, strict=True):
            with torch.no_grad():
                m.weight.fill_(t)
        async with trio.open_nursery() as nursery:
            for o in outers:
                nursery.start_soon(o.astep)
        mean_prog = ((theta[0] - phi[0]) + (theta[1] - phi[1])) / 2
        mean_phi = (phi[0] + phi[1]) / 2
        for i in range(2):
            d[i] = mu * d[i] + beta * mean_prog + gamma * (mean_phi - phi[i])
        phi = [phi[0] + d[0], phi[1] + d[1]]
        for i in range(2):
            assert models[i].weight.item() == pytest.approx(phi[i], abs=1e-6)
            assert outers[i].velocity["weight"].item() == pytest.approx(d[i], abs=1e-6)
    assert [r.contributors for o in outers for r in o.history] == [2, 2, 2, 2]


async def test_group_of_everyone_equals_heavy_ball_diloco():
    """docs/algorithms.md: with g = N the γ term vanishes and NoLoCo is heavy-ball DiLoCo (lr β, μ)."""
    k = 4
    swarm_a, swarm_b = LocalSwarm(k), LocalSwarm(k)
    models_a = [tiny() for _ in range(k)]
    models_b = [copy.deepcopy(m) for m in models_a]
    noloco = [
        NoLoCo(m, sgd(m), swarm_a.member(i), H=3, lr=0.7, gamma=0.7, momentum=0.5, group="all")
        for i, m in enumerate(models_a)
    ]
    diloco = [
        DiLoCo(m, sgd(m), swarm_b.member(i), H=3, lr=0.7, momentum=0.5, nesterov=False) for i, m in enumerate(models_b)
    ]
    await simulate(noloco, models_a, 12)
    await simulate(diloco, models_b, 12)
    for a, b in zip(models_a[0].parameters(), models_b[0].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(models_a[0].parameters(), models_a[3].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)  # replicas stay together


async def test_partner_gone_means_proceeding_alone_without_a_barrier():
    k = 4
    swarm = LocalSwarm(k, timeout=30)
    ids = list(swarm.members)
    models = [torch.nn.Linear(3, 1, bias=False) for _ in range(k)]
    outers = [NoLoCo(m, None, swarm.member(i), H=1) for i, m in enumerate(models)]
    # Everyone keeps the stale view that includes the victim, as between membership snapshots.
    for o in outers:
        o.collective.group = lambda r: tuple(ids)

    async def round_(who, step):
        for i in who:
            with torch.no_grad():
                models[i].weight.add_(0.1 * (i + 1) * step)  # "inner training"
        async with trio.open_nursery() as nursery:
            for i in who:
                nursery.start_soon(outers[i].astep)

    await round_(range(k), 1)
    assert all(o.history[-1].contributors == 2 for o in outers)
    victim = ids.index(noloco_partner(2, ids, ids[0]))
    swarm.kill(ids[victim])
    live = [i for i in range(k) if i != victim]
    phi0 = outers[0].outer_params["weight"].clone()
    d0 = outers[0].velocity["weight"].clone()
    theta0 = models[0].weight.detach() + 0.1 * 2  # what round_ will set
    with trio.fail_after(2):  # nobody waits out a deadline: the partner is known to be gone
        await round_(live, 2)
    assert outers[0].history[-1].contributors == 1
    assert [outers[i].history[-1].contributors for i in live if i != 0] == [2, 2]
    # Alone: δ ← μδ + β(θ − φ) (+ γ·0); φ ← φ + δ; θ ← φ.
    expected = phi0 + (0.5 * d0 + 0.7 * (theta0 - phi0))
    torch.testing.assert_close(models[0].weight.detach(), expected, atol=1e-6, rtol=0)


async def test_state_round_trips_with_the_velocity():
    swarm = LocalSwarm(2)
    models = [tiny() for _ in range(2)]
    outers = [NoLoCo(m, sgd(m), swarm.member(i), H=2) for i, m in enumerate(models)]
    await simulate(outers, models, 4)
    state = outers[1].state_dict()
    other = NoLoCo(tiny(seed=3), None, LocalSwarm(1).member(0), H=2)
    other.load_state_dict(copy.deepcopy(state))
    for n in outers[1].velocity:
        assert torch.equal(other.velocity[n], outers[1].velocity[n])
        assert torch.equal(other.outer_params[n], outers[1].outer_params[n])
    assert other.state_dict(inner=False)["buffers"]["velocity"].keys() == state["buffers"]["velocity"].keys()


async def test_noloco_learns():
    k = 4
    swarm = LocalSwarm(k)
    models = [tiny() for _ in range(k)]
    outers = [
        NoLoCo(m, torch.optim.AdamW(m.parameters(), lr=3e-3), swarm.member(i), H=10) for i, m in enumerate(models)
    ]
    before = eval_loss(models[0])
    await simulate(outers, models, 60)
    assert eval_loss(models[0]) < before - 0.3
