"""SparseLoCo hyper-parameter sweep against DiLoCo, cheap enough for a shared 2-core machine.

    python scripts/studies/sweep_sparseloco.py [--steps 600] [--model small] [--seeds 0,1]
        [--configs "beta=0.9;beta=0.99;lr=1.5;k=32,chunk=2048"] [--base "lr=1.0"]

Why in one process. `bench_convergence.py` runs every peer in its own process over real sockets:
right for the final comparison, too slow to try a dozen settings with repeated seeds. Here the 4
peers are `LocalSwarm` members in one trio run (the same `SparseLoCo` / `DiLoCo` code paths, the
same codec and all-gather contract, byte counts as the network would move them), one torch thread,
each peer stepping in turn. The testbed is bench_convergence's: the char GPT (`--model small`: 4
blocks, d 64), inner AdamW lr 2e-3 (weight decay 0.01), batch 16 per peer, grad clip 1.0, each
peer on its own data (`Corpus.batch(peer=i)`), held-out loss of φ on 24 fixed batches of 32.

What it compares. For every seed (the model's initialisation and the data order), DiLoCo at the
same H (Nesterov, lr 0.7, momentum 0.9: bench_convergence's `diloco_h25`) and every SparseLoCo
configuration. A configuration is `key=value` pairs separated by commas, configurations by `;`,
each on top of `--base` on top of SparseLoCo's own defaults. Keys: beta, lr, k, chunk, range
(the quantiser's σ range), bits (2 or none), vector_k, vector_chunk, aggregate, H.

Output. Progress (one JSON object per run) on stderr; last line on stdout, one JSON object:
  diloco: {"per_seed": [...], "mean": x}
  configs: [{"config": str, "per_seed": [...], "gap_per_seed": [sparse/diloco − 1 on that seed],
             "gap_mean", "gap_std" (across seeds), "bytes_ratio" (DiLoCo bytes / SparseLoCo's)}]
  best: the configuration with the lowest gap_mean.
A gain is real only if it exceeds the seed-to-seed spread (`gap_std`) — say so when reporting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import trio

from meshtrain.collective import LocalSwarm
from meshtrain.models import GPT, Corpus, GPTConfig
from meshtrain.optim import DiLoCo, OuterOptimizer, SparseLoCo

PEERS = 4
KEYS = {
    "beta": float,
    "lr": float,
    "k": int,
    "chunk": int,
    "range": float,
    "bits": lambda v: None if v == "none" else int(v),
    "vector_k": lambda v: None if v == "none" else int(v),
    "vector_chunk": int,
    "aggregate": str,
    "H": int,
}


def parse_config(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        if key not in KEYS:
            raise SystemExit(f"unknown key {key!r} in {text!r}; keys: {', '.join(KEYS)}")
        out[key] = KEYS[key](value)
    return out


def make_outer(kind: str, cfg: dict[str, Any], model: torch.nn.Module, inner, col, H: int) -> OuterOptimizer:
    if kind == "diloco":
        return DiLoCo(model, inner, col, H=H, lr=0.7, momentum=0.9)
    args = dict(cfg)
    args.pop("H", None)
    if "range" in args:
        args["range_sigmas"] = args.pop("range")
    if "beta" in args:
        args["beta"] = args.pop("beta")
    return SparseLoCo(model, inner, col, H=H, **args)


async def train(kind: str, cfg: dict[str, Any], seed: int, steps: int, model_size: str) -> dict[str, Any]:
    corpus = Corpus.default()
    config = GPTConfig.small(corpus.vocab_size) if model_size == "small" else GPTConfig.tiny(corpus.vocab_size)
    evals = corpus.eval_batches(24, 32, config.context)
    H = cfg.get("H", 25)
    swarm = LocalSwarm(PEERS, timeout=None)
    models = [GPT(config, seed=seed) for _ in range(PEERS)]
    inners = [torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01) for m in models]
    outers = [
        make_outer(kind, cfg, m, o, swarm.member(i), H) for i, (m, o) in enumerate(zip(models, inners, strict=True))
    ]
    t0 = time.monotonic()
    for step in range(steps):
        async with trio.open_nursery() as nursery:
            for i in range(PEERS):

                async def one(i: int = i, step: int = step) -> None:
                    x, y = corpus.batch(16, config.context, seed=seed, peer=i, step=step)
                    loss = models[i](x, y).loss
                    inners[i].zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(models[i].parameters(), 1.0)
                    await outers[i].astep()

                nursery.start_soon(one)
    for o in outers:
        await o.afinish()
    with outers[0].outer_weights():
        loss = models[0].evaluate(evals)
    return {"loss": loss, "bytes_sent": outers[0].bytes_sent, "wall_s": time.monotonic() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--model", choices=["small", "tiny"], default="small")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--base", default="", help="key=value,... applied to every configuration")
    ap.add_argument("--configs", default="", help="configurations separated by ';' (empty: the base alone)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    base = parse_config(args.base)
    configs = [c.strip() for c in args.configs.split(";")] if args.configs else [""]
    H = base.get("H", 25)

    def log(obj: dict) -> None:
        print(json.dumps(obj), file=sys.stderr, flush=True)

    diloco: dict[int, dict] = {}
    for seed in seeds:
        diloco[seed] = trio.run(train, "diloco", {"H": H}, seed, args.steps, args.model)
        log({"run": "diloco", "seed": seed, "loss": round(diloco[seed]["loss"], 4)})
    rows = []
    for text in configs:
        cfg = {**base, **parse_config(text)}
        runs = {seed: trio.run(train, "sparseloco", cfg, seed, args.steps, args.model) for seed in seeds}
        gaps = [runs[s]["loss"] / diloco[s]["loss"] - 1 for s in seeds]
        row = {
            "config": text or "(base)",
            "per_seed": [round(runs[s]["loss"], 4) for s in seeds],
            "gap_per_seed": [round(g, 4) for g in gaps],
            "gap_mean": round(statistics.fmean(gaps), 4),
            "gap_std": round(statistics.stdev(gaps), 4) if len(gaps) > 1 else None,
            "bytes_ratio": round(diloco[seeds[0]]["bytes_sent"] / max(1, runs[seeds[0]]["bytes_sent"]), 1),
            "wall_s": round(sum(r["wall_s"] for r in runs.values()), 1),
        }
        rows.append(row)
        log(row)
    print(
        json.dumps(
            {
                "steps": args.steps,
                "model": args.model,
                "seeds": seeds,
                "H": H,
                "base": args.base,
                "diloco": {
                    "per_seed": [round(diloco[s]["loss"], 4) for s in seeds],
                    "mean": round(statistics.fmean(d["loss"] for d in diloco.values()), 4),
                },
                "configs": rows,
                "best": min(rows, key=lambda r: r["gap_mean"])["config"],
            }
        )
    )


if __name__ == "__main__":
    main()
