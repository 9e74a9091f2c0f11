"""A plain PyTorch loop (optionally under Accelerate, or torchrun) on a meshtrain swarm through `SwarmOptimizer`.

The first peer creates the swarm and prints its address; the others join it:

    python examples/swarm_optimizer.py --data-dir /tmp/a --create
    python examples/swarm_optimizer.py --data-dir /tmp/b --join /ip4/127.0.0.1/tcp/.../p2p/12D3Koo...
    torchrun --nproc-per-node 2 examples/swarm_optimizer.py --data-dir /tmp/c --join /ip4/...

The loop is an ordinary one: an AdamW, a cosine LR schedule, `backward`, `step`, `zero_grad`.
`SwarmOptimizer` wraps the AdamW and runs the swarm's outer optimizer (the one its spec names)
inside `step()`. `--accelerate` prepares the model and the AdamW with `accelerate.Accelerator`
first and wraps the prepared optimizer (the order docs/guide.md explains). Under torchrun the
ranks are one peer: rank 0 joins the swarm, every rank trains its rows of the step's batch under
DDP, and the machine's Δ goes to the swarm once. A tiny LLaMA from a config (no download) on
byte-level text from Python's own docs: it runs offline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshtrain
from meshtrain.models import Corpus
from meshtrain.node.state.parity import phi_digest


def tiny_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
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
    who.add_argument("--open", action="store_true", help="rejoin the swarm of --data-dir, from its checkpoint")
    ap.add_argument("--steps", type=int, default=100, help="the swarm's steps (with --create)")
    ap.add_argument("--until", type=int, default=0, help="leave at this swarm step (default: the swarm's end)")
    ap.add_argument("--H", type=int, default=20, help="inner steps per outer round")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--wait-peers", type=int, default=0, help="start once this many peers train")
    ap.add_argument("--accelerate", action="store_true", help="prepare model and optimizer with Accelerate")
    args = ap.parse_args(argv)

    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun sets it
    if ranks > 1:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank() if ranks > 1 else 0
    if ranks > 1 and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

    swarm = None
    if rank == 0:  # the machine's peer; under torchrun the other ranks reach the swarm through it
        options = {"listen": [args.listen], "status_port": 0, "nat": False, "wait_peers": args.wait_peers}
        if args.create:
            spec = meshtrain.SwarmSpec(name="swarm-optimizer", model="user", H=args.H, steps=args.steps, batch_size=8)
            swarm = meshtrain.Swarm.create(spec, data_dir=args.data_dir, **options)
        elif args.open:
            swarm = meshtrain.Swarm.open(args.data_dir, **options)
        else:
            swarm = meshtrain.Swarm.join(args.join, data_dir=args.data_dir, **options)
        print(json.dumps({"addr": swarm.addrs[0], "status": swarm.status_url}), flush=True)

    corpus = Corpus.default("bytes")
    model = tiny_llama(0)  # every peer and rank starts from the same weights
    if torch.cuda.is_available():
        model = model.cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    unwrapped = model
    if args.accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=not torch.cuda.is_available())
        model, inner = accelerator.prepare(model, inner)  # prepare first, then wrap
        unwrapped = accelerator.unwrap_model(model)
    elif ranks > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    losses = []
    try:
        opt = meshtrain.SwarmOptimizer(inner, swarm, model=unwrapped)  # the parameter names are the swarm's
        spec = opt.spec
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=spec.steps)
        until = min(args.until or spec.steps, spec.steps)
        while opt.swarm_step < until:
            x, _ = corpus.batch(spec.data.batch_size, 64, seed=spec.seed, peer=opt.peer_id, step=opt.swarm_step)
            x = x[rank::ranks].to(next(unwrapped.parameters()).device)  # this rank's rows
            loss = model(input_ids=x, labels=x).loss  # HF shifts the labels itself
            loss.backward()
            opt.step()
            schedule.step()
            opt.zero_grad()
            losses.append(loss.item())
            if swarm is not None and opt.swarm_step % 10 == 0:
                swarm.report(loss=loss.item())
        opt.close()
        digest = phi_digest(opt.outer.outer_params).hex()
        digests = [digest]
        if ranks > 1:  # every rank's φ, for rank 0's result line
            digests = [None] * ranks
            torch.distributed.all_gather_object(digests, digest)
    finally:
        result = swarm.leave() if swarm is not None else None
    if rank == 0:
        assert result is not None
        print(
            json.dumps(
                {
                    "step": result.step,
                    "rounds": result.rounds,
                    "contributors": [r.contributors for r in opt.outer.history],
                    "phi_digest": digest,
                    "rank_digests": digests,
                    "losses": losses,
                }
            ),
            flush=True,
        )
    if ranks > 1:
        # DDP's reducer before the process group: freed after it, it drops the group's last
        # reference holding the GIL, and torch's gloo teardown can then deadlock at exit.
        del model
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
