"""Error feedback: what a lossy codec leaves out of one send is kept, and sent in a later one.

Design. With `error_feedback = β` (a float in [0, 1], `OuterOptimizer`, outer.py) each peer
keeps an accumulator e per parameter (its `residual`) and, at every send, does e ← β·e + Δ;
ŝ = encode(e); e ← e − decode(ŝ), sending ŝ instead of Δ (β = 1: classic error feedback, Seide
et al. 2014 / Karimireddy et al. 2019; β < 1: SparseLoCo's decayed accumulator, which replaces
the outer momentum — docs/algorithms.md). What encode and decode are is the optimizer's
`compress` hook; `codec_round_trip` is its default, the optimizer's codec applied to each tensor
whole.

State. e is this peer's own: saved by `state_dict(inner=True)` (checkpoints), never averaged,
never in `state_dict(inner=False)` (what joiners download); a join starts it afresh. A joiner's
weight-0 exchanges skip it (outer_exchanges.py, "Weights").

Failures. `ValueError` for a β that is None or outside [0, 1].

Not here: when it runs (the round logic, outer_exchanges.py), the codecs (collective/compression.py),
SparseLoCo's sparse payload (sparseloco.py overrides `compress`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["Compress", "codec_round_trip", "feed_back_into"]

# (what `communicate` sends, what it decodes to) for the accumulator e of the names
Compress = Callable[[dict[str, torch.Tensor], Sequence[str]], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def feed_back_into(
    residual: dict[str, torch.Tensor],
    beta: float | None,
    delta: Mapping[str, torch.Tensor],
    names: Sequence[str],
    compress: Compress,
    like: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """e ← β·e + Δ; (send, ŝ) = compress(e); e ← e − ŝ; returns `send`. `residual`: e by name,
    updated in place (a missing e starts as zeros shaped as in `like`, φ)."""
    if beta is None:
        raise ValueError("feed_back needs error feedback: set error_feedback = β, a float in [0, 1]")
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"error_feedback β must be in [0, 1], got {beta!r}")
    for n in names:
        e = residual.get(n)
        if e is None:
            e = residual[n] = torch.zeros_like(like[n])
        e.mul_(beta).add_(delta[n].to(torch.float32))
    send, decoded = compress({n: residual[n] for n in names}, names)
    for n in names:
        residual[n].sub_(decoded[n])
    return send


def codec_round_trip(
    codec_name: str, accumulated: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The default `compress`: `codec_name` applied to each tensor whole; the decoded values are
    sent (the collective encodes them again — exact for "none"/"fp16"/"bf16" after a cast codec)."""
    from meshtrain.collective.compression import get_codec

    codec = get_codec(codec_name)
    decoded = {n: codec.decode(codec.encode(t), t.shape, torch.float32) for n, t in accumulated.items()}
    return decoded, decoded
