"""How the owner of a part combines its contributions: the mean, the robust rules, screening.

The problem. In the all-reduce's reduce-scatter (data_phase.py) each peer owns one part of the
flat vector and receives every member's slice of it; what it makes of them is the round's
result for that part, bit for bit, on every peer. Honest peers need a weighted mean that does not
depend on arrival order; a swarm open to strangers needs one that a few bad contributions cannot
steer, and a record of who sent them.

Design.
- `reduce_contributions`: the weighted mean in fp32 over the finite contributions in sorted peer
  order (a non-finite one is rejected and named); with `robust` and three or more weighted
  contributors, a coordinate-wise trimmed mean (`trim_count` dropped at each end: by default a
  quarter, at least one) or a mean after clipping each to the median norm × `clip`. It runs in a
  worker thread, off the event loop.
- **Screening** (robust modes with `screen_norm`): the owner holds every contribution to its part,
  so after combining it compares each with the others — its norm against the median norm, its
  cosine with the robust aggregate against the group's median cosine (`screen_contributions`,
  the thresholds' rule is contract.py `screening_rule`) — and keeps the flags in the attempt's
  stats. Nothing on the wire changes; what to do about a flag is the node's (strikes).

What is not here: dropping replayed contributions (echoes.py, before combining), loss scoring
of the kept contributions (node/trust/scoring.py), and the rejection of a contribution of the
wrong size (data_phase.py, as it arrives).
"""

from __future__ import annotations

import torch

from meshtrain.collective.contract import ContributionFlag, screening_rule
from meshtrain.collective.flat import all_finite
from meshtrain.collective.protocol import AllReduceConfig


def trim_count(trim: int, n: int) -> int:
    """Values a trimmed mean of `n` drops at each end: `trim`, or with 0 a quarter of them (at
    least one), so that as many adversaries as a quarter of a round cannot all survive the trim
    on one side: with 8 peers and 2 sign-flipping adversaries a trim of 1 let one through in every
    coordinate (scripts/bench/bench_adversarial.py: the honest loss 17 % worse before screening's
    strikes excluded them)."""
    return trim or max(1, n // 4)


def screen_contributions(
    peers: list[str], stack: torch.Tensor, aggregate: torch.Tensor, config: AllReduceConfig, part: int
) -> list[ContributionFlag]:
    """Flag the rows of `stack` (one per peer of `peers`, 3 or more) whose norm is over
    `screen_norm` x the median norm or under its inverse (a scaled update, or zeros from a free
    rider), or whose alignment — its cosine with the robust `aggregate` over the rows' median
    cosine — is below `screen_alignment` (a flipped direction, or noise: orthogonal to the others,
    though the trimmed aggregate keeps a little of it, so its plain cosine is small but positive;
    `screen_alignment` 0: no direction rule, not "flag a negative cosine").
    A part of all zeros (nobody moved) flags nobody; without a common direction (median cosine
    <= 0) nobody is flagged for direction."""
    norms = stack.norm(dim=1)
    median = float(norms.median())
    if median <= 0 or not config.screen_norm:
        return []
    agg_norm = float(aggregate.norm())
    cosines = (stack @ aggregate) / (norms.clamp_min(1e-30) * max(agg_norm, 1e-30))
    typical = float(cosines.median()) if agg_norm > 0 else 0.0
    flags = []
    for i, peer in enumerate(peers):
        ratio = float(norms[i]) / median
        alignment = float(cosines[i]) / typical if typical > 0 else 1.0
        rule = screening_rule(ratio, alignment, config.screen_norm, config.screen_alignment)
        if rule is None:
            continue
        flags.append(ContributionFlag(peer, part, round(ratio, 6), round(alignment, 6), rule))
    return flags


def reduce_contributions(
    contributions: dict[str, torch.Tensor],
    weights: dict[str, float],
    config: AllReduceConfig,
    rejected: dict[str, str],
    flags: list[ContributionFlag] | None = None,
    part: int = 0,
) -> torch.Tensor:
    """Combine the contributions to one part (runs in a worker thread).

    Weighted mean in fp32 over the finite contributions in sorted peer order (the owner's result
    must not depend on arrival order); with `config.robust` and three or more contributors, a
    coordinate-wise trimmed mean (`trim` largest and smallest dropped) or a mean after clipping
    each contribution to the median norm × `clip`. Non-finite contributions are named in
    `rejected`; with `flags` (a list) and `config.screen_norm`, what screening finds in a robust
    combination of part `part` is appended to it."""
    peers = sorted(contributions)
    bad = [p for p in peers if not all_finite(contributions[p])]
    for p in bad:
        rejected[p] = "non-finite values"
    peers = [p for p in peers if p not in bad]
    robust = config.robust
    if robust == "none" or len(peers) < 3:
        total = sum(weights[p] for p in peers)
        acc = torch.zeros_like(contributions[peers[0]]) if peers else None
        if acc is None or total == 0:
            return torch.zeros_like(next(iter(contributions.values())))
        for p in peers:
            if weights[p]:
                acc.add_(contributions[p], alpha=weights[p])
        return acc.div_(total)
    peers = [p for p in peers if weights[p] > 0]
    if not peers:  # every contributor joined this round (weight 0): nothing to combine
        return torch.zeros_like(next(iter(contributions.values())))
    stack = torch.stack([contributions[p] for p in peers])
    if robust == "clipped_mean":
        norms = stack.norm(dim=1)
        limit = norms.median() * config.clip
        scale = torch.clamp(limit / norms.clamp_min(1e-30), max=1.0)
        out = (stack * scale[:, None]).mean(dim=0)
    else:
        k = min(trim_count(config.trim, len(peers)), (len(peers) - 1) // 2)
        out = stack.mean(dim=0) if k == 0 else stack.sort(dim=0).values[k : len(peers) - k].mean(dim=0)
    if flags is not None and config.screen_norm and len(peers) >= 3:
        flags.extend(screen_contributions(peers, stack, out, config, part))
    return out
