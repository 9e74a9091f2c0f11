"""How well loss scoring's rule separates honest updates from lying ones, by `score_batches`
(node/trust/scoring.py).

    python scripts/studies/loss_score_separation.py [--H 10] [--rounds 9] [--batches 1,2,4,8] [--seeds 0,1,2]
        [--fresh] [--raw scores.json]

One process, no network, the simulation scripts/studies/spot_check_separation.py uses too
(scripts/studies/separation_sim.py): DiLoCo rounds of gpt-tiny on the
built-in character corpus (batch 8, context 32) among four honest peers whose inner AdamW keeps
its state across rounds (as the daemon's does; `--fresh`: a new one every round, as
tests/test_scoring.py's rounds), the round's aggregate the trimmed mean, φ moved by Nesterov
SGD (the spec's defaults). Besides the honest peers, one liar per group: `replay` (an
honest-trained round-1 update, sent every round), `zeros`, `otherdata` (trains on its assigned
windows with their token order reversed, node/trust/adversary.py), `lazy` (trains only the last 2 of
its H steps) and `halflazy` (the last H/2). In every round from the second on, for each liar,
each of the group's five owners scores every other peer's update on its part (`score_round`) on
the peer's assigned batches of the round's last b inner steps, for each b of `--batches`.

Prints one JSON object: per b and kind, over all seeds, the quantiles (min, 10th, median, 90th
percentile, max) of the margin gain − score_ratio·ref (the rule flags below −score_floor where ref
> score_floor), the share of part-scores flagged, and the share of (round, peer) verdicts where a
quorum of owners flagged (the strike that counts). Honest peers are scored in every liar's group.
The table in node/trust/scoring.py's docstring comes from here (docs/bench/loss_score_separation_issue21.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from meshtrain.collective.flat import part_bounds  # noqa: E402
from meshtrain.node.spec.swarm import SwarmSpec  # noqa: E402
from meshtrain.node.trust.scoring import score_round, scored_steps  # noqa: E402
from meshtrain.node.trust.strikes import loss_flagged, quorum  # noqa: E402
from scripts.studies.separation_sim import BATCH, HONEST, LIARS, Cast, Swarm, quantiles  # noqa: E402


def simulate(seed: int, H: int, rounds: int, bs: list[int], spec: SwarmSpec, out: dict, fresh: bool) -> None:
    """One run of `rounds` rounds with swarm seed and model seed `seed`; appends to `out[b][kind]`
    (margin, flagged, gain, ref, round per part-score) and `out[b][kind + "/quorum"]` (per-round
    quorum verdicts)."""
    swarm = Swarm(spec, seed)
    scratch, names, phi, batch = copy.deepcopy(swarm.model), swarm.names, swarm.phi, swarm.batch
    for rnd, r, updates in Cast(swarm, fresh).rounds(rounds):
        for b in bs:
            steps = scored_steps(r, H, b)
            for liar in LIARS:
                group = sorted([*HONEST, liar])
                agg = torch.stack([updates[p] for p in group]).sort(dim=0).values[1:-1].mean(dim=0)
                bounds = part_bounds(agg.numel(), len(group))
                batches = {p: [batch(p, s) for s in steps] for p in group}
                flags = dict.fromkeys(group, 0)
                for j, owner in enumerate(group):
                    part = (bounds[j], bounds[j + 1])
                    samples = {p: updates[p][part[0] : part[1]] for p in group if p != owner}
                    for s in score_round(scratch, phi, names, part, samples, agg[part[0] : part[1]], batches):
                        kind = "honest" if s.peer in HONEST else s.peer
                        flagged = loss_flagged(s.gain, s.ref, spec)
                        flags[s.peer] += flagged
                        out[b].setdefault(kind, []).append(
                            (s.gain - spec.verification.score_ratio * s.ref, flagged, s.gain, s.ref, rnd)
                        )
                for p, n in flags.items():
                    kind = "honest" if p in HONEST else p
                    out[b].setdefault(kind + "/quorum", []).append(n >= quorum(len(group)))
        print(f"seed {seed} round {rnd} scored", file=sys.stderr)


def summary(scores: list[tuple], verdicts: list[bool]) -> dict:
    return {
        **quantiles([m for m, *_ in scores], 4),
        "flagged": round(sum(f for _, f, *_ in scores) / len(scores), 3),
        "rounds": len(verdicts),
        "quorum": round(sum(verdicts) / len(verdicts), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", default="1,2,4,8", help="score_batches values to measure")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--fresh", action="store_true", help="a fresh inner AdamW every round (tests/test_scoring.py)")
    ap.add_argument("--raw", help="also write every score (margin, flagged, gain, ref, round) here, as JSON")
    args = ap.parse_args()
    bs, seeds = [int(b) for b in args.batches.split(",")], [int(s) for s in args.seeds.split(",")]
    spec = SwarmSpec(model="gpt-tiny", H=args.H)
    torch.set_num_threads(1)
    out: dict[int, dict[str, list]] = {b: {} for b in bs}
    for seed in seeds:
        simulate(seed, args.H, args.rounds, bs, spec, out, args.fresh)
    result = {
        "model": "gpt-tiny",
        "H": args.H,
        "batch": BATCH,
        "seeds": seeds,
        "rounds_scored": args.rounds - 1,
        "inner_optimizer": "fresh every round" if args.fresh else "keeps its state across rounds",
        "score_ratio": spec.verification.score_ratio,
        "score_floor": spec.verification.score_floor,
        "margin": {
            b: {k: summary(v, d[k + "/quorum"]) for k, v in d.items() if not k.endswith("/quorum")}
            for b, d in out.items()
        },
    }
    if args.raw:
        Path(args.raw).write_text(json.dumps({b: d for b, d in out.items()}))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
