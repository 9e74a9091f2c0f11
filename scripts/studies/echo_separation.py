"""How close an honest update comes to an earlier round's: the margin of replay screening.

    python scripts/studies/echo_separation.py [--H 2,3,5,10,50] [--rounds 20] [--seeds 3] [--parts 8]

Replay screening (collective/echoes.py) flags a contribution to a part whose cosine with any
contribution or aggregate of that part in an earlier round is at least the spec's `screen_echo`
(default 0.9999). This measures, in the one-process swarm of scripts/studies/separation_sim.py (gpt-tiny,
4 honest peers whose inner AdamW persists across rounds, as the daemon's), every honest update's
largest such cosine, per part (the flat update cut into `--parts` equal parts, as an owner sees
it), against every earlier round's honest updates (its own and the others') and aggregates (an
owner keeps only its last 8 rounds: this is the harder test), and
the same for the replay adversary (its round-1 update every round). Last line: one JSON object,
per H the quantiles of the honest maxima and of the replay's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from separation_sim import HONEST, Cast, Swarm, quantiles  # noqa: E402

from meshtrain.node.spec.swarm import SwarmSpec  # noqa: E402


def max_cosines(current: torch.Tensor, earlier: list[torch.Tensor], parts: int) -> list[float]:
    """Per part: the largest cosine of `current`'s slice with the same slice of any of `earlier`."""
    out = []
    for chunk, *olds in zip(current.chunk(parts), *(e.chunk(parts) for e in earlier), strict=True):
        best = -1.0
        for old in olds:
            denom = float(chunk.norm() * old.norm())
            if denom > 0:
                best = max(best, float(chunk @ old) / denom)
        out.append(best)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--H", default="2,3,5,10,50")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--parts", type=int, default=8)
    args = ap.parse_args()
    t0, result = time.time(), {}
    for H in (int(h) for h in args.H.split(",")):
        honest, replay = [], []
        for seed in range(args.seeds):
            cast = Cast(Swarm(SwarmSpec(model="gpt-tiny", H=H), seed))
            history: list[torch.Tensor] = []  # every earlier round's honest updates and aggregate
            for rnd in range(1, args.rounds + 1):
                updates = cast.updates(rnd * H)
                if history:
                    for p in HONEST:
                        honest += max_cosines(updates[p], history, args.parts)
                    if rnd > 2:  # round 2's replay is the round-1 update, which history holds
                        replay += max_cosines(updates["replay"], history, args.parts)
                deltas = [updates[p] for p in HONEST] + [updates["replay"]]
                history += [updates[p] for p in HONEST]
                history.append(torch.stack(deltas).sort(dim=0).values[1:-1].mean(dim=0))
                if rnd == 1:
                    history.append(updates["replay"])
                cast.outer_step(updates)
            print(f"H={H} seed={seed} done {time.time() - t0:.0f}s", file=sys.stderr)
        result[f"H{H}"] = {"honest_max_cosine": quantiles(honest, 4), "replay_max_cosine": quantiles(replay, 4)}
    print(
        json.dumps(
            {
                "parts": args.parts,
                "rounds": args.rounds,
                "seeds": args.seeds,
                **result,
                "seconds": round(time.time() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
