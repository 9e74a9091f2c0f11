"""The trainer's contracts: data is a pure function of (seed, peer, step) so a restarted peer
repeats no work; models come from presets, the Python API, or Hugging Face configs."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import trio

from meshtrain.collective import LocalSwarm
from meshtrain.errors import ConfigError
from meshtrain.node.spec.swarm import SwarmSpec, parse_spec
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.node.state.run_state import RunState
from meshtrain.node.trainer import Trainer


async def train(t: Trainer, steps: int) -> None:
    async with t.outer:
        await trio.to_thread.run_sync(t.run, threading.Event(), steps, lambda _t: None)


def memory_of(optimizer_state: dict) -> set[int]:
    """Where the tensors of a torch optimizer's per-parameter state live (their data pointers)."""
    return {v.data_ptr() for s in optimizer_state.values() for v in s.values() if isinstance(v, torch.Tensor)}


async def test_resumed_trainer_continues_bit_exactly_and_draws_new_batches(tmp_path):
    spec = SwarmSpec(model="gpt-tiny", steps=20, H=5, eval_every=0)
    straight = Trainer(spec, LocalSwarm(1).member(0), "peer-a")
    await train(straight, 20)
    first = Trainer(spec, LocalSwarm(1).member(0), "peer-a")
    await train(first, 10)
    state = first.checkpoint_state()
    # The state to checkpoint is the live tensors, not copies (the memory budget): θ, φ, the
    # outer momentum and AdamW's moments are the trainer's own objects.
    live = first.model.state_dict()
    for n, t in state["model"].items():
        assert t.data_ptr() == live[n].data_ptr(), n
    for n, t in state["outer"]["outer_params"].items():
        assert t.data_ptr() == first.outer.outer_params[n].data_ptr(), n
    assert memory_of(state["outer"]["inner"]["state"]) == memory_of(first.inner.state)  # AdamW's moments
    outer_momentum = memory_of(first.outer.outer_optimizer.state)
    assert outer_momentum and memory_of(state["outer"]["outer_optimizer"]["state"]) == outer_momentum
    # What the donor is handed to offer joiners is the same live memory (lent until the next round).
    _, lent = RunState.donor_snapshot(first)
    phi = {t.data_ptr() for t in first.outer.outer_params.values()}
    assert phi | outer_momentum == {t.data_ptr() for t in lent.values() if t.numel()}
    store = CheckpointStore(tmp_path)
    store.save(state, step=first.step, round=first.outer.rounds)
    resumed = Trainer(spec, LocalSwarm(1).member(0), "peer-a")
    resumed.load_checkpoint(store.load_latest().state)
    await train(resumed, 20)
    for (n, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    # Different peers train on different samples; a peer's batch at a step never changes.
    c = straight.corpus
    assert not torch.equal(
        c.batch(4, 16, seed=0, peer="peer-a", step=3)[0], c.batch(4, 16, seed=0, peer="peer-b", step=3)[0]
    )
    assert torch.equal(
        c.batch(4, 16, seed=0, peer="peer-a", step=3)[0], c.batch(4, 16, seed=0, peer="peer-a", step=3)[0]
    )


async def test_a_user_model_through_the_python_api():
    class Bigram(torch.nn.Module):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(vocab, vocab)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.table(x).flatten(0, 1), y.flatten())

    spec = SwarmSpec(model="gpt-tiny", steps=30, H=10, eval_every=10, inner_lr=0.05)
    from meshtrain.models import Corpus

    t = Trainer(spec, LocalSwarm(1).member(0), "p", model=Bigram(Corpus.default().vocab_size))
    before = t.evaluate()
    await train(t, 30)
    assert t.info.eval_loss < before


def test_a_hugging_face_config_trains_on_two_peers_from_one_start_to_one_phi(tmp_path):
    """Both peers build the same θ0 from the config file, train on their own data, and hold one
    φ after every round (DiLoCo); the swarm's loss falls."""
    pytest.importorskip("transformers")
    cfg = tmp_path / "gpt2.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 32}))
    spec = SwarmSpec(model=f"hf-config:{cfg}", steps=10, H=5, eval_every=10, inner_lr=1e-2)
    swarm = LocalSwarm(2)
    a, b = (Trainer(spec, swarm.member(i), f"peer-{i}") for i in range(2))
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    before = a.evaluate()

    async def both() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(train, a, 10)
            nursery.start_soon(train, b, 10)

    trio.run(both)
    assert a.context == 32 and a.outer.rounds == b.outer.rounds == 2
    assert [r.contributors for r in a.outer.history] == [2, 2]  # each round averaged both peers
    for n, phi in a.outer.outer_params.items():
        assert torch.equal(phi, b.outer.outer_params[n]), n
    assert a.info.eval_loss < before and b.info.eval_loss == pytest.approx(a.info.eval_loss)


def test_spec_and_model_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="model"):
        parse_spec({"model": "gpt-huge"})
    with pytest.raises(ConfigError, match="codec"):
        parse_spec({"codec": "mp3"})
    with pytest.raises(ConfigError, match="does not exist"):
        Trainer(SwarmSpec(dataset=str(tmp_path / "none.txt")), LocalSwarm(1).member(0), "p")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match="model_type"):
        Trainer(SwarmSpec(model=f"hf-config:{bad}"), LocalSwarm(1).member(0), "p")
