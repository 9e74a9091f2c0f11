"""The consensus term of a grouped round: φ averaged in the group too, so the groups' φ stay close.

Problem. When the collective runs a round in groups smaller than the swarm (`GroupsRounds`: a
`SwarmCollective` with the spec's `group_size`, collective/groups.py), each group averages its
own Δ, so peers of different groups move φ differently — and a group's members come from
different groups the round before, so their φ already differ. Averaging Δ alone never pulls the
φ_i back together (they random-walk apart: on a noisy quadratic, 64 peers in groups of 8 ended
~16x further apart than with the term below).

Design. `group_consensus` also averages φ in the group, in fp16, and hands `apply` the
pseudo-gradient against the group's mean local model, Δ̄ + (φ_i − φ̄) = φ_i − mean θ: NoLoCo's
consensus term (docs/algorithms.md) with γ = β, Moshpit's averaging of the models. With outer
lr 1 and momentum 0 it is FedAvg within each group. `OuterOptimizer.communicate` (outer.py, the
default) adds it to every grouped round; a subclass that overrides `communicate` (SparseLoCo)
does without.

Cost. One more all-reduce of half the bytes (fp16) in a grouped round, among the peers the Δ
exchange committed (`RoundRequest.among`: one that left it is not waited for), under the
exchange's tag with ".phi" appended. None where the group's exchange was ours alone.

Failures. If the φ all-reduce fails (`CollectiveError`), the round keeps Δ̄ alone.

Not here: which rounds are grouped and who is in a group (the collective: collective/groups.py);
the Δ exchange itself (`communicate`, outer.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from meshtrain.collective.contract import Collective, CollectiveError, ReduceResult, RoundRequest
from meshtrain.log import get_logger, kv

__all__ = ["group_consensus"]

log = get_logger(__name__)


async def group_consensus(
    collective: Collective, outer_params: Mapping[str, torch.Tensor], result: ReduceResult, *, round_id: int, tag: str
) -> ReduceResult:
    """`result` (the group's Δ̄) plus φ_i − φ̄, φ̄ averaged over the group in fp16. `outer_params`:
    φ, of which those of `result`'s names must not be written while this runs (only `apply`
    writes them, after the exchange)."""
    names = list(result.tensors)
    if len(result.members) == 1:
        return result  # the group's first exchange was ours alone: φ̄ = φ_i, no term
    phi = {n: outer_params[n] for n in names}
    try:
        # Among the peers the Δ exchange committed, the same on each of them: a member that
        # left it (re-syncing, or gone on alone) is not waited for (collective/own_rounds.py).
        request = RoundRequest(phi, round_id, f"{tag}.phi", "fp16", among=result.members)
        mean = await collective.all_reduce(request)
    except CollectiveError as e:
        log.info(kv("grouped round without the consensus term", round=round_id, error=str(e)[:200]))
        return result
    tensors = {n: result.tensors[n].to(torch.float32) + (phi[n] - mean.tensors[n]) for n in names}
    return ReduceResult(
        tensors,
        result.contributors,
        result.digest,
        result.bytes_sent + mean.bytes_sent,
        result.bytes_received + mean.bytes_received,
        {**mean.excluded, **result.excluded},
        members=result.members,
    )
