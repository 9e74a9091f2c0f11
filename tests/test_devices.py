"""Devices and precision: the trainer takes its device as a parameter and runs one code path on
the CPU (here) and on CUDA (behind the `cuda` marker); the outer state stays fp32 on the host;
bf16 autocast trains; a bad device or precision is a one-line error."""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request

import pytest
import torch
import trio

import meshtrain
from meshtrain.collective import LocalSwarm
from meshtrain.errors import ConfigError, meshtrain_error_in
from meshtrain.node.ranks.devices import Precision, resolve_device
from meshtrain.node.spec.config import load_node_config
from meshtrain.node.spec.swarm import SwarmSpec, parse_spec
from meshtrain.node.status.client import fetch_status
from meshtrain.node.trainer import REPORT_EVERY, Trainer
from meshtrain.transport.identity import Identity

NO_CUDA = "needs a CUDA device; torch sees none here (CPU-only CI): run on a GPU machine with -m cuda"


def cuda(test):  # noqa: ANN001, ANN201 - a marker
    """GPU-only tests: marked `cuda` (select with -m cuda) and skipped, saying why, without one."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)(test))


async def train(t: Trainer, steps: int) -> None:
    async with t.outer:
        await trio.to_thread.run_sync(t.run, threading.Event(), steps, lambda _t: None)


def test_device_names_resolve_or_fail_in_one_line():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto").type in ("cpu", "mps")
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda:1")
    assert load_node_config(None, overrides={"device": "CUDA:1"}).device == "cuda:1"
    with pytest.raises(ConfigError, match=r"node config: device: must be auto, cpu, mps, cuda"):
        load_node_config(None, overrides={"device": "gpu0"})
    with pytest.raises(ConfigError, match="precision"):
        parse_spec({"precision": "fp8"})
    with pytest.raises(ConfigError, match="nproc_per_node"):
        load_node_config(None, overrides={"nproc_per_node": 0})


# The trainer on each device this machine has: on "cpu" θ and φ share the host, so the pseudo-gradient
# takes its host path; on "cuda:0" (marked `cuda`: scripts/gpu_check.sh runs it) θ is on the device
# and φ on the pinned host, the non-blocking copy path (optim/outer.py `pseudo_gradient`). No CPU
# stand-in reaches that path with data: a `meta` θ has no values to copy back.
DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]),
]


@pytest.mark.parametrize("device", DEVICES)
async def test_model_batches_and_inner_state_on_the_device_outer_state_fp32_on_the_host(device):
    device = torch.device(device)
    spec = SwarmSpec(model="gpt-tiny", H=5, eval_every=0, batch_size=8)
    t = Trainer(spec, LocalSwarm(1).member(0), "peer-a", device=device)
    await train(t, 10)
    assert t.outer.rounds == 2
    assert {p.device for p in t.model.parameters()} == {device}
    assert {p.dtype for p in t.model.parameters()} == {torch.float32}
    x, y = t.batch(0)
    assert x.device == y.device == device and x.shape == (8, t.context)
    assert all(s["exp_avg"].device == device for s in t.inner.state.values())
    assert all(phi.device.type == "cpu" and phi.dtype == torch.float32 for phi in t.outer.outer_params.values())
    if device.type == "cuda":  # pinned, so the copies to and from the device can be non-blocking
        assert all(phi.is_pinned() for phi in t.outer.outer_params.values())
    state = t.checkpoint_state()
    assert all(v.device.type == "cpu" for v in state["model"].values())
    resumed = Trainer(spec, LocalSwarm(1).member(0), "peer-a", device=device)
    resumed.load_checkpoint(state)
    assert resumed.step == 10 and all(
        torch.equal(a, b) for a, b in zip(t.model.parameters(), resumed.model.parameters(), strict=True)
    )
    # Δ = φ − θ after three more inner steps, wherever θ is: the values the host computes, on the host.
    for step in range(3):
        x, y = t.batch(10 + step)
        t.outer.zero_grad()
        t.model(x, y).loss.backward()
        t.inner.step()
    delta = t.outer.pseudo_gradient(list(t.outer.params))
    for n, theta in t.outer.params.items():
        expected = t.outer.outer_params[n] - theta.detach().to("cpu", torch.float32)
        assert delta[n].device.type == "cpu" and delta[n].dtype == torch.float32
        assert torch.equal(delta[n], expected) and delta[n].abs().sum() > 0, n


async def test_bf16_autocast_trains_with_fp32_master_weights_and_loss_falls():
    spec = SwarmSpec(model="gpt-tiny", H=20, eval_every=0, batch_size=16, precision="bf16", inner_lr=3e-3)
    t = Trainer(spec, LocalSwarm(1).member(0), "peer-a", device="cpu")
    before = t.evaluate()
    seen: list[torch.dtype] = []
    t.model.blocks[0].mlp.fc.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    await train(t, 60)
    assert seen and set(seen) == {torch.bfloat16}  # the forward ran in bf16 ...
    assert {p.dtype for p in t.model.parameters()} == {torch.float32}  # ... on fp32 master weights
    assert {phi.dtype for phi in t.outer.outer_params.values()} == {torch.float32}
    assert t.outer.rounds == 3 and len(t.info.history) == 60 // REPORT_EVERY
    assert t.evaluate() < before - 0.3


async def test_fp16_skips_a_step_whose_gradients_overflow_halves_the_scale_and_checkpoints_it():
    spec = SwarmSpec(model="gpt-tiny", H=5, eval_every=0, batch_size=4, precision="fp16")
    t = Trainer(spec, LocalSwarm(1).member(0), "peer-a", device="cpu")
    scaler = t.precision.scaler
    assert scaler is not None
    # A scale no fp16 gradient survives: the first step overflows.
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**100, "_growth_tracker": 0})
    theta = [p.detach().clone() for p in t.model.parameters()]
    async with t.outer:
        await trio.to_thread.run_sync(t.run, threading.Event(), 1, lambda _t: None)
        assert scaler.get_scale() == 2.0**99  # backed off by half ...
        assert not t.inner.state and all(  # ... and the inner step skipped: no Adam state, θ as it was
            torch.equal(a, b) for a, b in zip(theta, t.model.parameters(), strict=True)
        )
        scaler.update(2.0**8)  # a scale the gradients fit: the next step is taken, at that scale
        await trio.to_thread.run_sync(t.run, threading.Event(), 2, lambda _t: None)
    assert scaler.get_scale() == 2.0**8 and t.inner.state
    assert not all(torch.equal(a, b) for a, b in zip(theta, t.model.parameters(), strict=True))
    state = t.checkpoint_state()
    assert state["outer"]["inner"]["scaler"]["scale"] == 2.0**8  # a resumed peer keeps the scale
    assert t.info.loss is not None and torch.isfinite(torch.tensor(t.info.loss))


@pytest.mark.slow
def test_device_mistakes_on_the_command_line_are_one_line(tmp_path):
    def start(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "meshtrain.node.cli", "node", "start", "--data-dir", str(tmp_path), *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = start("--device", "gpu0")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "meshtrain: error: node config: device: must be auto, cpu, mps, cuda or cuda:<index> (got 'gpu0')"
    ]
    if not torch.cuda.is_available():
        r = start("--nproc-per-node", "2", "--device", "cuda")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no CUDA device" in r.stderr
    with pytest.raises(ConfigError, match="nproc-per-node"):
        meshtrain.Node(meshtrain.NodeConfig(data_dir=tmp_path, nproc_per_node=2))


def test_precision_names():
    assert Precision("fp32", torch.device("cpu")).dtype is None
    with pytest.raises(ConfigError):
        Precision("int8", torch.device("cpu"))


async def test_status_and_metrics_show_the_device(tmp_path):
    spec = meshtrain.SwarmSpec(model="gpt-tiny", steps=30, H=10, eval_every=0)
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path))
    config = meshtrain.NodeConfig(
        data_dir=tmp_path, listen=["/ip4/127.0.0.1/tcp/0"], status_port=0, device="cpu", nat=False
    )
    node = meshtrain.Node(config, spec=signed)
    seen = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node.run)
        with trio.fail_after(60):
            while node.trainer is None or node.status_url is None:
                await trio.sleep(0.05)  # sleep: poll interval
        seen["status"] = await trio.to_thread.run_sync(fetch_status, node.status_url, 5)
        seen["metrics"] = await trio.to_thread.run_sync(
            lambda: urllib.request.urlopen(node.status_url + "/metrics", timeout=5).read().decode()
        )
    assert seen["status"]["node"]["device"] == "cpu" and seen["status"]["node"]["local_ranks"] == 1
    assert 'meshtrain_device_info{device="cpu",local_ranks="1"} 1.0' in seen["metrics"]


@cuda
async def test_cuda_trainer_matches_the_cpu_path_with_pinned_host_outer_state():
    spec = SwarmSpec(model="gpt-tiny", H=5, eval_every=0, batch_size=8)
    gpu = Trainer(spec, LocalSwarm(1).member(0), "peer-a", device="cuda:0")
    cpu = Trainer(spec, LocalSwarm(1).member(0), "peer-a", device="cpu")
    await train(gpu, 10)
    await train(cpu, 10)
    assert all(p.is_cuda for p in gpu.model.parameters())
    assert all(phi.device.type == "cpu" and phi.is_pinned() for phi in gpu.outer.outer_params.values())
    # A model on the CPU pins nothing, CUDA present or not (pinned memory is locked out of the
    # kernel's reach: the memory budget, docs/guide.md).
    assert not any(phi.is_pinned() for phi in cpu.outer.outer_params.values())
    for n, phi in gpu.outer.outer_params.items():
        assert torch.allclose(phi, cpu.outer.outer_params[n], atol=1e-4), n


@cuda
async def test_cuda_fp16_and_bf16_train():
    for precision in ("fp16", "bf16"):
        spec = SwarmSpec(model="gpt-tiny", H=20, eval_every=0, batch_size=16, precision=precision, inner_lr=3e-3)
        t = Trainer(spec, LocalSwarm(1).member(0), "peer-a", device="cuda")
        before = t.evaluate()
        await train(t, 60)
        assert t.evaluate() < before - 0.3, precision


def test_a_model_that_cannot_fit_its_device_is_refused_before_it_moves_there_naming_the_knobs():
    """16 bytes per parameter (θ, gradient, AdamW's moments) before any activation: a model of
    twice what the host has free is refused in one line (the model here is on the meta device:
    its parameters hold no memory, as a model too big to build would not be built)."""
    from meshtrain.node.ranks.devices import TRAINING_BYTES_PER_PARAM, check_fits, fit_error, free_bytes

    cpu = torch.device("cpu")
    free = free_bytes(cpu)
    assert free is not None and free > 0  # MemAvailable, on Linux
    assert fit_error(1000, cpu, free) is None and fit_error(10**12, cpu, None) is None  # fits / cannot tell
    side = int((2 * free / TRAINING_BYTES_PER_PARAM) ** 0.5) + 1
    too_big = torch.nn.Linear(side, side, bias=False, device="meta")
    with pytest.raises(
        ConfigError, match=r"needs at least .* GiB on cpu .* is free: .*--nproc-per-node N --sharding fsdp"
    ):
        check_fits(too_big, cpu)
    check_fits(torch.nn.Linear(8, 8), cpu)  # a small one passes


SWALLOWS_MEMORY = """
import torch

from meshtrain.models import GPT, GPTConfig


class Greedy(GPT):
    def forward(self, x, y=None):
        torch.empty(1 << 48, dtype=torch.uint8)  # 256 TiB: the allocator refuses it, as a too-large batch would
        return super().forward(x, y)


def make(vocab_size):
    return Greedy(GPTConfig.tiny(vocab_size), seed=0)
"""


async def test_a_training_step_out_of_memory_is_one_line_naming_the_knobs(tmp_path):
    """An allocation that fails in a training step (here a real one the CPU allocator refuses) is
    a ConfigError that says what to turn down, not the allocator's RuntimeError."""
    from meshtrain.models.sources import build_model

    (tmp_path / "greedy.py").write_text(SWALLOWS_MEMORY)
    spec = SwarmSpec(model="gpt-tiny", H=5, eval_every=0, batch_size=2)
    model = build_model(f"py:{tmp_path / 'greedy.py'}:make", vocab_size=65, seed=0)
    t = Trainer(spec, LocalSwarm(1).member(0), "peer-a", device="cpu", model=model)
    with pytest.raises(BaseExceptionGroup) as caught:  # through the outer optimizer's nursery, as in a node
        await train(t, 1)
    err = meshtrain_error_in(caught.value)  # what the node raises and the CLI prints
    assert isinstance(err, ConfigError), caught.value
    assert str(err).startswith("out of memory on cpu in training step 0: try a shorter --context"), err
