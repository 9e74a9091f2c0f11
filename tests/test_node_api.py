"""The Python API from the README: two `Node`s in one trio program, one creating the swarm, one
joining it by address, both training with a user-written outer optimizer (`outer_factory`)."""

from __future__ import annotations

import torch
import trio

import meshtrain
from meshtrain.node.checkpoint import CheckpointStore
from meshtrain.transport.identity import Identity


class OuterSGD(meshtrain.OuterOptimizer):
    """Outer SGD without momentum (the README's example)."""

    def __init__(self, model, inner, collective, *, H, lr=1.0):
        super().__init__(model, inner, collective, H=H)
        self.lr = lr

    def apply(self, result, names):
        for n in names:
            self.outer_params[n].sub_(result.tensors[n], alpha=self.lr)


async def test_two_nodes_with_a_custom_outer_optimizer(tmp_path):
    spec = meshtrain.SwarmSpec(model="gpt-tiny", steps=40, H=10, eval_every=20)
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))

    def config(name: str) -> meshtrain.NodeConfig:
        return meshtrain.NodeConfig(data_dir=tmp_path / name, listen=["/ip4/127.0.0.1/tcp/0"], status_port=0,
                                    wait_peers=2)

    def outer(model, inner, collective):
        return OuterSGD(model, inner, collective, H=spec.H, lr=0.8)

    a = meshtrain.Node(config("a"), spec=signed, outer_factory=outer)
    results = {}
    async with trio.open_nursery() as nursery:
        async def run(name, node):
            results[name] = await node.run()

        nursery.start_soon(run, "a", a)
        with trio.fail_after(60):
            while a.view is None:
                await trio.sleep(0.05)
        b = meshtrain.Node(config("b"), join=a.host.addrs[0], outer_factory=outer)
        nursery.start_soon(run, "b", b)
    assert results["a"].step == results["b"].step == 40 and results["a"].rounds == 4
    assert isinstance(a.trainer.outer, OuterSGD) and [r.contributors for r in a.trainer.outer.history] == [2] * 4
    pa = CheckpointStore(tmp_path / "a" / "checkpoints").load_latest().state["outer"]["outer_params"]
    pb = CheckpointStore(tmp_path / "b" / "checkpoints").load_latest().state["outer"]["outer_params"]
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert results["a"].eval_loss is not None and results["a"].eval_loss < 5.0
