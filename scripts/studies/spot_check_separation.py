"""How well the replay spot-check's rule separates honest updates from lying ones (node/trust/spot_check.py).

    python scripts/studies/spot_check_separation.py [--H 10] [--rounds 9] [--steps 2,5,10]

One process, no network: DiLoCo rounds of gpt-tiny on the built-in character corpus among four
honest peers whose inner AdamW keeps its state across rounds (as the daemon's does), the round's
aggregate the trimmed mean, φ moved by Nesterov SGD (the spec's defaults). In every round from
the second on, each of the five owners' parts of every peer's update is compared with the
owner's recomputation of the peer's first k steps (`recompute_update`, a fresh AdamW) and the
round's aggregate (`spot_check_round`).
Besides the honest peers: `replay` (an honest peer's round-1 update, sent every round), `zeros`,
`otherdata` (trains on its assigned windows with their token order reversed, node/trust/adversary.py),
`lazy` (trains only the last 2 of its H steps) and `halflazy` (the last H/2).

Prints one JSON object: per k and kind, the quantiles (min, 10th, median, 90th percentile, max)
of match − ref (the rule flags below −spot_check_margin) and the share of part-checks flagged at
the default margin. The numbers in node/trust/spot_check.py's docstring come from here.
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
from meshtrain.node.trust.spot_check import recompute_update, spot_check_round  # noqa: E402
from scripts.studies.separation_sim import HONEST, LIARS, Cast, Swarm, quantiles  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", default="2,5,10", help="k values to recompute (each at most H)")
    args = ap.parse_args()
    H, ks = args.H, [int(k) for k in args.steps.split(",")]
    spec = SwarmSpec(model="gpt-tiny", H=H)
    torch.set_num_threads(1)
    swarm = Swarm(spec)
    model, names, phi, batch = swarm.model, swarm.names, swarm.phi, swarm.batch

    cast = Cast(swarm)
    diffs: dict[int, dict[str, list[float]]] = {k: {} for k in ks}
    for rnd in range(1, args.rounds + 1):
        r = rnd * H
        updates = cast.updates(r)
        if rnd > 1:
            for k in ks:
                for liar in LIARS:
                    group = sorted([*HONEST, liar])
                    agg = torch.stack([updates[p] for p in group]).sort(dim=0).values[1:-1].mean(dim=0)
                    bounds = part_bounds(agg.numel(), len(group))
                    for j, owner in enumerate(group):
                        if owner not in HONEST:
                            continue
                        part = (bounds[j], bounds[j + 1])
                        checked = [liar] if liar != "replay" else [p for p in group if p != owner]
                        recomputed = {
                            p: recompute_update(
                                copy.deepcopy(model),
                                phi,
                                names,
                                [batch(p, s) for s in range(r - H, r - H + k)],
                                lr=spec.outer.inner_lr,
                                weight_decay=spec.outer.weight_decay,
                                clip=spec.outer.clip,
                            )
                            for p in checked
                        }
                        samples = {p: updates[p][part[0] : part[1]] for p in checked}
                        for c in spot_check_round(recomputed, part, samples, agg[part[0] : part[1]]):
                            kind = "honest" if c.peer in HONEST else c.peer
                            diffs[k].setdefault(kind, []).append(c.match - c.ref)
            print(f"round {rnd} checked", file=sys.stderr)
        cast.outer_step(updates)

    def summary(v: list[float]) -> dict:
        flagged = sum(d < -spec.verification.spot_check_margin for d in v) / len(v)
        return {**quantiles(v, 3), "flagged": round(flagged, 3)}

    out = {
        "model": "gpt-tiny",
        "H": H,
        "rounds_checked": args.rounds - 1,
        "margin": spec.verification.spot_check_margin,
        "match_minus_ref": {k: {kind: summary(v) for kind, v in d.items()} for k, d in diffs.items()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
