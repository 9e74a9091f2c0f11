"""Pipeline swarms from the daemon (node/stages/peer.py, node/stages/state.py): real `Node`s in
one trio program, on loopback, each with its host, data plane and membership — a late joiner takes
its stage's state from that stage's replicas, and a stage whose only replica is gone is refilled
by a peer of the most replicated stage, and training goes on."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
import trio

import meshtrain
from meshtrain.node.presence import PeerPresence
from meshtrain.node.stages import handover as stage_handover
from meshtrain.node.stages.announce import PipelineAnnouncements
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity

pytestmark = pytest.mark.slow  # three daemons each, 10–20 s


def pipeline_spec(**changes: Any) -> meshtrain.SwarmSpec:
    base: dict[str, Any] = dict(
        model="gpt-tiny",
        steps=30,
        pipeline="skippipe",
        stages=2,
        microbatches=4,
        batch_size=4,
        eval_every=0,
        replica_sync="every-step",
    )
    return meshtrain.SwarmSpec(**{**base, **changes})


def node_config(tmp_path: Path, name: str, **changes: Any) -> meshtrain.NodeConfig:
    return meshtrain.NodeConfig(
        data_dir=tmp_path / name, listen=["/ip4/127.0.0.1/tcp/0"], status_port=0, threads=1, **changes
    )


def stage_step(node: meshtrain.Node) -> tuple[int | None, int]:
    peer = getattr(node, "pipeline", None)
    trainer = peer.trainer if peer is not None else None
    return (trainer.stage, trainer.step) if trainer is not None else (None, 0)


async def wait_for(predicate, timeout: float = 60.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)  # sleep: poll interval


@asynccontextmanager
async def three_daemons(
    tmp_path: Path, spec: meshtrain.SwarmSpec, timeout: float = 120, **config: Any
) -> AsyncIterator[tuple[dict[str, meshtrain.Node], dict[str, meshtrain.NodeResult]]]:
    """Nodes a (the spec's owner, waiting for 3 peers), b and c (joining a's address), running,
    each with the node `config` given: yields (nodes, results) by name while they run; on
    leaving, every node's run has returned (`results`)."""
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))
    nodes = {"a": meshtrain.Node(node_config(tmp_path, "a", wait_peers=3, **config), spec=signed)}
    results: dict[str, meshtrain.NodeResult] = {}

    async def run(name: str, node: meshtrain.Node) -> None:
        results[name] = await node.run()

    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", nodes["a"])
            await wait_for(lambda: nodes["a"].view is not None)
            for name in "bc":
                nodes[name] = meshtrain.Node(node_config(tmp_path, name, **config), join=nodes["a"].host.addrs[0])
                nursery.start_soon(run, name, nodes[name])
            yield nodes, results


def refilled_stage_mover(
    tmp_path: Path, nodes: dict[str, meshtrain.Node], results: dict[str, meshtrain.NodeResult], gone: str, steps: int
) -> meshtrain.Node:
    """After stage 1's only replica `gone` left a two-stage swarm: it stopped early, the survivors
    trained to `steps`, and one of them (returned) moved to the emptied stage."""
    survivors = sorted(set(nodes) - {gone})
    assert results[gone].step < steps and all(results[n].step == steps for n in survivors), results
    stages = {n: final_stage(tmp_path, n)[0] for n in survivors}
    assert sorted(stages.values()) == [0, 1], stages  # one origin moved to the empty stage
    return nodes[next(n for n in survivors if stages[n] == 1)]


def final_stage(tmp_path: Path, name: str) -> tuple[int, int, str]:
    """(stage, step, digest of the weights) of a node's last checkpoint."""
    ckpt = CheckpointStore(tmp_path / name / "checkpoints", readonly=True).load_latest()
    assert ckpt is not None, name
    w = ckpt.state["weights"]
    h = blake3.blake3()
    for k in sorted(w):
        h.update(w[k].numpy().tobytes())
    return ckpt.state["pipeline"]["stage"], ckpt.step, h.hexdigest()


