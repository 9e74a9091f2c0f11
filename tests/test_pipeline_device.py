"""Pipeline stages on a device: a stage takes its device as a parameter (the CPU here, CUDA behind
the `cuda` marker: one code path), computes under bf16 autocast on fp32 master weights, and its
hops leave the device as bf16 host tensors at the hop codec and arrive back on it; a bf16
pipeline of real peers learns."""

from __future__ import annotations

import math
from contextlib import AsyncExitStack

import pytest
import torch

import meshtrain
from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT
from meshtrain.pipeline.hop_codec import HopCodec
from meshtrain.pipeline.runtime import PipelineRuntime
from meshtrain.pipeline.stages import StageReplica, reference_gradients
from meshtrain.transport.identity import Identity

from .conftest import start_peers
from .test_devices import NO_CUDA
from .test_pipeline_runtime import CONFIG, HOP_SHAPE, batch, iterate, make_run

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]),
]


def bf16_stages(device: torch.device, n_stages: int = 3) -> list[StageReplica]:
    return [
        StageReplica(GPT(CONFIG, seed=3), n_stages, s, device=device, compute_dtype=torch.bfloat16)
        for s in range(n_stages)
    ]


@pytest.mark.parametrize("name", DEVICES)
def test_a_stage_runs_under_bf16_autocast_on_the_device_it_is_given(name):
    """Three stages of one GPT, each given the device and bf16: the stage's weights (fp32 masters),
    tapes, gradients and AdamW state are on the device and the rest of its model stays on the host;
    the matmuls run in bf16; the staged loss and gradients are the fp32 model's within bf16's
    rounding; the stage's state comes back as host tensors."""
    device = torch.device(name)
    replicas = bf16_stages(device)
    seen: list[torch.dtype] = []
    replicas[1].stage.module[0].mlp.fc.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    batches = [batch(0, mb) for mb in range(2)]
    want = reference_gradients(GPT(CONFIG, seed=3), batches)
    got: dict[str, torch.Tensor] = {}
    for x, y in batches:
        t0 = replicas[0].embed(x)
        t1 = replicas[1].forward(t0.output.detach().cpu())  # as a hop delivers it: host float32
        t2 = replicas[2].forward(t1.output.detach())
        loss, g2, head_grads = replicas[0].head(t2.output.detach(), y)
        assert math.isclose(loss, GPT(CONFIG, seed=3)(x, y).loss.item(), rel_tol=2e-2)
        g1, grads2 = replicas[2].backward(t2, g2)
        g0, grads1 = replicas[1].backward(t1, g1.cpu())
        _, embed_grads = replicas[0].backward(t0, g0)
        assert all(t.output.device == device for t in (t0, t1, t2))
        for r, grads in (
            (replicas[0], head_grads),
            (replicas[0], embed_grads),
            (replicas[1], grads1),
            (replicas[2], grads2),
        ):
            assert {(g.device, g.dtype) for g in grads} == {(device, torch.float32)}
            for n, g in r.grads_by_name(grads).items():
                got[n] = got.get(n, 0) + g.cpu() / len(batches)
    assert seen and set(seen) == {torch.bfloat16}
    for n, g in want.items():
        assert (got[n] - g).norm() <= 0.05 * g.norm() + 1e-6, n
    r = replicas[1]
    assert {(p.device, p.dtype) for p in r.params} == {(device, torch.float32)}
    assert {p.device.type for n, p in r.model.named_parameters() if n not in r.names} == {"cpu"}
    r.apply_update(list(r.grads_by_name(grads1).values()))
    assert all(s["exp_avg"].device == device for s in r.optimizer.state.values())
    assert {t.device.type for t in r.stage_state().values()} == {"cpu"}


@pytest.mark.parametrize("name", DEVICES)
def test_a_hop_leaves_the_device_as_bf16_host_tensors_and_arrives_back_on_it(name):
    device = torch.device(name)
    codec = HopCodec("bf16", device)
    h = torch.randn(HOP_SHAPE, device=device)
    parts = codec.encode(h)
    assert {k: (v.dtype, v.device.type) for k, v in parts.items()} == {"values": (torch.bfloat16, "cpu")}
    assert sum(v.nbytes for v in parts.values()) == codec.nbytes(HOP_SHAPE) == HopCodec("none").nbytes(HOP_SHAPE) // 2
    back = codec.decode(parts, HOP_SHAPE)
    assert back.device == device and back.dtype == torch.float32
    assert torch.allclose(back, h, rtol=2**-8, atol=0)
    raw = HopCodec("none", device)
    assert raw.encode(h)["h"].device.type == "cpu" and torch.equal(raw.decode(raw.encode(h), HOP_SHAPE), h)


@pytest.mark.parametrize("name", DEVICES)
async def test_a_bf16_pipeline_of_peers_sends_bf16_hops_and_learns(name):
    """Three peers on loopback, one per stage, each stage on the device under bf16 autocast, the
    run's hops bf16: every hop carries 2 bytes an element (half float32's), the stages stay on the
    device, and the loss of a repeated batch falls."""
    device = torch.device(name)
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 3, full_mesh=True)
        run = make_run([p.id for p in peers], [0, 1, 2], microbatches=2, activation_codec="bf16")
        rts = []
        for p, replica in zip(peers, bf16_stages(device), strict=True):
            rt = PipelineRuntime(p.host, p.ts, replica, run, lambda _it, mb: batch(0, mb))
            rts.append(await stack.enter_async_context(rt))
        losses = []
        for it in range(6):
            reports = await iterate(rts, it)
            assert all(r.committed == 2 and r.restarts == 0 for r in reports), reports
            losses.append(reports[0].loss)
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, losses
        sent = sum(rt.stats["hops_sent"] for rt in rts)
        assert sent == 6 * 2 * 6  # per microbatch: 0 -> 1 -> 2 -> 0 forward, 0 -> 2 -> 1 -> 0 backward
        assert sum(rt.stats["hop_bytes"] for rt in rts) == sent * 2 * math.prod(HOP_SHAPE)
        assert all(p.device == device for rt in rts for p in rt.replica.params)


async def test_a_pipeline_peer_of_several_local_ranks_is_refused_in_one_line(tmp_path):
    """A stage peer is one process on one device: rank 0 of a multi-rank peer (`local`, here a
    stand-in: the refusal comes before the ranks are used) ends with a one-line `ConfigError`
    saying why and what to run instead."""
    spec = meshtrain.SwarmSpec(model="gpt-tiny", pipeline="skippipe", stages=2, steps=2)
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path))
    config = meshtrain.NodeConfig(
        data_dir=tmp_path, listen=["/ip4/127.0.0.1/tcp/0"], status_port=0, nproc_per_node=2, device="cpu"
    )
    node = meshtrain.Node(config, spec=signed, local=object())
    with pytest.raises(ConfigError, match="one process on one device") as e:
        await node.run()
    assert "\n" not in str(e.value) and "--device cuda:i" in str(e.value)
