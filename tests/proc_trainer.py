"""A real training peer in its own process: host, data plane, `SwarmCollective`, the char GPT, an
inner AdamW and one outer optimizer, with torch in a worker thread (the threading bridge).

    python tests/proc_trainer.py --method diloco --index I --steps S [--H 25] [...]

Model and data: by default the char GPT (`--model`) on the built-in corpus (`Corpus.default()`).
`--text-data DIR` trains what scripts/bench/bench_convergence.py --text wrote to DIR instead:
`config.json` (a transformers config, built with fresh weights from `--seed` as an hf-config:
model, `models.sources.build_model`; its max_position_embeddings is the context), `tokenizer.json`
(a `tokenizers` BPE) and `tokens.pt` ({"train", "held_out", "source"}: token ids split by document
in the parent, so the four peers do not each tokenise; `Corpus.from_parts`).

Inner lr: constant, or with `--cosine` a cosine from lr down to lr/10 at the last step, after
`--warmup W` steps of linear warm-up (lr·(s+1)/W at step s; W = 0: none).

`--init FILE`: start from these weights (what `--save-phi` wrote: a name -> tensor dict of the
model's parameters) instead of fresh ones: bench_convergence.py --text --warm-start.

Methods: single (plain AdamW, no exchange), dp (gradients all-reduced every step), diloco,
heavyball (DiLoCo without Nesterov), streaming (--eager: eager updates), noloco, sparseloco,
custom (docs/guide.md's `OuterSGD`, below).

Protocol on stdio (one JSON object per line), as tests/proc_allreduce.py:
  out {"peer": id, "addr": multiaddr, "index": I}
  in  a JSON list of every peer's multiaddr; we connect to all
  out {"ready": true}
  in  "go"
  out {"eval": step, "loss": x}          every --eval-every steps, on the outer parameters φ
  out {"done": true, "final_eval_loss": x, "stats": {...}, "wall_s": s, "phi_digest": hex,
       "contributors": [per exchange], "errors": [...]}

Fault: the process whose rank among the sorted peer ids is --victim-rank SIGKILLs itself 30 ms
into its first data-plane send of the exchange sent at inner step --kill-at-step (mid-round).
Membership is "the peers we are still connected to", so survivors stop expecting a dead peer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time

import blake3
import torch
import trio

from meshtrain.collective import AllReduceConfig, SwarmCollective
from meshtrain.log import configure, get_logger, kv
from meshtrain.models import GPT, Corpus, GPTConfig
from meshtrain.models.sources import build_model, loss_of, resolve_context
from meshtrain.models.tokenizers import load_tokenizer
from meshtrain.optim import (
    DataParallel,
    DiLoCo,
    NoLoCo,
    OuterOptimizer,
    SparseLoCo,
    StreamingDiLoCo,
)
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity
from meshtrain.transport.tensor_streams import TensorStreams


# --- docs/guide.md's custom outer optimizer (≤ 30 lines) ----------------------------------------
class OuterSGD(OuterOptimizer):
    """Outer SGD without momentum: φ ← φ − lr·mean(Δ), then θ ← φ (lr 1 is FedAvg)."""

    def __init__(self, model, inner, collective, *, H, lr=1.0, codec="none"):
        super().__init__(model, inner, collective, H=H, codec=codec)
        self.lr = lr

    def apply(self, result, names):  # result.tensors[n]: the peers' mean of Δ = φ − θ
        for n in names:
            self.outer_params[n].sub_(result.tensors[n], alpha=self.lr)


class OuterAdam(OuterOptimizer):
    """Adam on the averaged pseudo-gradient; the base class saves its state in state_dict()."""

    def __init__(self, model, inner, collective, *, H, lr=1e-2, codec="none"):
        super().__init__(model, inner, collective, H=H, codec=codec)
        self.lr = lr

    def build_outer_optimizer(self, params):
        return torch.optim.Adam(params, lr=self.lr, betas=(0.9, 0.95))


# -------------------------------------------------------------------------------------------------


log = get_logger("proc_trainer")


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = blake3.blake3()
    for n in sorted(tensors):
        h.update(n.encode())
        h.update(tensors[n].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def build(args: argparse.Namespace, model: torch.nn.Module, inner: torch.optim.Optimizer, col):
    m, H = args.method, args.H
    if m == "dp":
        return DataParallel(model, inner, col, clip=args.clip)
    if m == "diloco":
        return DiLoCo(model, inner, col, H=H, lr=args.outer_lr, momentum=args.outer_momentum, codec=args.codec)
    if m == "heavyball":
        return DiLoCo(
            model, inner, col, H=H, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=False, codec=args.codec
        )
    if m == "streaming":
        return StreamingDiLoCo(
            model,
            inner,
            col,
            H=H,
            fragments=args.P,
            delay=args.delay,
            alpha=args.alpha,
            codec=args.codec if args.codec != "none" else "fp4",
            lr=args.outer_lr,
            momentum=args.outer_momentum,
            eager=args.eager,
        )
    if m == "sparseloco":
        return SparseLoCo(
            model,
            inner,
            col,
            H=H,
            lr=args.outer_lr,
            beta=args.error_decay,
            chunk=args.sparse_chunk,
            k=args.sparse_k,
            vector_k=None if args.vector_k < 0 else args.vector_k,
            aggregation=args.aggregation,
            aggregate=args.aggregate,
        )
    if m == "noloco":
        return NoLoCo(
            model,
            inner,
            col,
            H=H,
            lr=args.noloco_lr,
            gamma=args.noloco_lr,
            momentum=args.noloco_momentum,
            codec=args.codec,
        )
    if m == "custom":
        return OuterSGD(model, inner, col, H=H, lr=args.custom_lr, codec=args.codec)
    if m == "custom_adam":
        return OuterAdam(model, inner, col, H=H, lr=args.custom_lr, codec=args.codec)
    raise SystemExit(f"unknown method {m}")


def install_fault(ts: TensorStreams, col: SwarmCollective, step: int) -> None:
    """SIGKILL ourselves 30 ms into the first send of the exchange sent at inner step `step` (for
    SparseLoCo: into the first send of our sparse payload, before the agreement all-reduce)."""
    armed = {"on": False}
    real_send, real_ar, real_pair = ts.send, col.all_reduce, col.average_with

    async def send(peer, tag, tensors, **kw):
        if armed["on"] or tag.startswith(f"sg/{step}/"):  # sg/: a sparse all-gather's payload
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: real_send(peer, tag, tensors, **kw))
                await trio.sleep(0.03)  # sleep: the kill lands 30 ms into the send (fault injection)
                os.kill(os.getpid(), signal.SIGKILL)
        return await real_send(peer, tag, tensors, **kw)

    async def all_reduce(request):
        armed["on"] = request.round_id == step
        return await real_ar(request)

    async def average_with(partner, request):
        armed["on"] = request.round_id == step
        return await real_pair(partner, request)

    ts.send, col.all_reduce, col.average_with = send, all_reduce, average_with


def model_config(name: str, vocab_size: int) -> GPTConfig:
    """`--model`: tiny and small are the presets; medium (4 blocks, d 128, context 64: 0.8M
    parameters) has a CPU step of ~80 ms on one core, long beside a round's fixed cost of control
    messages (scripts/bench/bench_wan.py's overlap comparison), and 4 blocks for Streaming DiLoCo's P = 4."""
    if name == "medium":
        return GPTConfig(vocab_size, n_layer=4, n_head=4, d_model=128, context=64)
    return GPTConfig.small(vocab_size) if name == "small" else GPTConfig.tiny(vocab_size)


def model_and_corpus(args: argparse.Namespace) -> tuple[torch.nn.Module, Corpus, int]:
    """(model, corpus, context): the char GPT on the built-in corpus, or --text-data's LLaMA and
    tokenised text (module docstring)."""
    if not args.text_data:
        corpus = Corpus.default()
        config = model_config(args.model, corpus.vocab_size)
        return GPT(config, seed=args.seed), corpus, config.context
    tokenizer = load_tokenizer(f"hf:{args.text_data}/tokenizer.json")
    parts = torch.load(f"{args.text_data}/tokens.pt")
    model = build_model(f"hf-config:{args.text_data}/config.json", vocab_size=tokenizer.vocab_size, seed=args.seed)
    context = resolve_context(model, 0)
    corpus = Corpus.from_parts(parts["train"], parts["held_out"], tokenizer, parts["source"], context=context)
    return model, corpus, context


@torch.no_grad()
def load_parameters(model: torch.nn.Module, path: str) -> None:
    """Load `--init`'s tensors into `model`'s parameters of the same names; every one must be there
    (buffers, which --save-phi does not write, stay as built)."""
    saved = torch.load(path)
    params = {name for name, _ in model.named_parameters()}
    if saved.keys() != params:
        raise SystemExit(f"--init {path}: its tensors are not this model's parameters")
    model.load_state_dict(saved, strict=False)


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """--cosine's multiplier of the inner lr at `step` (module docstring)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(step - warmup, steps - warmup) / max(steps - warmup, 1)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over `batches` in eval mode (the mode restored after)."""
    was_training = model.training
    model.eval()
    try:
        losses = [loss_of(model(x, y)).item() for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


async def main(args: argparse.Namespace) -> None:
    configure()  # MESHTRAIN_LOG=INFO shows the rounds in each peer's log
    torch.set_num_threads(args.threads)
    model, corpus, context = model_and_corpus(args)
    if args.init:
        load_parameters(model, args.init)
    evals = corpus.eval_batches(args.eval_batches, 32, context)
    cfg = AllReduceConfig(
        join_timeout=args.join_timeout, part_timeout=args.part_timeout, report_timeout=args.part_timeout
    )
    host_config = HostConfig(listen=[f"/ip4/{args.listen}/tcp/0"]) if args.listen else None
    async with Host(Identity.generate(), host_config) as host, TensorStreams(host) as ts:
        say({"peer": host.peer_id, "addr": host.addrs[0], "index": args.index})
        addrs = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
        ids = sorted(a.rsplit("/", 1)[1] for a in addrs)
        for a in addrs:
            if not a.endswith(host.peer_id) and not host.is_connected(a.rsplit("/", 1)[1]):
                await host.connect(a, timeout=60)  # generous: 4 peers start at once on a loaded machine
        me = host.peer_id

        def membership(_round: int) -> list[str]:
            return [p for p in ids if p == me or host.is_connected(p)]

        col = SwarmCollective(host, ts, membership, cfg)
        if args.victim_rank >= 0 and ids.index(me) == args.victim_rank:
            install_fault(ts, col, args.kill_at_step)
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
        # --cosine: warm-up, then the inner lr decays from lr to lr/10 (the reference codes use a schedule).
        sched = (
            torch.optim.lr_scheduler.LambdaLR(inner, lambda s: lr_factor(s, args.steps, args.warmup))
            if args.cosine
            else None
        )
        outer = None if args.method == "single" else build(args, model, inner, col)
        say({"ready": True})
        await trio.to_thread.run_sync(sys.stdin.readline)

        def evaluate() -> float:
            if isinstance(outer, OuterOptimizer):
                with outer.outer_weights():
                    return held_out_loss(model, evals)
            return held_out_loss(model, evals)

        def train() -> None:
            for step in range(args.steps):
                x, y = corpus.batch(args.batch, context, seed=args.data_seed, peer=args.index, step=step)
                loss = loss_of(model(x, y))
                inner.zero_grad(set_to_none=True)
                loss.backward()
                if outer is None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                    inner.step()
                elif isinstance(outer, DataParallel):
                    outer.step()  # averages, then clips, then the inner step
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                    outer.step()
                if sched is not None:
                    sched.step()
                if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                    say(
                        {
                            "eval": step + 1,
                            "loss": evaluate(),
                            "t": time.monotonic() - t0,
                            "bytes": outer.bytes_sent if outer is not None else 0,
                        }
                    )

        async def keep_connected() -> None:
            # As the node's daemon does: re-dial a peer whose libp2p connection dropped. The
            # membership above is "who is connected", so a drop nobody repairs would leave this
            # peer coordinating rounds of its own while the others wait out join deadlines.
            while True:
                await trio.sleep(1.0)  # sleep: the re-dial check's period, as in the node's daemon
                for a in addrs:
                    pid = a.rsplit("/", 1)[1]
                    if pid != me and not host.is_connected(pid):
                        log.info(kv("peer connection dropped; re-dialling", peer=pid[-8:]))
                        with contextlib.suppress(Exception):
                            await host.connect(a, timeout=5)

        t0, cpu0 = time.monotonic(), time.process_time()
        async with trio.open_nursery() as keeper:
            keeper.start_soon(keep_connected)
            if isinstance(outer, OuterOptimizer):
                async with outer:
                    await trio.to_thread.run_sync(train)
                    await outer.afinish()
            else:
                await trio.to_thread.run_sync(train)
            keeper.cancel_scope.cancel()
        wall = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        final = await trio.to_thread.run_sync(evaluate)
        stats = (
            outer.stats()
            if outer is not None
            else {
                "inner_steps": args.steps,
                "rounds": 0,
                "bytes_sent": 0,
                "peak_bytes_per_sync": 0,
                "comm_wait_seconds": 0.0,
            }
        )
        phi = outer.outer_params if isinstance(outer, OuterOptimizer) else dict(model.named_parameters())
        if args.save_phi:
            torch.save({n: t.detach().clone() for n, t in phi.items()}, args.save_phi)
        history = list(outer.history) if isinstance(outer, OuterOptimizer) else []
        say(
            {
                "done": True,
                "final_eval_loss": final,
                "stats": stats,
                "wall_s": wall,
                "cpu_s": cpu,
                "phi_digest": digest(phi),
                "contributors": [r.contributors for r in history],
                "steps_of_rounds": [r.step for r in history],
                "errors": [r.error for r in history if r.error],
                "peer": me,
            }
        )
        await trio.sleep(args.linger)  # sleep: lingers as asked (--linger) before exiting


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--method", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--H", type=int, default=25)
    p.add_argument("--model", default="small", choices=["small", "tiny", "medium"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--cosine", action="store_true")
    p.add_argument("--warmup", type=int, default=0, help="--cosine's linear warm-up steps")
    p.add_argument("--text-data", default="", help="a directory of bench_convergence.py --text (module docstring)")
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--noloco-lr", type=float, default=0.7)
    p.add_argument("--noloco-momentum", type=float, default=0.5)
    p.add_argument("--custom-lr", type=float, default=1.0)
    p.add_argument("--codec", default="none")
    p.add_argument("--P", type=int, default=2)
    p.add_argument("--delay", type=int, default=1)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--error-decay", type=float, default=0.9)
    p.add_argument("--sparse-k", type=int, default=64)
    p.add_argument("--sparse-chunk", type=int, default=4096)
    p.add_argument("--vector-k", type=int, default=-1, help="SparseLoCo: 1-D tensors' k per 64 (-1: as matrices)")
    p.add_argument("--aggregation", default="auto")
    p.add_argument("--aggregate", default="index_mean")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--victim-rank", type=int, default=-1)
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--join-timeout", type=float, default=10)
    p.add_argument("--part-timeout", type=float, default=5)
    p.add_argument("--save-phi", default="")
    p.add_argument("--init", default="", help="start from these weights (a --save-phi file)")
    p.add_argument("--listen", default="", help="IP to listen on (a lab namespace's address)")
    p.add_argument("--linger", type=float, default=1.0)
    return p


if __name__ == "__main__":
    trio.run(main, parser().parse_args())
    # Exit without the interpreter's teardown: with torch and libp2p loaded it costs up to a
    # second of CPU per process (more on a busy machine) while the harness waits for our exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
