"""The Python API of docs/guide.md ("Python API"): two `Node`s in one trio program, one creating the swarm, one
joining it by address, both training with a user-written outer optimizer that the spec names
(`optimizer = "py:<file>:<Class>"`, its source pinned by digest); a hook that swaps the spec's
optimizer for another is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

import meshtrain
from meshtrain.errors import ConfigError
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.transport.identity import Identity

CUSTOM_OUTER = Path(__file__).with_name("custom_outer.py")


async def test_two_nodes_with_a_custom_outer_optimizer(tmp_path):
    spec = meshtrain.SwarmSpec(
        model="gpt-tiny", steps=40, H=10, eval_every=20, outer_lr=0.8, optimizer=f"py:{CUSTOM_OUTER}:OuterSGD"
    )
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))

    def config(name: str) -> meshtrain.NodeConfig:
        return meshtrain.NodeConfig(
            data_dir=tmp_path / name, listen=["/ip4/127.0.0.1/tcp/0"], status_port=0, wait_peers=2
        )

    a = meshtrain.Node(config("a"), spec=signed)
    results = {}
    async with trio.open_nursery() as nursery:

        async def run(name, node):
            results[name] = await node.run()

        nursery.start_soon(run, "a", a)
        with trio.fail_after(60):
            while a.view is None:
                await trio.sleep(0.05)  # sleep: poll interval
        b = meshtrain.Node(config("b"), join=a.host.addrs[0])
        nursery.start_soon(run, "b", b)
    assert all(isinstance(r, meshtrain.NodeResult) for r in results.values())  # exported, as Node.run's type
    assert results["a"].step == results["b"].step == 40 and results["a"].rounds == 4
    assert type(a.trainer.outer).__name__ == "OuterSGD" and a.trainer.outer.lr == 0.8
    assert signed.spec.outer.optimizer_digest and b.signed.spec == signed.spec
    assert [r.contributors for r in a.trainer.outer.history] == [2] * 4
    pa = CheckpointStore(tmp_path / "a" / "checkpoints").load_latest().state["outer"]["outer_params"]
    pb = CheckpointStore(tmp_path / "b" / "checkpoints").load_latest().state["outer"]["outer_params"]
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert results["a"].eval_loss is not None and results["a"].eval_loss < 5.0


async def test_a_hook_that_swaps_the_specs_optimizer_is_refused(tmp_path):
    spec = meshtrain.SwarmSpec(model="gpt-tiny", steps=10, H=5, eval_every=0, optimizer="diloco")
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))
    config = meshtrain.NodeConfig(data_dir=tmp_path / "a", listen=["/ip4/127.0.0.1/tcp/0"], status_port=0)

    def swapped(model, inner, collective):  # the spec says diloco; this peer would run NoLoCo
        return meshtrain.NoLoCo(model, inner, collective, H=spec.outer.H)

    with pytest.raises(ConfigError, match="spec says diloco, but this outer optimizer is a NoLoCo"):
        await meshtrain.Node(config, spec=signed, outer_factory=swapped).run()
