"""A `transformers.Trainer` script as a meshtrain swarm peer: three added lines (marked below).

The first peer creates the swarm and prints its address; the others join it:

    python examples/hf_trainer.py --output_dir /tmp/a --max_steps 200 --create
    python examples/hf_trainer.py --output_dir /tmp/b --max_steps 200 --join /ip4/127.0.0.1/tcp/.../p2p/12D3Koo...

`MeshtrainArguments` is parsed beside `TrainingArguments` (`--H 50`, `--listen ...`,
`--wait_peers 2`: `--help` lists them). Everything else is an ordinary Trainer script: here a tiny
LLaMA built from a config (no download) on byte-level text from Python's own docs, so it runs
offline; put your own model and dataset in their place.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from meshtrain.integrations.hf import MeshtrainArguments, MeshtrainCallback  # (1)
from meshtrain.models import Corpus
from meshtrain.node.state.parity import phi_digest


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)  # every peer starts from the same weights (a joiner downloads φ anyway)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def byte_text(n: int = 512, context: int = 64) -> list[dict[str, torch.Tensor]]:
    x, _ = Corpus.default("bytes").batch(n, context, seed=0, peer="dataset", step=0)
    return [{"input_ids": row, "labels": row} for row in x]  # HF shifts the labels itself


class ShowAddress(TrainerCallback):
    """Prints the address other peers join (a test reads it); not needed to train."""

    def __init__(self, mesh: MeshtrainCallback) -> None:
        self.mesh = mesh

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        assert self.mesh.swarm is not None
        print(json.dumps({"addr": self.mesh.swarm.addrs[0], "status": self.mesh.swarm.status_url}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser((TrainingArguments, MeshtrainArguments))
    args, mesh = parser.parse_args_into_dataclasses(argv)
    model = tiny_llama(args.seed)
    callback = MeshtrainCallback(mesh)  # (2)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=byte_text(),
        callbacks=[callback, ShowAddress(callback)],  # (3)
    )
    trainer.train()
    assert callback.result is not None and callback.outer is not None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(
        json.dumps(
            {
                "step": callback.result.step,
                "rounds": callback.result.rounds,
                "contributors": [r.contributors for r in callback.outer.history],
                "phi_digest": phi_digest(callback.outer.outer_params).hex(),
                "losses": losses,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
