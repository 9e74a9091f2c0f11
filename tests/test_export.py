"""Getting the trained model out: `meshtrain export` writes φ (the outer parameters of the
latest checkpoint, not the replica θ) as a standalone model, and `meshtrain sample` continues a
prompt with it.

The end-to-end test is a user's whole path: a 2-peer swarm created through the CLI trains a
pretrained tiny LLaMA (hf:<dir>) with a BPE tokenizer (hf:<dir>) trained on the built-in corpus (the
dataset is the built-in text, tokenised with that BPE); its export loads with
`AutoModelForCausalLM.from_pretrained` and gives φ's logits; peers whose local tokenizer or
model config differ from the swarm's are refused, naming which. Every peer runs in its own
working directory and the spec names the model by a relative path, as peers on different
machines would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import trio

from meshtrain.collective import LocalSwarm
from meshtrain.models import GPT, GPTConfig
from meshtrain.node.export import export_model, generate, load_trained
from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.node.trainer import Trainer
from meshtrain.transport.identity import Identity

from .conftest import ROOT
from .test_node_cli import finish, wait_daemon
from .tiny_hf import FACTORY, save_tiny_llama, train_bpe

LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status-port", "0", "--threads", "1", "--no-nat"]
ENV = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    PYTHONUNBUFFERED="1",
    OMP_NUM_THREADS="1",
)


def cli(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.node.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def trained_node(data_dir: Path, spec: SwarmSpec, steps: int) -> Trainer:
    """A node's data dir as the daemon leaves it (swarm.json, a checkpoint), trained in-process."""
    signed = SignedSpec.create(spec, Identity.load_or_create(data_dir))
    signed.save(data_dir / "swarm.json")
    trainer = Trainer(signed.spec, LocalSwarm(1).member(0), "peer-a")

    async def train() -> None:
        async with trainer.outer:
            await trio.to_thread.run_sync(trainer.run, threading.Event(), steps, lambda _t: None)

    trio.run(train)
    CheckpointStore(data_dir / "checkpoints").save(
        trainer.checkpoint_state(), step=trainer.step, round=trainer.outer.rounds
    )
    return trainer


def test_builtin_gpt_exports_phi_not_theta_and_samples(tmp_path):
    # 12 steps with H 5: θ is two inner steps past φ, so φ and θ differ at the checkpoint.
    trainer = trained_node(tmp_path / "d", SwarmSpec(model="gpt-tiny", H=5, steps=12, eval_every=0, batch_size=4), 12)
    phi = trainer.outer.outer_params
    assert any(not torch.equal(p.detach(), phi[n]) for n, p in trainer.model.named_parameters())
    info = export_model(tmp_path / "d", tmp_path / "out")
    assert info["step"] == 12 and info["round"] == 2 and info["context"] == 32
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    from safetensors.torch import load_model

    model = GPT(GPTConfig(**config["gpt_config"]))
    load_model(model, str(tmp_path / "out" / "model.safetensors"))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), phi[n]), n
    note = json.loads((tmp_path / "out" / "meshtrain_tokenizer.json").read_text())
    assert note["kind"] == "chars" and len(note["chars"]) == config["gpt_config"]["vocab_size"]
    # Sampling: greedy is deterministic, top-k draws from the seeded generator; both are text.
    trained = load_trained(tmp_path / "d")
    greedy = generate(trained, "The ", max_new_tokens=20)
    assert len(greedy) == 20 and greedy == generate(trained, "The ", max_new_tokens=20)
    assert len(generate(trained, "The ", max_new_tokens=20, top_k=5, seed=1)) == 20
    r = cli("sample", "--data-dir", str(tmp_path / "d"), "--prompt", "The ", "--max-new-tokens", "20")
    assert r.returncode == 0 and r.stdout == "The " + greedy + "\n", r.stderr


