"""`meshtrain export` of a pipeline swarm without a running node (node/stages/export.py): a
peer's data dir holds only the stages it trained, so the export either assembles them all (a peer
that moved holds several) or says in one line which stages are missing and that the node must
run to fetch them — and writes nothing. (With the daemon running: tests/test_pipeline_swarm.py.)"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_model

from meshtrain.models import GPT, GPTConfig
from meshtrain.node import cli
from meshtrain.node.export import spec_tokenizer
from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.stages.state import StageStateError, StageStates
from meshtrain.node.stages.trainer import StageTrainer
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.transport.identity import Identity

from .conftest import start_peers


def pipeline_peer_dir(data_dir: Path, spec: SwarmSpec, stages: list[int]) -> dict[int, StageTrainer]:
    """A pipeline peer's data dir as the daemon leaves it: swarm.json and a checkpoint of each
    stage in `stages` (a peer placement moved holds its old stage's checkpoints too), each
    stage's weights θ moved off θ0 (and off φ, which stays θ0, with DiLoCo replica sync) so that
    a stage taken from the wrong place would show."""
    signed = SignedSpec.create(spec, Identity.load_or_create(data_dir))
    signed.save(data_dir / "swarm.json")
    store = CheckpointStore(data_dir / "checkpoints", keep=8)
    trainers = {}
    for i, stage in enumerate(stages):
        trainer = trainers[stage] = StageTrainer(signed.spec, stage, spec_tokenizer(signed).vocab_size)
        trainer.attach_sync(lambda: None)  # diloco: φ, never used for a round here
        with torch.no_grad():
            for p in trainer.replica.params:
                p.add_(0.01 * (stage + 1))
        trainer.step = 10 + i
        store.save(trainer.checkpoint_state(), step=trainer.step, round=0)
    return trainers


def spec(replica_sync: str = "every-step") -> SwarmSpec:
    return SwarmSpec(
        model="gpt-tiny",
        pipeline="skippipe",
        stages=3,
        batch_size=4,
        microbatches=2,
        eval_every=0,
        replica_sync=replica_sync,
    )


def test_without_a_running_node_missing_stages_are_one_line_and_nothing_is_written(tmp_path, capsys):
    pipeline_peer_dir(tmp_path / "d", spec(), [1])
    capsys.readouterr()  # what writing the checkpoint logged (MESHTRAIN_TEST_LOG=INFO) is not the CLI's
    rc = cli.main(["export", "--data-dir", str(tmp_path / "d"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "\n" not in err and "Traceback" not in err, err
    assert "stage(s) 1 only" in err and "stage(s) 0, 2 live on other peers" in err and "node start" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no export, no temporary directory


@pytest.mark.parametrize("replica_sync", ["every-step", "diloco"])
def test_without_a_running_node_a_data_dir_holding_every_stage_exports_them(tmp_path, replica_sync, capsys):
    """Each stage's weights — its φ with DiLoCo replica sync, what the replicas agreed on — at its
    own newest checkpoint's step, which the export records."""
    trainers = pipeline_peer_dir(tmp_path / "d", spec(replica_sync), [0, 2, 1])
    assert cli.main(["export", "--data-dir", str(tmp_path / "d"), "--out", str(tmp_path / "out")]) == 0
    info = json.loads((tmp_path / "out" / "meshtrain_export.json").read_text())
    assert [(s["stage"], s["step"], s["source"]) for s in info["stages"]] == [
        (0, 10, "checkpoint"),
        (1, 12, "checkpoint"),
        (2, 11, "checkpoint"),
    ]
    assert info["step"] == 10 and not info["steps_agree"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    model = GPT(GPTConfig(**config["gpt_config"]))
    load_model(model, str(tmp_path / "out" / "model.safetensors"))
    named = dict(model.named_parameters())
    for stage, trainer in trainers.items():
        want = trainer.sync.outer.outer_params if trainer.sync is not None else trainer.replica.stage_state()
        assert sorted(want) == sorted(trainer.replica.names)
        for name, value in want.items():
            assert torch.equal(named[name].detach(), value), (stage, name)
    capsys.readouterr()
    argv = ["sample", "--data-dir", str(tmp_path / "d"), "--prompt", "The ", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0  # sample: the same assembly, read back, and nothing left behind
    assert capsys.readouterr().out.startswith("The ")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["checkpoints", "identity.key", "swarm.json"]


async def test_a_stage_whose_replicas_disagree_or_that_nobody_holds_is_an_error_naming_it():
    """What the running node's export meets (real hosts on loopback): two replicas of stage 2
    offering different weights at one step have no majority, and a stage nobody published is
    nobody's — each a `StageStateError` that names the stage, not a silent θ0."""
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 3)
        me, replicas = StageStates(peers[0].host, peers[0].ts, "every-step"), peers[1:]
        for seed, p in enumerate(replicas):
            weights = {"blocks.1.fc.weight": torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))}
            StageStates(p.host, p.ts, "every-step").publish(2, 8, {"weights": weights, "adam": {}})
        donors = [p.host.peer_id for p in replicas]
        with pytest.raises(
            StageStateError, match=r"stage 2's state: from its replicas \(2\): no state is offered identically"
        ):
            await me.fetch_required(2, donors, donors)
        with pytest.raises(StageStateError, match=r"stage 1's state:.*no_state"):
            await me.fetch_required(1, [], donors)
