"""Inference with omission: evaluate a pipelined model with some of its stages left out.

Why: a SkipPipe-trained model has seen paths that skip stages, so it should lose little when
stages are omitted at inference (Blagoev et al. 2025 report ~7% perplexity with half the model);
a model trained on the full pipeline was never asked to, and should lose much more. This module
measures both the same way, in one process, on a `GPT` assembled from the stages' weights.

Which stages: stage 0 (embedding + head) is always kept. With `keep` of the n = S − 1 block stages,
`omission_report` averages the perplexity over *every* subset of that size, run in order — one
arbitrary subset could flatter or punish a model by chance, and n ≤ 6 keeps the count small
(at most C(6, 3) = 20 evaluations). The report also names the best and the worst subset.

What it does not do: choose stages adaptively, or run omitted inference over the network.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, block_ranges


@dataclass(frozen=True)
class OmissionReport:
    """full_ppl: perplexity with every stage; subset_ppl: mean perplexity over all subsets of
    `kept` block stages; ratio = subset_ppl / full_ppl; per_subset: stages kept -> perplexity."""

    full_ppl: float
    subset_ppl: float
    ratio: float
    kept: int
    per_subset: dict[tuple[int, ...], float]

    @property
    def best(self) -> tuple[tuple[int, ...], float]:
        return min(self.per_subset.items(), key=lambda kv: kv[1])

    @property
    def worst(self) -> tuple[tuple[int, ...], float]:
        return max(self.per_subset.items(), key=lambda kv: kv[1])


def block_order_for(n_layer: int, n_stages: int, stages: Sequence[int]) -> list[int]:
    """The block indices a path through block stages `stages` (in that order) runs; stage 0 (the
    ends) may appear and contributes no block."""
    runs = block_ranges(n_layer, n_stages - 1)
    order: list[int] = []
    for s in stages:
        if not 0 <= s < n_stages:
            raise ConfigError(f"stage {s} is outside 0..{n_stages - 1}")
        if s:
            order.extend(runs[s - 1])
    return order


def perplexity(
    model: GPT, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_order: Sequence[int] | None = None
) -> float:
    """exp(mean held-out loss) of `model` running `block_order`."""
    return math.exp(model.evaluate(batches, block_order))


def omission_report(
    model: GPT, n_stages: int, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], keep: int | None = None
) -> OmissionReport:
    """Perplexity with all stages vs the mean over every in-order subset of `keep` block stages
    (default: half of them, rounded up)."""
    n = n_stages - 1
    keep = math.ceil(n / 2) if keep is None else keep
    if not 1 <= keep <= n:
        raise ConfigError(f"keep must be between 1 and {n} block stages, got {keep}")
    full = perplexity(model, batches)
    per = {
        subset: perplexity(model, batches, block_order_for(model.config.n_layer, n_stages, subset))
        for subset in itertools.combinations(range(1, n_stages), keep)
    }
    mean = sum(per.values()) / len(per)
    return OmissionReport(full, mean, mean / full, keep, per)