def test_a_model_past_the_shard_size_exports_in_shards_with_the_hubs_index(tmp_path, monkeypatch):
    """Weights past `EXPORT_SHARD_SIZE` (5 GB; here 64 KB) go out in shards with
    model.safetensors.index.json, as the Hugging Face Hub lays a model out; they load back whole."""
    from huggingface_hub import load_torch_model

    import meshtrain.node.export as export

    trainer = trained_node(tmp_path / "d", SwarmSpec(model="gpt-tiny", H=2, steps=2, eval_every=0, batch_size=4), 2)
    monkeypatch.setattr(export, "EXPORT_SHARD_SIZE", 64 << 10)
    export_model(tmp_path / "d", tmp_path / "out")
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert not (out / "model.safetensors").exists()
    model = GPT(GPTConfig(**json.loads((out / "config.json").read_text())["gpt_config"]))
    load_torch_model(model, out)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), trainer.outer.outer_params[n]), n


def test_py_factory_round_trips_through_export(tmp_path):
    source = tmp_path / "mymodel.py"
    source.write_text(FACTORY)
    spec = SwarmSpec(
        model=f"py:{source}:make", tokenizer="bytes", H=4, steps=8, eval_every=0, batch_size=4, inner_lr=0.05
    )
    trainer = trained_node(tmp_path / "d", spec, 8)
    assert trainer.context == 16  # the model's own `context`
    info = export_model(tmp_path / "d", tmp_path / "out")
    assert info["model_digest"].startswith("source=")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["factory"] == spec.model.source and config["vocab_size"] == 256
    from safetensors.torch import load_model

    from meshtrain.models.sources import build_model

    rebuilt = build_model(config["factory"], vocab_size=config["vocab_size"], seed=99)
    load_model(rebuilt, str(tmp_path / "out" / "model.safetensors"))
    for n, p in rebuilt.named_parameters():
        assert torch.equal(p.detach(), trainer.outer.outer_params[n]), n
    assert isinstance(generate(load_trained(tmp_path / "d"), "ab", max_new_tokens=5), str)
    r = cli("export", "--data-dir", str(tmp_path / "d"), "--out", "/proc/no/out")  # a place nothing can be written
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (
        r.stderr.strip().splitlines()[-1]
        == "meshtrain: error: cannot export into /proc/no/out: No such file or directory (--out chooses another)"
    )
    # The factory's file changed after the swarm was created: export refuses, naming the model.
    source.write_text(FACTORY + "\n# edited\n")
    r = cli("export", "--data-dir", str(tmp_path / "d"), "--out", str(tmp_path / "out2"))
    assert r.returncode == 2 and "model: your py:" in r.stderr and "source digest" in r.stderr, r.stderr
    assert not (tmp_path / "out2").exists()


def test_export_and_sample_mistakes_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    r = cli("export", "--data-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "not a meshtrain node's data dir" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    d = tmp_path / "d"
    SignedSpec.create(SwarmSpec(model="gpt-tiny"), Identity.load_or_create(d)).save(d / "swarm.json")
    r = cli("sample", "--data-dir", str(d), "--prompt", "x")
    assert r.returncode == 2 and "no checkpoint" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    r = cli("export", "--data-dir", str(d), "--out", str(tmp_path / "full"))
    assert r.returncode == 2 and "not an empty directory" in r.stderr
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


# -- end to end: create, train, export, load with transformers -----------------------------------


def write_jsonl(path: Path, skip: int = 0) -> Path:
    """A small JSONL dataset of the built-in corpus's paragraphs, one document a line."""
    from meshtrain.models.corpus import Corpus

    text = Corpus.default("bytes").vocab.decode(Corpus.default("bytes").train[:200_000])
    docs = [d for d in text.split("\n\n") if d.strip()][skip:]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def start(home: Path, *args: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as err:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshtrain.node.cli",
                "--log-level",
                "INFO",
                "node",
                "start",
                "--data-dir",
                "data",
                *LOOPBACK,
                "--quiet",
                *args,
            ],
            cwd=home,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=ENV,
        )


