"""The one-process DiLoCo swarm that scripts/studies/spot_check_separation.py and
scripts/studies/loss_score_separation.py measure their rules on: gpt-tiny on the built-in character
corpus (batch 8, context 32), peers training AdamW on their assigned batches (`Corpus.batch`, as
the trainer does), the round's aggregate the trimmed mean, φ moved by Nesterov SGD (the spec's
defaults). No network, no daemon; not imported by meshtrain.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from meshtrain.collective.flat import flatten_fp32  # noqa: E402
from meshtrain.models import Corpus  # noqa: E402
from meshtrain.models.sources import build_model  # noqa: E402
from meshtrain.node.spec.swarm import SwarmSpec  # noqa: E402

BATCH, CONTEXT = 8, 32
HONEST = ["p0", "p1", "p2", "p3"]
LIARS = ("replay", "zeros", "otherdata", "lazy", "halflazy")

Batch = tuple[torch.Tensor, torch.Tensor]


class Swarm:
    """φ, its outer momentum and the model, for swarm seed and model seed `seed`."""

    def __init__(self, spec: SwarmSpec, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.spec, self.seed = spec, seed
        self.corpus = Corpus.default("chars")
        self.model = build_model("gpt-tiny", vocab_size=self.corpus.vocab_size, seed=seed, context=CONTEXT)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.phi = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.momentum = {n: torch.zeros_like(p) for n, p in self.phi.items()}

    def batch(self, peer: str, step: int, reverse: bool = False) -> Batch:
        """`peer`'s assigned batch of `step`; `reverse`: its windows with their token order
        reversed (the otherdata adversary's, node/trust/adversary.py)."""
        x, y = self.corpus.batch(BATCH, CONTEXT, seed=self.seed, peer=peer, step=step)
        if reverse:
            seq = torch.cat([x[:, :1], y], dim=1).flip(1)
            return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        return x, y

    def outer_step(self, deltas: list[torch.Tensor]) -> None:
        """Move φ by the trimmed mean of `deltas` (flat), Nesterov SGD."""
        agg = torch.stack(deltas).sort(dim=0).values[1:-1].mean(dim=0)
        pos = 0
        for n in self.names:
            g = agg[pos : pos + self.phi[n].numel()].view(self.phi[n].shape)
            pos += self.phi[n].numel()
            self.momentum[n].mul_(self.spec.outer.outer_momentum).add_(g)
            self.phi[n] -= self.spec.outer.outer_lr * (g + self.spec.outer.outer_momentum * self.momentum[n])


class Peer:
    """One peer of `swarm` (its assignment is its name) whose inner AdamW keeps its state across
    rounds, as the daemon's does, unless `fresh` (a new one every round)."""

    def __init__(self, swarm: Swarm, name: str, fresh: bool = False) -> None:
        self.swarm, self.name, self.fresh = swarm, name, fresh
        self.model = copy.deepcopy(swarm.model)
        self.inner = self._optimizer()

    def _optimizer(self) -> torch.optim.AdamW:
        spec = self.swarm.spec
        return torch.optim.AdamW(self.model.parameters(), lr=spec.outer.inner_lr, weight_decay=spec.outer.weight_decay)

    def train(self, steps: range, reverse: bool = False) -> torch.Tensor:
        """Δ = φ − θ (flat) after training from φ on its batches of `steps`."""
        phi = self.swarm.phi
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(phi[n])
        if self.fresh:
            self.inner = self._optimizer()
        for s in steps:
            loss = self.model(*self.swarm.batch(self.name, s, reverse)).loss
            self.inner.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.swarm.spec.outer.clip)
            self.inner.step()
        return flatten_fp32({n: phi[n] - p.detach() for n, p in self.model.named_parameters()})


class Cast:
    """HONEST and one liar of each kind of LIARS in `swarm` (inner AdamW states kept across rounds
    unless `fresh`): `replay` sends an honestly trained round-1 update every round, `zeros` an
    empty one, `otherdata` trains on its assigned windows with their token order reversed
    (node/trust/adversary.py), `lazy` only the last 2 of its H steps, `halflazy` the last H/2."""

    def __init__(self, swarm: Swarm, fresh: bool = False) -> None:
        self.swarm = swarm
        self.peers = {p: Peer(swarm, p, fresh) for p in [*HONEST, "otherdata", "lazy", "halflazy"]}
        self.first: torch.Tensor | None = None

    def updates(self, r: int) -> dict[str, torch.Tensor]:
        """Everyone's update of the round that ends at step `r`."""
        H, peers = self.swarm.spec.outer.H, self.peers
        updates = {p: peers[p].train(range(r - H, r)) for p in HONEST}
        updates["otherdata"] = peers["otherdata"].train(range(r - H, r), reverse=True)
        updates["lazy"] = peers["lazy"].train(range(r - 2, r))
        updates["halflazy"] = peers["halflazy"].train(range(r - H // 2, r))
        if self.first is None:
            self.first = Peer(self.swarm, "replay").train(range(r - H, r))
        updates["replay"] = self.first
        updates["zeros"] = torch.zeros_like(self.first)
        return updates

    def outer_step(self, updates: dict[str, torch.Tensor]) -> None:
        """φ moves by the honest peers' and the replay's updates."""
        self.swarm.outer_step([updates[p] for p in HONEST] + [updates["replay"]])

    def rounds(self, count: int) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        """Plays `count` rounds; yields (round, the step it ends at, everyone's updates) for each
        from the second on, before φ moves by them."""
        for rnd in range(1, count + 1):
            r = rnd * self.swarm.spec.outer.H
            updates = self.updates(r)
            if rnd > 1:
                yield rnd, r, updates
            self.outer_step(updates)


def quantiles(values: list[float], digits: int) -> dict[str, float]:
    """min, 10th percentile, median, 90th percentile, max of `values` (rounded), and how many."""
    v = sorted(values)
    pick = {"min": 0, "p10": len(v) // 10, "median": len(v) // 2, "p90": 9 * len(v) // 10, "max": len(v) - 1}
    return {**{q: round(v[i], digits) for q, i in pick.items()}, "n": len(v)}
