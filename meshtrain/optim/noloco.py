"""NoLoCo (Kolehmainen et al. 2025, Gensyn, arXiv 2506.10911): no all-reduce, no global barrier.

Every H inner steps each peer averages with *one* random partner instead of the whole swarm, and
a modified momentum pulls the replicas toward each other. The rule, from the reference code
(`gensyn-ai/noloco`, `src/noloco/sparse_optimizer_c.py`: `outer_step`, `SparseOptimizerC.step`;
docs/algorithms.md, NoLoCo), for peer i in its group G at inner step s (a multiple of H):

    perm  = np.random.default_rng(s + 1).permutation(N)   # same on every peer, no talking
    pairs = (perm[j], perm[j + N//2]) for j < N//2         # the code's `batched(perm, 2)`
    φ̄    = mean_{j∈G} φ_j                                  # outer ("slow") weights
    Δ̄    = mean_{j∈G} (θ_j − φ_j)                          # local progress: fast minus slow
    δ_i  ← μ·δ_i + β·Δ̄ + γ·(φ̄ − φ_i)                       # μ 0.5, β = γ = 0.7 (outer_lr)
    φ_i  ← φ_i + δ_i ;   θ_i ← φ_i

The momentum is heavy-ball, not Nesterov, despite the reference's comment. With the group of
all peers φ̄ = φ_i (replicas stay identical), the γ term vanishes and NoLoCo *is* heavy-ball
DiLoCo (lr β, momentum μ) — `group="all"` exists to test that identity. Replicas otherwise never
become identical; `cross_replica_std` in the benchmark measures how far apart they are.

Where we differ from the reference, and why:
- The seed is the inner step s of the round, as in the code (`self._step` after the increment),
  which every peer of a swarm shares; the brief's "round + 1" would pair identically in spirit.
- The reference requires N % 2 == 0. With an odd N the peer at perm[N−1] proceeds alone for that
  round (its own φ and Δ: δ ← μ·δ + β·(θ − φ)).
- A partner that is gone, or fails mid-exchange, does not stop us: the collective's
  `average_with` returns our own input (`contributors == (self,)`) after its deadline, and we
  proceed alone, as an odd peer out does. Peers must agree on the round's membership to pair
  consistently; if they do not, a mismatched pair costs one deadline and both proceed alone.
- Exchange: Δ and φ are sent together, 2|θ| each way with one peer, as in the paper. A codec
  applies to both; keep "none" (or "fp16") — 4-bit φ would throw away the weights themselves —
  and it takes no error feedback (a residual of φ is no pseudo-gradient's): the spec's topk
  `error_feedback` leaves it alone.

The spec's outer_lr and outer_momentum are β and μ, the paper's meaning, where the spec says so
(`outer.noloco_outer`, optim/spec_section.py); otherwise NoLoCo runs its own β 0.7 and μ 0.5. A
spec written now that gives either key a value other than the field's default (outer_lr 0.7,
DiLoCo's outer_momentum 0.9) gets `noloco_outer` set, and the other key NoLoCo's own value
(`own_outer`): `--outer-lr 0.5` alone runs β 0.5 with μ 0.5. Why not just read them: every noloco spec
signed before carries outer_momentum 0.9 — DiLoCo's default, written into every spec —, and its
NoLoCo ran at μ 0.5 regardless; reading 0.9 now would change those swarms silently, and a spec
cannot tell a 0.9 its creator typed from the default. So a signed spec without the key runs as
it ran (its own β and μ, whatever outer_lr says), and NoLoCo at exactly 0.7 / 0.9 takes
`noloco_outer = true` with them. γ is NoLoCo's own (0.7): no spec key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Self

import numpy as np
import torch

from meshtrain.collective.contract import Collective, ReduceResult, RoundRequest
from meshtrain.optim.outer import OuterOptimizer, OuterSpec

_PHI = "phi/"  # key prefix of φ in the exchanged dict (parameter names never contain "/")


def noloco_groups(step: int, peers: Sequence[str]) -> list[tuple[str, ...]]:
    """The round's groups: pairs of the sorted `peers` from `default_rng(step + 1)`'s permutation,
    plus a single peer when N is odd. A pure function: every peer computes the same matching."""
    ids = sorted(peers)
    N = len(ids)
    perm = [int(x) for x in np.random.default_rng(step + 1).permutation(N)]
    n = N // 2
    groups = [tuple(sorted((ids[perm[j]], ids[perm[j + n]]))) for j in range(n)]
    if N % 2:
        groups.append((ids[perm[N - 1]],))
    return groups


def noloco_partner(step: int, peers: Sequence[str], me: str) -> str | None:
    """Our partner at `step`, or None if we are the odd peer out (or not in `peers`)."""
    for g in noloco_groups(step, peers):
        if me in g:
            return next((p for p in g if p != me), None)
    return None


class NoLoCo(OuterOptimizer):
    """model, inner, collective: see `OuterOptimizer` (the reference's inner optimizer is Adam,
    no weight decay, grad clip 1.0).
    H: inner steps per round (50).
    lr: β, the weight of the group's mean progress (0.7).
    gamma: γ, the pull toward the group's mean outer weights (0.7).
    momentum: μ (0.5).
    group: "pair" (NoLoCo: one random partner) or "all" (the whole round's group via all-reduce).
    codec: compression of what is exchanged (module docstring: keep "none" or "fp16").
    """

    spec_keys: ClassVar[frozenset[str] | None] = frozenset(("outer_lr", "outer_momentum", "codec"))

    replicas_identical = False  # each pair averages with its own partner: φ differs by design
    # β and μ by their spec keys: what a spec that sets `noloco_outer` and not the key gets.
    own_outer: ClassVar[Mapping[str, float]] = {"outer_lr": 0.7, "outer_momentum": 0.5}
    unpaced_reason: ClassVar[str | None] = "its pairwise average weighs both partners alike, whatever each trained"
    ungrouped_reason: ClassVar[str | None] = "it averages with one partner already"
    not_robust_reason: ClassVar[str | None] = "averages with one partner"

    @classmethod
    def from_spec(
        cls, model: torch.nn.Module, inner: torch.optim.Optimizer | None, collective: Collective, spec: OuterSpec
    ) -> Self:
        if spec.noloco_outer:  # the module docstring, "The spec's outer_lr and outer_momentum"
            return cls(
                model, inner, collective, H=spec.H, lr=spec.outer_lr, momentum=spec.outer_momentum, codec=spec.codec
            )
        return cls(model, inner, collective, H=spec.H, codec=spec.codec)

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer | None,
        collective: Collective,
        *,
        H: int = 50,
        lr: float = own_outer["outer_lr"],
        gamma: float = 0.7,
        momentum: float = own_outer["outer_momentum"],
        group: str = "pair",
        codec: str = "none",
    ) -> None:
        if group not in ("pair", "all"):
            raise ValueError(f"group must be 'pair' or 'all', got {group!r}")
        if not lr > 0 or gamma < 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0, gamma >= 0, 0 <= momentum < 1; got {lr}, {gamma}, {momentum}")
        super().__init__(model, inner, collective, H=H, codec=codec)
        self.lr, self.gamma, self.momentum, self.group = lr, gamma, momentum, group
        self.replicas_identical = group == "all"  # with the whole group it is heavy-ball DiLoCo
        self.velocity = self.register_buffers("velocity")  # δ

    def pseudo_gradient(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Δ = φ − θ (the base class's sign) and φ itself: the group averages both. Both lie in
        one flat buffer, Δ first, so the collective sends it without another copy."""
        flat = self.host_buffer(names, copies=2)
        out = self.deltas_into(flat, names)
        pos = flat.numel() // 2
        for n in names:
            phi = self.outer_params[n]
            out[_PHI + n] = flat[pos : pos + phi.numel()].view(phi.shape).copy_(phi)
            pos += phi.numel()
        return out

    async def communicate(
        self, tensors: dict[str, torch.Tensor], *, round_id: int, tag: str, weight: float
    ) -> ReduceResult:
        request = RoundRequest(tensors, round_id, tag, self.codec, overlap=self.delay)
        if self.group == "all":
            return await self.collective.all_reduce(request)
        me = self.collective.peer_id
        partner = noloco_partner(round_id, self.collective.group(round_id), me)
        return await self.collective.average_with(partner, request)

    def apply(self, result: ReduceResult, names: Sequence[str]) -> None:
        # result[n] = mean(φ − θ) = −Δ̄ exactly (negation commutes with the fp mean).
        for n in names:
            phi, d = self.outer_params[n], self.velocity[n]
            d.mul_(self.momentum).sub_(result.tensors[n].float(), alpha=self.lr)
            d.add_(result.tensors[_PHI + n].float() - phi, alpha=self.gamma)
            phi.add_(d)
