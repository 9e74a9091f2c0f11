"""A user's own outer optimizer: docs/guide.md's `OuterSGD`, run as the guide's Python API block
writes it (`outer.py`, named by a spec, built by the spec's `from_spec`); and `OuterSGD` and
`OuterAdam` (tests/proc_trainer.py) on a real multi-peer swarm: in-process trio hosts on loopback,
every peer training in its own worker thread."""

from __future__ import annotations

import copy
import re
from contextlib import AsyncExitStack

import torch
import trio

from meshtrain.collective import AllReduceConfig, LocalSwarm
from meshtrain.node.spec.outer import build_outer
from meshtrain.node.spec.swarm import parse_spec

from .conftest import ROOT
from .proc_trainer import OuterAdam, OuterSGD
from .test_allreduce import mesh
from .test_outer_diloco import backward, eval_loss, tiny


def the_guides_outer_py() -> str:
    """The class of docs/guide.md's Python API block — its `outer.py, on every peer` — as that file."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "guide.md").read_text(), re.S)
    block = next(b for b in blocks if "class OuterSGD(meshtrain.OuterOptimizer)" in b)
    return "import meshtrain\n\n\n" + block[block.index("class OuterSGD") : block.index("\nspec = ")]


async def test_the_guides_outer_optimizer_is_built_from_the_spec_and_at_lr_1_is_fedavg(tmp_path):
    """What the guide says of it: a spec names it (`py:outer.py:OuterSGD`), `from_spec` reads the
    spec's H and outer_lr (its `swarm create ... --outer-lr 0.8`), and `apply` gets the peers' mean
    of φ − θ: at lr 1 a round leaves every peer at the mean of their weights (FedAvg)."""
    (tmp_path / "outer.py").write_text(the_guides_outer_py())
    given = {"model": "gpt-tiny", "optimizer": f"py:{tmp_path / 'outer.py'}:OuterSGD", "H": 2}
    model = tiny()
    assert build_outer(parse_spec({**given, "outer_lr": 0.8}), model, None, LocalSwarm(1).member(0)).lr == 0.8
    spec, swarm = parse_spec({**given, "outer_lr": 1.0}), LocalSwarm(3)
    models = [tiny() for _ in range(3)]
    inners = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    outers = [build_outer(spec, m, None, swarm.member(i)) for i, m in enumerate(models)]
    assert [(type(o).__name__, o.H, o.lr) for o in outers] == [("OuterSGD", 2, 1.0)] * 3
    for step in range(2):
        for i, m in enumerate(models):
            backward(m, i, step)
            inners[i].step()
        local = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
        async with trio.open_nursery() as nursery:
            for o in outers:
                nursery.start_soon(o.astep)
    assert outers[0].rounds == 1
    for n, p in models[1].named_parameters():
        torch.testing.assert_close(p.detach(), torch.stack([loc[n] for loc in local]).mean(0), atol=1e-6, rtol=0)


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
