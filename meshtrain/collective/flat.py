"""The flat vector every collective reduces over, and the digest every collective agrees on.

A collective sees a dict of named tensors of mixed shapes and dtypes; it averages one flat fp32
vector. `flatten_fp32` concatenates the dict (in its order) into that vector, `unflatten` puts a
result back into the caller's names, shapes and dtypes, `part_bounds` cuts the vector into the n
contiguous parts of a reduce-scatter (part j belongs to the j-th peer of the group; equal, or
sized by the shares of shares.py), and `stripe_bounds` cuts a part into the stripes a pipelined
all-reduce moves one at a time. They are
shared by the network all-reduce, the local simulation (whose byte counts must match the
network's) and pairwise averaging, so all three agree on the layout.

`all_finite` is the one finiteness check of every collective's input and received data.

`result_digest` is the blake3 of a result dict (names and raw bytes, in order): the `digest` of
every `ReduceResult`, equal on every contributor.

Not here: the codecs (compression.py), which encode parts of this vector.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import blake3
import torch


def flatten_fp32(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """All of `tensors`, in dict order, as one detached fp32 vector (empty dict: an empty vector)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors.values()])


def flat_view(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """`flatten_fp32(tensors)` without a copy when the dict already is one flat vector: fp32
    tensors, each contiguous, lying back to back in one storage in dict order (an outer
    optimizer's Δ, written into one buffer: optim/outer.py `pseudo_gradient`) — a 1-D view of
    them; None otherwise (the caller flattens a copy)."""
    if not tensors:
        return None
    ts = [t.detach() for t in tensors.values()]
    first = ts[0]
    storage = first.untyped_storage().data_ptr()
    pos = first.storage_offset()
    for t in ts:
        if (
            t.dtype != torch.float32
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != pos
        ):
            return None
        pos += t.numel()
    return first.as_strided((pos - first.storage_offset(),), (1,), first.storage_offset())


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of `x` is finite. One reduction pass: `aminmax` propagates NaN and
    keeps ±inf, ~25× faster than `isfinite(x).all()`, which first writes a bool per element
    (2 ms against 53 ms for 100 MB of fp32; the collectives check every byte they send or take)."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def flat_slice(tensors: dict[str, torch.Tensor], a: int, b: int) -> torch.Tensor:
    """`flatten_fp32(tensors)[a:b]`, without flattening the rest (a fresh fp32 vector)."""
    pieces, pos = [], 0
    for t in tensors.values():
        lo, hi = max(a, pos), min(b, pos + t.numel())
        if lo < hi:
            pieces.append(t.detach().reshape(-1)[lo - pos : hi - pos].to(torch.float32))
        pos += t.numel()
    return torch.cat(pieces) if pieces else torch.zeros(0)


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """`flat` cut back into `names`, each with the shape and dtype of `like[name]`.

    fp32 entries are views of `flat` (callers pass a fresh buffer); others are converted copies."""
    out, pos = {}, 0
    for name in names:
        t = like[name]
        piece = flat[pos : pos + t.numel()].view(t.shape)
        out[name] = piece if t.dtype == torch.float32 else piece.to(t.dtype)
        pos += t.numel()
    return out


def part_bounds(numel: int, n: int, shares: Sequence[int] = ()) -> list[int]:
    """The n + 1 boundaries of n contiguous parts of a vector of `numel` elements: near-equal,
    or with `shares` (n non-negative integers, not all 0; shares.py) part j about
    shares[j] / Σ shares of it, possibly empty. Integer arithmetic only, so every member computes
    the same bounds; equal shares give the equal parts."""
    if not shares:
        return [numel * j // n for j in range(n + 1)]
    if len(shares) != n or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError("shares must be n non-negative integers, not all 0")
    total, acc, bounds = sum(shares), 0, [0]
    for s in shares:
        acc += s
        bounds.append(numel * acc // total)
    return bounds


# The last stripes of a part shrink by halves (`stripe_bounds`): once a part's last stripe is
# reduced, its owner still sends it to every other peer, the one transfer nothing else overlaps.
# With equal 2 MiB stripes that tail was (n − 1) × 2 MiB on the owner's uplink, 1.2 s of a 16.4 s
# round in the WAN lab (scripts/bench/bench_wan.py: 8 peers, 100 Mbit/s); a quarter-MiB last stripe makes it ~0.15 s.
# What this version offers in its joins; each attempt cuts what its coordinator announced
# (collective/protocol.py `taper`: 0 in a group with an older peer).
STRIPE_TAPER = 3


def stripe_bounds(lo: int, hi: int, max_numel: int, taper: int = 0) -> list[int]:
    """Boundaries of the stripes of at most `max_numel` elements that cut [lo, hi) (one stripe
    if it fits, or if it is empty): the units a pipelined all-reduce moves. Near-equal, except
    with `taper` > 0 on a range over twice `max_numel`: then the last `taper` stripes shrink by
    halves (max/2, max/4, … max/2**taper), so that what is left to move after a part's last
    stripe is reduced — its all-gather to every peer — is small (data_phase.py)."""
    step = max(1, max_numel)
    tail = [step >> i for i in range(1, taper + 1) if step >> i] if hi - lo > 2 * step else []
    body = hi - lo - sum(tail)
    count = max(1, -(-body // step))
    bounds = [lo + body * k // count for k in range(count + 1)]
    for size in tail:
        bounds.append(bounds[-1] + size)
    return bounds


def result_digest(tensors: dict[str, torch.Tensor]) -> bytes:
    """blake3 over every name and its tensor's raw bytes, in dict order."""
    h = blake3.blake3()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer only on Python >= 3.12
    return h.digest()
