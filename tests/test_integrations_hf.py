"""`meshtrain.integrations.hf.MeshtrainCallback`: a `transformers.Trainer` script as a swarm peer.

Two peers in separate processes run examples/hf_trainer.py (an ordinary Trainer script on a tiny
LLaMA, plus the callback): both rounds have both contributors, both end with the same φ, the
Trainer's logged loss fell, and `trainer.train()` returned. In process: what cannot work is
refused in one line, each peer gets its own data order, and a Trainer resumed from its output_dir
continues the swarm's steps and rounds.
"""

from __future__ import annotations

import pytest
from transformers import Trainer, TrainingArguments

from meshtrain.errors import ConfigError
from meshtrain.integrations.hf import MeshtrainArguments, MeshtrainCallback
from meshtrain.node.state.checkpoint import CheckpointStore
from tests.example_peers import ROOT, loss_fell, run_two_peers

EXAMPLE = ROOT / "examples" / "hf_trainer.py"


@pytest.mark.slow
def test_two_trainer_processes_reach_one_phi_and_their_loss_falls(tmp_path):
    common = [
        *("--max_steps", "20", "--H", "10", "--listen", "/ip4/127.0.0.1/tcp/0", "--status_port", "0"),
        *("--nat", "false", "--wait_peers", "2", "--report_to", "none", "--logging_steps", "5"),
        *("--save_strategy", "no", "--learning_rate", "3e-3", "--per_device_train_batch_size", "8"),
        *("--disable_tqdm", "true"),
    ]
    ra, rb = run_two_peers(
        EXAMPLE,
        ["--output_dir", str(tmp_path / "a"), "--create", *common],
        ["--output_dir", str(tmp_path / "b"), *common, "--join"],
        tmp_path,
    )
    assert ra["step"] == rb["step"] == 20 and ra["rounds"] == rb["rounds"] == 2
    assert ra["contributors"] == rb["contributors"] == [2, 2]
    assert ra["phi_digest"] == rb["phi_digest"]
    assert loss_fell(ra["losses"]) and loss_fell(rb["losses"])
    assert ra["losses"] != rb["losses"]  # each peer its own data order
    assert (tmp_path / "a" / "meshtrain" / "checkpoints").is_dir()  # the swarm's, beside the Trainer's


def test_what_cannot_work_is_refused_and_peers_shuffle_apart(tmp_path):
    import torch

    with pytest.raises(ConfigError, match="join or create, not both"):
        MeshtrainCallback(MeshtrainArguments(join="/ip4/127.0.0.1/tcp/1", create=True))
    model = torch.nn.Linear(2, 2)
    args = TrainingArguments(output_dir=str(tmp_path / "x"), report_to="none", use_cpu=True)
    with pytest.raises(ConfigError, match="set join=<peer address> or create=True"):
        Trainer(model=model, args=args, callbacks=[MeshtrainCallback()])
    seeds = []
    for name in ("a", "b"):
        args = TrainingArguments(output_dir=str(tmp_path / name), report_to="none", use_cpu=True)
        Trainer(model=model, args=args, callbacks=[MeshtrainCallback(MeshtrainArguments(create=True))])
        assert (tmp_path / name / "meshtrain").is_dir()  # the peer's data dir, under output_dir
        seeds.append(args.data_seed)
    assert None not in seeds and seeds[0] != seeds[1]
    args = TrainingArguments(output_dir=str(tmp_path / "c"), report_to="none", use_cpu=True, max_steps=1)
    data = [{"x": 0.0}]
    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[MeshtrainCallback(MeshtrainArguments(create=True, H=0))]
    )
    with pytest.raises(ConfigError, match="swarm spec: H"):
        trainer.train()


def test_a_trainer_resumed_from_its_output_dir_continues_the_swarms_rounds(tmp_path):
    """A Trainer stopped at step 6 (its checkpoint-3 and -6, and the swarm's checkpoints at the
    same steps in output_dir/meshtrain) and started again with `resume_from_checkpoint`, rejoining the data
    dir's swarm: the swarm's step and rounds go on from 6 and 2, not from 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    class StopAt(TrainerCallback):
        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= self.step:
                control.should_training_stop = True

    def trainer(mesh: MeshtrainArguments, *extra: TrainerCallback) -> tuple[Trainer, MeshtrainCallback]:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
        data = [{"input_ids": row, "labels": row} for row in torch.randint(0, 32, (64, 16))]
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=12,
            per_device_train_batch_size=4,
            save_strategy="steps",
            save_steps=3,
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
        )
        callback = MeshtrainCallback(mesh)
        t = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data, callbacks=[callback, *extra])
        return t, callback

    node = {"listen": "/ip4/127.0.0.1/tcp/0", "status_port": 0, "nat": False, "checkpoint_every": 3600}
    first, cb1 = trainer(MeshtrainArguments(create=True, H=3, **node), StopAt(6))
    first.train()
    assert cb1.result is not None and cb1.result.step == 6 and cb1.result.rounds == 2
    assert (tmp_path / "out" / "checkpoint-6").is_dir()
    store = CheckpointStore(tmp_path / "out" / "meshtrain" / "checkpoints", readonly=True)
    assert [store.load(p).step for p in store.list()] == [3, 6]  # at the Trainer's saves (and the end)
    second, cb2 = trainer(MeshtrainArguments(**node))  # neither join nor create: the data dir's swarm
    second.train(resume_from_checkpoint=True)
    assert cb2.result is not None and cb2.result.step == 12 and cb2.result.rounds == 4
    assert second.state.global_step == 12
