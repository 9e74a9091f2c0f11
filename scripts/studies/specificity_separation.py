"""Would a specificity rule catch the peers loss scoring misses? (node/trust/scoring.py)

    python scripts/studies/specificity_separation.py [--H 10] [--rounds 9] [--batches 4] [--seeds 0,1,2]
        [--fresh] [--unseen heldout|others] [--raw rows.json]

Hypothesis: an honest update trained on exactly its assigned batches, so it lowers the loss on
*those* batches more than on comparable batches it never saw; an other-data, replayed or zero
update has no such specificity. Same simulation as scripts/studies/loss_score_separation.py
(scripts/studies/separation_sim.py: gpt-tiny, batch 8, four honest peers and one liar per group, every
owner scores every other peer on its part in rounds 2..rounds). Each part-score is measured twice
with `score_round`: on the peer's own batches of the round's last b steps (gain, ref) and on
unseen batches of the same steps (gain_u, ref_u): drawn for a peer id nobody has (`--unseen
heldout`) or the group's other peers' assigned ones (`--unseen others`, 4 x b batches). Per
part-score:

    s   = gain − gain_u          (the update's specificity to its own batches)
    s_a = ref − ref_u            (the aggregate's, which holds 1/n of the peer's own fit)
    d   = s − s_a

Prints one JSON object: per statistic and kind the quantiles and, for three thresholds taken from
the honest scores themselves (their minimum, so no honest part-score is flagged; the highest at
which no honest verdict is flagged by a quorum; their 10th percentile), how many part-scores are
flagged (below the threshold) and how many (round, peer) verdicts a quorum of owners flags. The
thresholds are fit to the honest sample in hand, an optimistic bound on what a fixed spec
threshold would do. Costs: the held-out batches double scoring's forward passes, the other
peers' (4 x b) make them 5x.
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
from meshtrain.node.trust.strikes import quorum  # noqa: E402
from scripts.studies.separation_sim import HONEST, LIARS, Cast, Swarm, quantiles  # noqa: E402

UNSEEN = "heldout"  # a peer id nobody has: batches drawn the same way, trained on by no one
STATS = ("s", "d")


def simulate(seed: int, H: int, rounds: int, b: int, spec: SwarmSpec, out: list, fresh: bool, unseen_of: str) -> None:
    """One run; unseen batches are `UNSEEN`'s (`unseen_of` "heldout") or the group's other peers'
    assigned batches of the same steps ("others"); appends (kind, seed, round, liar group, owner,
    peer, gain, ref, gain_u, ref_u) per part-score to `out`."""
    swarm = Swarm(spec, seed)
    scratch, names, phi, batch = copy.deepcopy(swarm.model), swarm.names, swarm.phi, swarm.batch
    for rnd, r, updates in Cast(swarm, fresh).rounds(rounds):
        steps = scored_steps(r, H, b)
        unseen = [batch(UNSEEN, s) for s in steps]
        for liar in LIARS:
            group = sorted([*HONEST, liar])
            agg = torch.stack([updates[p] for p in group]).sort(dim=0).values[1:-1].mean(dim=0)
            bounds = part_bounds(agg.numel(), len(group))
            own = {p: [batch(p, s) for s in steps] for p in group}
            if unseen_of == "others":
                held = {p: [x for q in group if q != p for x in own[q]] for p in group}
            else:
                held = dict.fromkeys(group, unseen)
            for j, owner in enumerate(group):
                part = (bounds[j], bounds[j + 1])
                samples = {p: updates[p][part[0] : part[1]] for p in group if p != owner}
                a = agg[part[0] : part[1]]
                on_own = score_round(scratch, phi, names, part, samples, a, own)
                on_unseen = {s.peer: s for s in score_round(scratch, phi, names, part, samples, a, held)}
                for s in on_own:
                    u = on_unseen[s.peer]
                    kind = "honest" if s.peer in HONEST else s.peer
                    out.append((kind, seed, rnd, liar, owner, s.peer, s.gain, s.ref, u.gain, u.ref))
        print(f"seed {seed} round {rnd} scored", file=sys.stderr, flush=True)


def stat(row: tuple, name: str) -> float:
    *_, gain, ref, gain_u, ref_u = row
    s, s_a = gain - gain_u, ref - ref_u
    return s if name == "s" else s - s_a


def verdicts(rows: list, name: str, threshold: float) -> dict[str, tuple[int, int, int, int]]:
    """Per kind: (part-scores flagged, part-scores, quorum verdicts, verdicts) flagging `name` <
    `threshold`."""
    parts: dict[str, list[int]] = {}
    groups: dict[tuple, int] = {}
    for row in rows:
        kind, seed, rnd, liar, _, peer = row[:6]
        f = stat(row, name) < threshold
        parts.setdefault(kind, [0, 0])
        parts[kind][0] += f
        parts[kind][1] += 1
        groups[(kind, seed, rnd, liar, peer)] = groups.get((kind, seed, rnd, liar, peer), 0) + f
    q = quorum(len(HONEST) + 1)
    res = {}
    for kind, (f, n) in parts.items():
        vs = [c >= q for k, c in groups.items() if k[0] == kind]
        res[kind] = (f, n, sum(vs), len(vs))
    return res


def quorum_threshold(rows: list, name: str) -> float:
    """The highest threshold under which no (round, peer) verdict of `rows` is flagged by a quorum:
    the lowest, over verdicts, of the quorum-th lowest owner's statistic."""
    by: dict[tuple, list[float]] = {}
    for row in rows:
        by.setdefault((row[1], row[2], row[3], row[5]), []).append(stat(row, name))
    q = quorum(len(HONEST) + 1)
    return min(sorted(v)[q - 1] for v in by.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", type=int, default=4, help="score_batches")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--fresh", action="store_true", help="a fresh inner AdamW every round (tests/test_scoring.py)")
    ap.add_argument(
        "--unseen",
        choices=("heldout", "others"),
        default="heldout",
        help="unseen batches: a held-out peer id's, or the group's other peers' of the same steps",
    )
    ap.add_argument(
        "--raw", help="also write every row (kind, seed, round, liar, owner, peer, gain, ref, gain_u, ref_u)"
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    spec = SwarmSpec(model="gpt-tiny", H=args.H)
    torch.set_num_threads(1)
    rows: list = []
    for seed in seeds:
        simulate(seed, args.H, args.rounds, args.batches, spec, rows, args.fresh, args.unseen)
    if args.raw:
        Path(args.raw).write_text(json.dumps(rows))
    kinds = ["honest", *LIARS]
    result: dict = {
        "model": "gpt-tiny",
        "H": args.H,
        "score_batches": args.batches,
        "seeds": seeds,
        "rounds_scored": args.rounds - 1,
        "inner_optimizer": "fresh every round" if args.fresh else "keeps its state across rounds",
        "unseen": f"batches of the same steps for peer id {UNSEEN!r}"
        if args.unseen == "heldout"
        else "the group's other peers' assigned batches of the same steps",
        "stats": {},
    }
    for name in STATS:
        values = {k: [stat(r, name) for r in rows if r[0] == k] for k in kinds}
        honest = sorted(values["honest"])
        entry: dict = {"quantiles": {k: quantiles(v, 5) for k, v in values.items()}, "thresholds": {}}
        thresholds = {
            "honest_min": honest[0],
            "honest_quorum_min": quorum_threshold([r for r in rows if r[0] == "honest"], name),
            "honest_p10": honest[len(honest) // 10],
        }
        for label, t in thresholds.items():
            v = verdicts(rows, name, t)
            entry["thresholds"][label] = {
                "flag_below": round(t, 5),
                **{k: {"parts": f"{f}/{n}", "quorum": f"{qf}/{qn}"} for k, (f, n, qf, qn) in v.items()},
            }
        result["stats"][name] = entry
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