@pytest.mark.parametrize("replica_sync", ["every-step", "diloco"])
async def test_a_late_joiner_takes_its_stages_state_from_the_replicas(tmp_path, replica_sync):
    """Two daemons train stages 0 and 1; a third joins at step 8 or later, is placed on stage 0
    (it wants two origins), downloads stage 0's state from its replica as the next epoch starts,
    and trains on: at the last step (after DiLoCo's last round) the two replicas of stage 0 hold
    the same bits. Started from θ0 instead, they never would."""
    # 50 steps, not the usual 30: the joiner starts at step 8 and must be seen before the others
    # finish (under load they ran all 30 once before it announced itself).
    spec = pipeline_spec(replica_sync=replica_sync, H=5, steps=50)
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))
    a = meshtrain.Node(node_config(tmp_path, "a", wait_peers=2), spec=signed)
    results: dict[str, meshtrain.NodeResult] = {}
    nodes = {"a": a}

    async def run(name: str, node: meshtrain.Node) -> None:
        results[name] = await node.run()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a", a)
        await wait_for(lambda: a.view is not None)
        nodes["b"] = meshtrain.Node(node_config(tmp_path, "b"), join=a.host.addrs[0])
        nursery.start_soon(run, "b", nodes["b"])
        await wait_for(lambda: stage_step(a)[1] >= 8)
        nodes["c"] = meshtrain.Node(node_config(tmp_path, "c"), join=a.host.addrs[0])
        nursery.start_soon(run, "c", nodes["c"])
    assert {n: r.step for n, r in results.items()} == {"a": 50, "b": 50, "c": 50}
    joined = nodes["c"].pipeline.joined_from
    assert joined is not None and joined["stage"] == 0 and joined["from_replicas"], joined
    assert joined["step"] >= 8 and joined["donors"] == 1 and joined["bytes"] > 0, joined
    finals = {n: final_stage(tmp_path, n) for n in nodes}
    assert sorted(s for s, _, _ in finals.values()) == [0, 0, 1], finals
    replicas = [digest for stage, _, digest in finals.values() if stage == 0]
    assert replicas[0] == replicas[1], finals  # the joiner trained the stage's lineage, not its own


@pytest.mark.parametrize("handover", [True, False])
async def test_a_stage_that_lost_its_only_replica_is_refilled_and_training_goes_on(tmp_path, monkeypatch, handover):
    """Three daemons: two origins on stage 0, one peer on stage 1, which stops (a SIGKILLed one is
    scripts/bench/bench_pipeline_swarm.py's: in one process a cancelled node's sockets outlive it).
    Placement's refill rule moves an origin to stage 1, and the two survivors train to the last
    step. The stopping peer hands its stage over: it serves the state it published at the epoch's
    end until the mover has it, and the mover trains stage 1 on from there. Without the handover
    (`HANDOVER_WAIT` 0: as after a crash) and without stage backups (`stage_backup` off; with them:
    tests/test_pipeline_backup.py) nobody holds stage 1's state — this swarm keeps no shared
    checkpoints — and the mover says so and starts the stage from its initial weights. (Unless the
    stopping peer's server still answers while it shuts down: then the mover takes the state it
    published, as a former replica's; which of the two happens is a race.)"""
    if not handover:
        monkeypatch.setattr(stage_handover, "HANDOVER_WAIT", 0.0)
    async with three_daemons(tmp_path, pipeline_spec(steps=24, stage_backup=handover)) as (nodes, results):
        await wait_for(lambda: all(stage_step(n)[1] >= 6 for n in nodes.values()))
        (gone,) = [name for name, n in nodes.items() if stage_step(n)[0] == 1]
        nodes[gone].stop()
    mover = refilled_stage_mover(tmp_path, nodes, results, gone, 24)
    joined = mover.pipeline.joined_from
    if handover:
        assert joined is not None and joined["stage"] == 1 and not joined["from_replicas"], joined
        assert joined["step"] == results[gone].step, (joined, results[gone])
    elif joined.get("initial_weights"):  # nothing to download: it started stage 1 from θ0, and says so
        assert joined == {"stage": 1, "step": 0, "donors": 0, "initial_weights": True}, joined
    else:  # the stopping peer waited for no mover, but its server still answered while it shut
        # down: the mover took the state it had published, as a former replica's (not a backup)
        assert joined["stage"] == 1 and joined["donors"] == 1, joined
        assert not joined["from_replicas"] and not joined["from_backup"], joined
        assert joined["step"] == results[gone].step, (joined, results[gone])


