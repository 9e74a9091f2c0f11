"""A joiner's inner optimizer, seeded with the swarm's scale: `InnerMoments`.

Problem. A late joiner downloads φ and the outer optimizer's state (node/state/sync.py), but not
the inner optimizer's: each peer's AdamW moments are its own, 8 B/param that change every step
and would have to be copied to be served. So a joiner starts with an empty AdamW, whose first
hundreds of steps are about lr·sign(g) per coordinate, while a veteran's steps are divided by
second moments its history inflated (a swarm's creator that ran DiLoCo rounds alone, outer lr 0.7,
most of all). Measured (scripts/studies/joiner_step_sizes.py): a creator's Δ is 0.13–0.43 of a
fresh joiner's 20 steps after the join, 0.36–0.79 after 120. A robust round's owner flags a
contribution under 1/4 of the median norm (collective/contract.py `screening_rule`), so where
joiners outnumber the creator in a group the creator was struck out of its own swarm (a grouped
daemon test, once in 22 runs), and everywhere a joiner's early Δ outweighs the veterans'.

Design. A donor also says, per parameter tensor, the mean of its inner optimizer's second moment
(`exp_avg_sq`) and its step count: two numbers a tensor, a few KB for any model. The joiner fills
each fresh tensor's `exp_avg_sq` with that mean, `exp_avg` with zeros (momentum refills within
its weight-0 warm-up, optim/outer.py `JOIN_WARMUP_STEPS`) and `step` with the donor's (so Adam's
bias correction does not blow the seeded moment up again). Measured with the study's
`--joiner-state moments`: the creator's Δ is 0.77–1.04 of the joiner's 20 steps after the join and
0.86–2.0 after 40–120 (a copy of the whole AdamW state: 0.90–1.11).

Trust. The moments are each donor's own, so they are not part of the voted manifest (every
donor's differ); the joiner takes, per tensor, the median over the donors that offered the agreed
state (`median`): a lying minority cannot move it outside the honest donors' range. With one donor
it is trust, as for the state itself. What a liar can do is bounded: a tiny mean is overwritten by
the joiner's own squared gradients within a few steps (Adam's step stays within a few lr), and a
huge one is capped at `MAX_MEAN` — the joiner's steps then start small, and it is the joiner that
is slowed, nobody else.

What is seeded: Adam and AdamW (torch.optim; AMSGrad's running maximum too), through the
optimizer's own `load_state_dict`, which casts to each parameter's device and dtype. Any other
inner optimizer, a parameter that already has state (a peer that re-syncs keeps its own), or a
name the donor did not describe is left as it is. Not here: FSDP peers' sharded inner state (rank
0 holds no inner optimizer: nothing is described or seeded) and pipeline stages.

Wire (node/state/sync.py, beside the snapshots of a `state/manifest` reply):
`inner_moments: {step: int, means: {param name: float}}`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.transport.validate import is_int, is_number

MAX_TENSORS = 1 << 16  # names one description may carry (a manifest holds at most ~100k tensors)
MAX_NAME_CHARS = 512
MAX_STEP = 1 << 40
MAX_MEAN = 1e6  # a second moment's mean above this is no gradient's: capped, not refused


@dataclass(frozen=True)
class InnerMoments:
    """Per parameter name, the mean of the inner optimizer's second moment; `step`, its step count."""

    step: int
    means: Mapping[str, float]

    def to_wire(self) -> dict[str, Any]:
        return {"step": self.step, "means": dict(self.means)}

    @classmethod
    def from_wire(cls, raw: Any) -> InnerMoments | None:
        """A donor's description, validated (untrusted input); None where it is malformed: the
        joiner then starts its inner optimizer fresh, as without one."""
        if not isinstance(raw, dict) or not is_int(raw.get("step")) or not 1 <= raw["step"] <= MAX_STEP:
            return None
        means = raw.get("means")
        if not isinstance(means, dict) or not 0 < len(means) <= MAX_TENSORS:
            return None
        out: dict[str, float] = {}
        for name, mean in means.items():
            if not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and is_number(mean)):
                return None
            if not (math.isfinite(mean) and mean >= 0):
                return None
            out[name] = min(float(mean), MAX_MEAN)
        return cls(int(raw["step"]), out)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer | None, params: Mapping[str, torch.Tensor]) -> InnerMoments | None:
        """`optimizer`'s description for joiners, or None where it keeps no Adam moments (yet)."""
        if not isinstance(optimizer, torch.optim.Adam):
            return None
        means, steps = {}, []
        with torch.no_grad():
            for name, p in params.items():
                st = optimizer.state.get(p)
                if st and "exp_avg_sq" in st and "step" in st:
                    means[name] = float(st["exp_avg_sq"].float().mean())
                    steps.append(int(st["step"]))
        if not means or max(steps) < 1:
            return None
        return cls(max(steps), means)

    @classmethod
    def median(cls, described: Sequence[InnerMoments]) -> InnerMoments | None:
        """Per name, the median over the donors that described it (module docstring, Trust)."""
        if not described:
            return None
        names = {n for d in described for n in d.means}
        means = {n: statistics.median(d.means[n] for d in described if n in d.means) for n in sorted(names)}
        return cls(int(statistics.median(d.step for d in described)), means)

    def seed(self, optimizer: torch.optim.Optimizer | None, params: Mapping[str, torch.Tensor]) -> int:
        """Fill the moments of `optimizer`'s parameters that have no state yet; returns how many
        tensors were seeded (0 for an optimizer that is not Adam's)."""
        if not isinstance(optimizer, torch.optim.Adam):
            return 0
        fresh = {id(p): n for n, p in params.items() if n in self.means and not optimizer.state.get(p)}
        if not fresh:
            return 0
        sd = optimizer.state_dict()  # by index; `load_state_dict` casts to each parameter's device and dtype
        for group, saved in zip(optimizer.param_groups, sd["param_groups"], strict=True):
            for p, i in zip(group["params"], saved["params"], strict=True):
                name = fresh.get(id(p))
                if name is None:
                    continue
                v = torch.full_like(p, self.means[name], memory_format=torch.preserve_format)
                entry = {"step": torch.tensor(float(self.step)), "exp_avg": torch.zeros_like(p), "exp_avg_sq": v}
                if group.get("amsgrad"):
                    entry["max_exp_avg_sq"] = v.clone()
                sd["state"][i] = entry
        optimizer.load_state_dict(sd)
        return len(fresh)


__all__ = ["InnerMoments"]
