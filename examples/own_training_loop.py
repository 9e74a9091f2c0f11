"""Your own training loop on a meshtrain swarm: a tiny LLaMA-family model from `transformers`.

The first peer creates the swarm and prints its address; the others join it:

    python examples/own_training_loop.py --data-dir /tmp/a --create
    python examples/own_training_loop.py --data-dir /tmp/b --join /ip4/127.0.0.1/tcp/.../p2p/12D3Koo...

Everything that is not the loop — NAT traversal, membership, the fault-tolerant all-reduce, late
joining, parity, checkpoints, the status page — is the `Swarm`'s. Here the model is built
locally from a config (no download) and the data is byte-level text from Python's own docs, so
the example runs offline; put your own model and loader in their place.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshtrain
from meshtrain.models import Corpus


def tiny_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # every peer starts from the same weights (a joiner downloads φ anyway)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    who = ap.add_mutually_exclusive_group(required=True)
    who.add_argument("--create", action="store_true", help="create the swarm (the first peer)")
    who.add_argument("--join", metavar="MULTIADDR", help="join the swarm of the peer at MULTIADDR")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--H", type=int, default=20, help="inner steps per outer round")
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--wait-peers", type=int, default=0, help="start once this many peers train")
    args = ap.parse_args(argv)

    options = {"listen": [args.listen], "status_port": 0, "nat": False, "wait_peers": args.wait_peers}
    if args.create:
        spec = meshtrain.SwarmSpec(name="own-loop", model="user", H=args.H, steps=args.steps, batch_size=8)
        swarm = meshtrain.Swarm.create(spec, data_dir=args.data_dir, **options)
    else:
        swarm = meshtrain.Swarm.join(args.join, data_dir=args.data_dir, **options)
    print(json.dumps({"addr": swarm.addrs[0], "status": swarm.status_url}), flush=True)

    corpus = Corpus.default("bytes")
    model = tiny_llama(swarm.spec.seed)
    with swarm:
        opt = meshtrain.DiLoCo(
            model,
            torch.optim.AdamW(model.parameters(), lr=swarm.spec.outer.inner_lr),
            swarm,
            H=swarm.spec.outer.H,
            lr=swarm.spec.outer.outer_lr,
            momentum=swarm.spec.outer.outer_momentum,
        )
        while swarm.step < args.steps:
            x, y = corpus.batch(
                swarm.spec.data.batch_size, 64, seed=swarm.spec.seed, peer=swarm.peer_id, step=swarm.step
            )
            loss = model(input_ids=x, labels=x).loss  # HF shifts the labels itself
            loss.backward()
            opt.step()
            opt.zero_grad()
            if swarm.step % 10 == 0:
                swarm.report(loss=loss.item())
        result = swarm.leave()
    assert result is not None
    print(
        json.dumps(
            {
                "step": result.step,
                "rounds": result.rounds,
                "checkpoint": result.checkpoint,
                "contributors": [r.contributors for r in opt.history],
                "phi_digest": meshtrain_phi_digest(opt),
            }
        ),
        flush=True,
    )
    return 0


def meshtrain_phi_digest(opt: meshtrain.OuterOptimizer) -> str:
    from meshtrain.node.state.parity import phi_digest

    return phi_digest(opt.outer_params).hex()


if __name__ == "__main__":
    sys.exit(main())
