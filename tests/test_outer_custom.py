"""A user's own outer optimizer — docs/guide.md's `OuterSGD` and `OuterAdam` (tests/proc_trainer.py,
under 30 lines together) — on a real multi-peer swarm: in-process trio hosts on loopback, every
peer training in its own worker thread."""

from __future__ import annotations

import copy
import inspect
from contextlib import AsyncExitStack

import torch
import trio

from meshtrain.collective import AllReduceConfig, LocalSwarm

from .proc_trainer import OuterAdam, OuterSGD
from .test_allreduce import mesh
from .test_outer_diloco import backward, eval_loss, tiny


def test_the_readme_snippet_is_short():
    lines = [ln for cls in (OuterSGD, OuterAdam) for ln in inspect.getsource(cls).splitlines() if ln.strip()]
    assert len(lines) <= 30


async def train_on_hosts(make, steps: int, n: int = 3, lr: float = 0.1):
    """`make(model, collective)` builds the outer optimizer with inner=None: the loop steps the
    inner SGD itself, records θ, then calls `outer.step()` (the documented alternative)."""
    async with AsyncExitStack() as stack:
        peers, cols = await mesh(stack, n, AllReduceConfig(join_timeout=10))
        models = [tiny() for _ in peers]
        inners = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
        outers = [make(m, c) for m, c in zip(models, cols, strict=True)]
        snapshots: list[list[dict]] = [[] for _ in peers]

        def train(i: int) -> None:
            for step in range(steps):
                backward(models[i], i, step)
                inners[i].step()
                snapshots[i].append({k: p.detach().clone() for k, p in models[i].named_parameters()})
                outers[i].step()

        async with trio.open_nursery() as nursery:
            for i, o in enumerate(outers):

                async def run(i=i, o=o):
                    async with o:
                        await trio.to_thread.run_sync(train, i)

                nursery.start_soon(run)
        return models, outers, snapshots


async def test_outer_sgd_without_momentum_is_fedavg_on_real_hosts():
    models, outers, snaps = await train_on_hosts(lambda m, c: OuterSGD(m, None, c, H=2), steps=4)
    for n, p in models[0].named_parameters():
        mean = torch.stack([s[3][n] for s in snaps]).mean(0)  # local weights just before round 2
        torch.testing.assert_close(p.detach(), mean, atol=1e-6, rtol=0)
        assert torch.equal(p, dict(models[2].named_parameters())[n])
    assert [r.contributors for r in outers[1].history] == [3, 3]


async def test_outer_adam_trains_on_real_hosts_and_keeps_identical_state():
    models, outers, _ = await train_on_hosts(lambda m, c: OuterAdam(m, None, c, H=5, lr=3e-3), steps=40, lr=0.3)
    assert eval_loss(models[0]) < eval_loss(tiny()) - 0.3
    for n in outers[0].outer_params:
        assert torch.equal(outers[0].outer_params[n], outers[1].outer_params[n])
    s0, s1 = outers[0].state_dict(inner=False), outers[2].state_dict(inner=False)
    for a, b in zip(s0["outer_optimizer"]["state"].values(), s1["outer_optimizer"]["state"].values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    # ... and its Adam state is saved by the base class, bit-exactly.
    clone = OuterAdam(tiny(seed=4), None, LocalSwarm(1).member(0), H=5, lr=3e-3)
    clone.load_state_dict(copy.deepcopy(s0))
    again = clone.state_dict()
    for a, b in zip(s0["outer_optimizer"]["state"].values(), again["outer_optimizer"]["state"].values(), strict=True):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
