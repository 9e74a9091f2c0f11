"""A plain PyTorch loop (optionally under Accelerate) on a meshtrain swarm through `SwarmOptimizer`.

The first peer creates the swarm and prints its address; the others join it:

    python examples/swarm_optimizer.py --data-dir /tmp/a --create
    python examples/swarm_optimizer.py --data-dir /tmp/b --join /ip4/127.0.0.1/tcp/.../p2p/12D3Koo...

The loop is an ordinary one: an AdamW, a cosine LR schedule, `backward`, `step`, `zero_grad`.
`SwarmOptimizer` wraps the AdamW and runs the swarm's outer optimizer (the one its spec names)
inside `step()`. `--accelerate` prepares the model and the AdamW with `accelerate.Accelerator`
first and wraps the prepared optimizer (the order docs/guide.md explains). A tiny LLaMA from a
config (no download) on byte-level text from Python's own docs: it runs offline.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshtrain
from meshtrain.models import Corpus
from meshtrain.node.state.parity import phi_digest


def tiny_llama(seed: int) -> torch.nn.Module:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    who = ap.add_mutually_exclusive_group(required=True)
    who.add_argument("--create", action="store_true", help="create the swarm (the first peer)")
    who.add_argument("--join", metavar="MULTIADDR", help="join the swarm of the peer at MULTIADDR")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--H", type=int, default=20, help="inner steps per outer round")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--wait-peers", type=int, default=0, help="start once this many peers train")
    ap.add_argument("--accelerate", action="store_true", help="prepare model and optimizer with Accelerate")
    args = ap.parse_args(argv)

    options = {"listen": [args.listen], "status_port": 0, "nat": False, "wait_peers": args.wait_peers}
    if args.create:
        spec = meshtrain.SwarmSpec(name="swarm-optimizer", model="user", H=args.H, steps=args.steps, batch_size=8)
        swarm = meshtrain.Swarm.create(spec, data_dir=args.data_dir, **options)
    else:
        swarm = meshtrain.Swarm.join(args.join, data_dir=args.data_dir, **options)
    print(json.dumps({"addr": swarm.addrs[0], "status": swarm.status_url}), flush=True)

    corpus = Corpus.default("bytes")
    model = tiny_llama(swarm.spec.seed)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    unwrapped = model
    if args.accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=not torch.cuda.is_available())
        model, inner = accelerator.prepare(model, inner)  # prepare first, then wrap
        unwrapped = accelerator.unwrap_model(model)
    losses = []
    with swarm:
        opt = meshtrain.SwarmOptimizer(inner, swarm, model=unwrapped)  # the parameter names are the swarm's
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
        while swarm.step < swarm.spec.steps:
            x, _ = corpus.batch(
                swarm.spec.data.batch_size, 64, seed=swarm.spec.seed, peer=swarm.peer_id, step=swarm.step
            )
            x = x.to(next(unwrapped.parameters()).device)
            loss = model(input_ids=x, labels=x).loss  # HF shifts the labels itself
            loss.backward()
            opt.step()
            schedule.step()
            opt.zero_grad()
            losses.append(loss.item())
            if swarm.step % 10 == 0:
                swarm.report(loss=loss.item())
        result = swarm.leave()
    assert result is not None
    print(
        json.dumps(
            {
                "step": result.step,
                "rounds": result.rounds,
                "contributors": [r.contributors for r in opt.outer.history],
                "phi_digest": phi_digest(opt.outer.outer_params).hex(),
                "losses": losses,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