def weights_digest(weights: dict) -> str:
    h = blake3.blake3()
    for k in sorted(weights):
        h.update(weights[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


async def test_export_on_a_later_stages_peer_assembles_the_whole_model(tmp_path, monkeypatch, capsys):
    """Three daemons train two stages (two origins on stage 0, one peer on stage 1). `meshtrain
    export` on the stage-1 peer asks its running daemon, which ends the epoch so that every stage
    publishes at one step, takes stage 1 from its own state and stage 0 from its two replicas,
    and writes one model: each stage's parameters are bit for bit what that stage's replicas
    published at the step the export names, and the model loads and gives finite logits.
    `meshtrain sample` on that peer continues a prompt with the model assembled the same way."""
    from safetensors.torch import load_model

    from meshtrain.models import GPT, GPTConfig
    from meshtrain.node import cli
    from meshtrain.node.stages.state import StageStates

    published: list[tuple[str, int, int, str]] = []  # (peer, stage, step, digest), as every peer offered it
    offer = StageStates.publish

    def observe(self: StageStates, stage: int, step: int, state: dict) -> None:
        published.append((self.host.peer_id, stage, step, weights_digest(state["weights"])))
        offer(self, stage, step, state)

    monkeypatch.setattr(StageStates, "publish", observe)
    monkeypatch.setattr(stage_handover, "HANDOVER_WAIT", 0.0)  # all stop together: nobody takes a stage over
    spec = pipeline_spec(steps=0)  # until stopped
    out = tmp_path / "export"
    rc: list[int] = []
    async with three_daemons(tmp_path, spec) as (nodes, _):
        await wait_for(lambda: all(stage_step(n)[1] >= 3 for n in nodes.values()))
        (later,) = [name for name, n in nodes.items() if stage_step(n)[0] == 1]
        argv = ["export", "--data-dir", str(tmp_path / later), "--out", str(out)]
        rc.append(await trio.to_thread.run_sync(cli.main, argv))
        capsys.readouterr()
        argv = ["sample", "--data-dir", str(tmp_path / later), "--prompt", "The ", "--max-new-tokens", "5"]
        rc.append(await trio.to_thread.run_sync(cli.main, argv))  # the same assembly, read back
        sampled = capsys.readouterr().out
        for node in nodes.values():
            node.stop()
    assert rc == [0, 0] and sampled.startswith("The ") and len(sampled) > len("The "), sampled
    info = json.loads((out / "meshtrain_export.json").read_text())
    stages = {s["stage"]: s for s in info["stages"]}
    assert info["steps_agree"] and stages[0]["step"] == stages[1]["step"] == info["step"] >= 3, info
    assert stages[1]["source"] == "own" and (stages[0]["source"], stages[0]["donors"]) == ("replicas", 2), info
    step = info["step"]
    config = json.loads((out / "config.json").read_text())
    model = GPT(GPTConfig(**config["gpt_config"]))
    load_model(model, str(out / "model.safetensors"))
    named = dict(model.named_parameters())
    for stage in model.stages(spec.pipeline.stages):
        exported = weights_digest({n: named[n].detach() for n in stage.parameter_names})
        held = {(peer, digest) for peer, s, t, digest in published if s == stage.index and t == step}
        assert len(held) == (2 if stage.index == 0 else 1), held  # every replica published at that step
        assert {digest for _, digest in held} == {exported}, stage.index
    with torch.no_grad():
        logits = model(torch.zeros(1, 8, dtype=torch.int64)).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("spec", "codec"),
    [
        (pipeline_spec(steps=16, activation_codec="int8"), "int8"),
        (pipeline_spec(steps=10, precision="bf16"), "bf16"),  # bf16 stages send bf16 hops by default
    ],
    ids=["int8-hops", "bf16-stages"],
)
async def test_a_swarm_with_compressed_hops_trains_and_its_replicas_stay_identical(tmp_path, spec, codec):
    """Three daemons (two origins on stage 0, one peer on stage 1), each given its device as the
    node's `--device` (the CPU here), send every activation and gradient hop encoded with the
    spec's codec: int8 where the spec names it; bf16 where the spec's precision is bf16 (the stages
    compute under bf16 autocast). They train to the last step, the loss stays finite and falls,
    and the two stage-0 replicas end with the same bits."""
    async with three_daemons(tmp_path, spec, device="cpu") as (nodes, results):
        pass
    steps = spec.steps
    assert {n: r.step for n, r in results.items()} == {"a": steps, "b": steps, "c": steps}, results
    status = {n: node.pipeline.status() for n, node in nodes.items()}
    assert all(s["activation_codec"] == codec and s["device"] == "cpu" for s in status.values()), status
    assert all(s["precision"] == spec.model.precision for s in status.values()), status
    finals = {n: final_stage(tmp_path, n) for n in nodes}
    assert sorted(s for s, _, _ in finals.values()) == [0, 0, 1], finals
    replicas = {digest for stage, _, digest in finals.values() if stage == 0}
    assert len(replicas) == 1, finals
    origin = next(n for n in nodes if finals[n][0] == 0)
    losses = [h["loss"] for h in nodes[origin].pipeline.trainer.info.history]
    assert len(losses) == steps and all(x is not None and math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) < sum(losses[:3]), losses


async def eventually(check: Callable[[], bool], timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.05)  # sleep: poll interval


async def test_a_joiner_reads_the_swarms_end_from_live_and_left_records(tmp_path):
    """`PipelineAnnouncements.finished` over real membership records: a joiner that came after
    the others trained the last step ends instead of waiting for them for ever (node/stages/peer.py
    `_form`) — but not while a peer that has trained still announces less, so one record that
    claims the end (a hostile one) does not send joiners away from a swarm that trains."""
    last = 20
    async with AsyncExitStack() as stack:
        ids = [Identity.generate() for _ in range(3)]
        signed = meshtrain.SignedSpec.create(pipeline_spec(steps=last), ids[0])
        peers: list[PipelineAnnouncements] = []
        for i, ident in enumerate(ids):
            host = await stack.enter_async_context(Host(ident, HostConfig(listen=["/ip4/127.0.0.1/tcp/0"])))
            entry = [peers[0].presence.host.addrs[0]] if peers else []
            presence = PeerPresence(host, signed, bootstrap=entry, data_dir=tmp_path / f"p{i}")
            await stack.enter_async_context(presence)
            presence.view.role = "trainer"
            peers.append(PipelineAnnouncements(presence, 2))
        a, b, joiner = peers
        a.announce(stage=0, step=0, epoch="e0", ready="e0")  # the swarm's first epoch: step 0
        b.announce(stage=1, step=0, offer=last)  # claims the end while a trains
        await eventually(lambda: joiner.of(b.me).get("offer") == last and joiner.of(a.me).get("ready") == "e0")
        assert joiner.finished(last) is None
        a.announce(step=10, offer=10, epoch="e1", ready="e1")
        await eventually(lambda: joiner.of(a.me).get("step") == 10)
        assert joiner.finished(last) is None
        assert joiner.finished(0) is None  # a swarm without an end never finishes
        a.announce(offer=last)
        await eventually(lambda: joiner.finished(last) is not None)
        assert joiner.finished(last) in (a.me, b.me)
        assert joiner.finished(last + 1) is None
        for peer in (a, b):  # gone: their left records still say where the swarm ended
            await peer.presence.view.leave()
        await eventually(lambda: not {p.peer_id for p in joiner.presence.view.live_peers()} - {joiner.me})
        assert joiner.finished(last) in (a.me, b.me)