@pytest.mark.slow
def test_two_peers_train_a_pretrained_llama_export_loads_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    homes = {n: tmp_path / n for n in ("a", "b", "other_tokenizer", "other_config", "other_data")}
    save_tiny_llama(homes["a"] / "llama")
    train_bpe(homes["a"] / "bpe")
    write_jsonl(homes["a"] / "corpus.jsonl")
    for name in ("b", "other_tokenizer", "other_config", "other_data"):
        shutil.copytree(homes["a"], homes[name])
    write_jsonl(homes["other_data"] / "corpus.jsonl", skip=1)
    shutil.rmtree(homes["other_tokenizer"] / "bpe")
    train_bpe(homes["other_tokenizer"] / "bpe", vocab_size=280)
    shutil.rmtree(homes["other_config"] / "llama")
    save_tiny_llama(homes["other_config"] / "llama", rms_norm_eps=1e-5)

    r = cli(
        "swarm",
        "create",
        "--data-dir",
        "data",
        "--model",
        "hf:llama",
        "--tokenizer",
        "hf:bpe",
        "--dataset",
        "corpus.jsonl",
        "--steps",
        "12",
        "--H",
        "6",
        "--batch-size",
        "4",
        "--context",
        "32",
        "--eval-every",
        "0",
        cwd=homes["a"],
    )
    assert r.returncode == 0, r.stderr
    spec = json.loads((homes["a"] / "data" / "swarm.json").read_text())["spec"]
    assert spec["model"]["digest"].startswith("config=") and ",weights=" in spec["model"]["digest"]
    logs = {n: tmp_path / f"{n}.log" for n in homes}
    pa = start(homes["a"], "--wait-peers", "2", log=logs["a"])
    addr = wait_daemon(homes["a"] / "data", pa, logs["a"])["addrs"][0]
    pb = start(homes["b"], "--join", addr, "--wait-peers", "2", log=logs["b"])
    # Peers whose local files differ from the swarm's pins are refused, naming which differs.
    needles = {
        "other_tokenizer": "tokenizer: your hf:bpe differs from the swarm's (tokenizer digest",
        "other_config": "model: your hf:llama differs from the swarm's (config digest",
        "other_data": "dataset corpus.jsonl: the local files differ from the swarm's",
    }
    refused = {}
    for name in needles:  # all three at once: each is a process start-up, then one line
        # The swarm's signed spec, as `swarm join` would fetch it (a file: no race with the swarm's
        # end, 12 steps away), checked against this peer's own files before anything else.
        shutil.copy(homes["a"] / "data" / "swarm.json", homes[name] / "swarm.json")
        refused[name] = start(homes[name], "--swarm", "swarm.json", log=logs[name])
    for name, proc in refused.items():
        try:
            proc.communicate(timeout=120)
        finally:
            proc.kill()
        err = logs[name].read_text()
        assert proc.returncode == 2 and needles[name] in err, err[-3000:]
        assert "Traceback" not in err and not (homes[name] / "data" / "checkpoints").exists()
    ra, rb = finish(pa, logs["a"]), finish(pb, logs["b"])
    assert ra["step"] == rb["step"] == 12 and ra["rounds"] == rb["rounds"] == 2

    r = cli("export", "--data-dir", "data", "--out", "exported", cwd=homes["a"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 12
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(homes["a"] / "exported"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(homes["a"] / "exported"))
    # φ, independently: the pretrained θ0 with the checkpoint's outer parameters written over it.
    ckpt = CheckpointStore(homes["a"] / "data" / "checkpoints").load_latest()
    phi = {n.removeprefix("inner."): t for n, t in ckpt.state["outer"]["outer_params"].items()}
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(homes["a"] / "llama"))
    ids = torch.tensor([tokenizer.encode("The with statement is used to wrap")])
    with torch.no_grad():
        before = reference(input_ids=ids).logits
        for n, p in reference.named_parameters():
            p.copy_(phi[n])
        want, got = reference(input_ids=ids).logits, exported(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()
    assert not torch.allclose(before, want), "12 steps of training must have moved φ from θ0"
    r = cli("sample", "--data-dir", "data", "--prompt", "The with statement", "--max-new-tokens", "8", cwd=homes["a"])
    assert r.returncode == 0 and r.stdout.startswith("The with statement") and len(r.stdout) > 20, r.stderr
