"""The trainer with file datasets: evaluation under every optimizer, exact resume from a real
checkpoint on disk, and a peer whose dataset files differ from the spec's is refused."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
import torch
import trio

from meshtrain.collective import LocalSwarm
from meshtrain.data import dataset_digest
from meshtrain.errors import ConfigError
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.node.trainer import Trainer


def write_jsonl(path: Path, n: int = 400) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"record {i}: " + " ".join(str(i * j % 97) for j in range(40))}) + "\n")
    return path


async def train(t: Trainer, steps: int, after_step=lambda _t: None) -> None:
    async with t.outer:
        await trio.to_thread.run_sync(t.run, threading.Event(), steps, after_step)
        await t.outer.afinish()


@pytest.mark.parametrize("optimizer", ["diloco", "streaming", "noloco", "sparseloco"])
async def test_every_optimizer_reports_a_held_out_loss_of_phi(optimizer):
    # H=10, 2 fragments, delay 1: Streaming DiLoCo sends a fragment at every eval step (10, 20),
    # so the exchange is in flight exactly when evaluation is due (the demo's schedule, smaller).
    spec = SwarmSpec(
        model="gpt-tiny",
        optimizer=optimizer,
        steps=20,
        H=10,
        fragments=2,
        eval_every=10,
        eval_batches=2,
        outer_lr=1.0 if optimizer == "sparseloco" else 0.7,
    )
    t = Trainer(spec, LocalSwarm(1).member(0), "p")
    await train(t, 20)
    evals = [h["eval_loss"] for h in t.info.history if h["eval_loss"] is not None]
    assert [h["step"] for h in t.info.history if h["eval_loss"] is not None] == [10, 20]
    assert all(math.isfinite(e) for e in evals) and t.info.eval_loss == evals[-1]


async def test_resume_from_a_checkpoint_on_disk_trains_the_same_samples_bit_exactly(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl")
    spec = SwarmSpec(
        model="gpt-tiny",
        dataset=str(data),
        dataset_digest=dataset_digest(data),
        steps=30,
        H=5,
        eval_every=0,
        batch_size=4,
    )
    trained: dict[str, list[tuple[int, list[int]]]] = {"straight": [], "resumed": []}

    def recording(t: Trainer, log: list) -> Trainer:
        batch = t.batch

        def recorded(step: int):
            ids = t.corpus.sample_ids(spec.data.batch_size, t.context, seed=spec.seed, peer=t.peer_id, step=step)
            log.append((step, ids.tolist()))
            return batch(step)

        t.batch = recorded  # type: ignore[method-assign]
        return t

    straight = recording(Trainer(spec, LocalSwarm(1).member(0), "peer-a", data_dir=tmp_path / "a"), trained["straight"])
    await train(straight, 30)

    store = CheckpointStore(tmp_path / "ckpt")
    first = recording(Trainer(spec, LocalSwarm(1).member(0), "peer-a", data_dir=tmp_path / "b"), trained["resumed"])

    def save_at_10(t: Trainer) -> None:
        if t.step == 10:
            store.save(t.checkpoint_state(), step=t.step, round=t.outer.rounds)

    await train(first, 14, save_at_10)  # then "killed": steps 11..14 are not in the checkpoint
    ckpt = store.load_latest()
    assert ckpt is not None and ckpt.state["data"]["step"] == 10
    assert ckpt.state["data"]["digest"] == first.corpus.digest
    del trained["resumed"][10:]  # what the lost steps trained is lost with them
    resumed = recording(Trainer(spec, LocalSwarm(1).member(0), "peer-a", data_dir=tmp_path / "b"), trained["resumed"])
    resumed.load_checkpoint(ckpt.state)
    await train(resumed, 30)
    assert trained["resumed"] == trained["straight"]  # the same (step, samples), none twice, none skipped
    for (n, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


async def test_a_checkpoint_of_other_data_is_refused(tmp_path):
    a, b = write_jsonl(tmp_path / "a.jsonl"), write_jsonl(tmp_path / "b.jsonl", 300)
    t = Trainer(
        SwarmSpec(model="gpt-tiny", dataset=str(a), eval_every=0), LocalSwarm(1).member(0), "p", data_dir=tmp_path
    )
    await train(t, 5)
    other = Trainer(
        SwarmSpec(model="gpt-tiny", dataset=str(b), eval_every=0), LocalSwarm(1).member(0), "p", data_dir=tmp_path
    )
    with pytest.raises(ConfigError, match="other data"):
        other.load_checkpoint(t.checkpoint_state())


def test_a_peer_whose_dataset_differs_from_the_spec_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "corpus.jsonl")
    spec = SwarmSpec(model="gpt-tiny", dataset=str(data), dataset_digest=dataset_digest(data))
    Trainer(spec, LocalSwarm(1).member(0), "p", data_dir=tmp_path)  # the same files: accepted
    with open(data, "a") as f:
        f.write(json.dumps({"text": "one more record"}) + "\n")
    with pytest.raises(ConfigError, match=r"dataset .*corpus\.jsonl: the local files differ"):
        Trainer(spec, LocalSwarm(1).member(0), "p", data_dir=tmp_path)


@pytest.mark.slow
def test_cli_pins_the_dataset_and_a_node_with_other_files_is_refused_in_one_line(tmp_path):
    from .test_node_cli import LOOPBACK, cli, create

    data = write_jsonl(tmp_path / "corpus.jsonl")
    create(tmp_path / "a", "--model", "gpt-tiny", "--dataset", str(data))
    spec = json.loads((tmp_path / "a" / "swarm.json").read_text())["spec"]
    assert spec["data"]["dataset_digest"] == dataset_digest(data)
    write_jsonl(data, 399)
    r = cli("node", "start", "--data-dir", str(tmp_path / "a"), *LOOPBACK)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    # The node is up (status page, daemon.json) before it digests its data in a worker thread
    # (node/daemon.py, "Start-up never freezes the node"): its start line, then the one-line error.
    assert all("node started" in line for line in lines[:-1]) and len(lines) <= 2, r.stderr
    assert "corpus.jsonl: the local files differ from the swarm's" in lines[-1]


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    """A node training on a JSONL dataset is SIGKILLed once it has a checkpoint, restarted, and
    finishes: its outer parameters equal, bit for bit, those of one uninterrupted run of the same
    peer id — it trained the same samples at the same steps, none twice, none skipped."""
    import os
    import signal
    import time

    from .test_node_cli import create, finish, phi, start

    data = write_jsonl(tmp_path / "corpus.jsonl")
    a, b = tmp_path / "a", tmp_path / "b"
    create(
        a,
        "--model",
        "gpt-tiny",
        "--dataset",
        str(data),
        "--steps",
        "150",
        "--H",
        "10",
        "--eval-every",
        "0",
        "--batch-size",
        "8",
    )
    b.mkdir()
    for name in ("identity.key", "swarm.json"):
        (b / name).write_bytes((a / name).read_bytes())
    os.chmod(b / "identity.key", 0o600)
    log, log_b = tmp_path / "a.log", tmp_path / "b.log"
    # The uninterrupted reference run (its own data dir; a lone node, like a) trains meanwhile,
    # on the other core: one node uses one thread.
    straight_proc = start("--data-dir", str(b), log=log_b)
    try:
        proc = start("--data-dir", str(a), "--checkpoint-every", "0.3", log=log)
        deadline = time.monotonic() + 60
        while not (a / "checkpoints" / "LATEST").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)  # sleep: poll interval
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = CheckpointStore(a / "checkpoints").load_latest()
        assert killed_at is not None and 0 < killed_at.step < 150
        assert killed_at.state["data"]["step"] == killed_at.step
        resumed = finish(start("--data-dir", str(a), log=log), log)
        assert resumed["step"] == 150 and "resumed from checkpoint" in log.read_text()
        straight = finish(straight_proc, log_b)
    finally:
        if straight_proc.poll() is None:
            straight_proc.kill()
            straight_proc.wait()
    assert straight["step"] == 150
    pa, pb = phi(a), phi(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
