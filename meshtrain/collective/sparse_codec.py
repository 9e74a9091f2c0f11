"""The sparse wire format of SparseLoCo: chunked top-k, 2-bit values, 12-bit indices.

Why. SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv 2508.15706) sends, per peer and
round, only the k largest-magnitude entries of every chunk of its error-feedback accumulator, with
the values quantised to 2 bits. A dense codec (`compression.py`) cannot carry that: its all-reduce
sums contributions on the way, which fills the index set in (the union of N peers' indices is up to
N times denser) and would have to re-encode. This module is the format alone — a pure function of
one tensor, no I/O — so that the all-gather (`sparse_gather.py`) can move peers' payloads *as
they were encoded*, never densified in transit, and every peer decodes the same bytes to the same
bits.

Layout, per tensor of n elements (flattened row-major, cut into chunks of `chunk` elements; the
last chunk may be shorter, of length L):

    part     dtype[length]                     what
    idx      uint8[ceil(12·K/8)]  (chunk<=4096) the position of each kept value inside its chunk,
             int32[K]             (otherwise)  12-bit little-endian pairs (3 bytes per 2 indices)
    codes    uint8[ceil(K/4)]     (bits = 2)   the value's bin, four 2-bit codes per byte,
             float32[K]           (bits None)  or the values themselves (no quantisation)
    levels   float32[2^bits]      (bits = 2)   what each bin decodes to

where every full chunk keeps k values and the short last chunk ceil(k·L/chunk) (at least 1, at most
L), K being the total — so K, and every part's length, follow from n alone (`layout`): a receiver
knows exactly what to expect from any peer, and checks it. Indices within a chunk are sent in
ascending order.

Cost at the defaults (chunk 4096, k 64, 2 bits): 12 + 2 = 14 bits per kept value, 1.5625% of the
values kept, so 0.0273 bytes per element plus 16 bytes per tensor — 146× fewer bytes than fp32
(Covenant-72B's ">146×", arXiv 2603.08163, is the same arithmetic).

Quantiser (2-bit "statistical", after the reference code's `TopKCompressor._quantize`,
tplr-y/CCLoco `src/tplr/ccloco.py` and tplr-ai/templar `src/tplr/compress/topk.py`: values centred
on their mean, bins of width range·σ/2^bits, each bin decoded as the mean of the values that fell in
it). Ours differs in one detail: the bin is floor(c/w) + 2^(bits−1), clamped, not round(c/w) + that,
so the four bins are symmetric about the mean (−∞, −w), [−w, 0), [0, w), [w, ∞) — with four bins the
reference's rounding makes them lopsided. Default range 4σ (w = σ): top-k values form two lobes,
±(threshold … max), and σ splits each lobe roughly in half. The reference code's default is 6σ at
256 bins (8 bits); the 2-bit setting of the paper is not in a public file we could read.

Decisions a peer relies on:
- Decoding is deterministic elementwise work (a scatter of distinct positions, a table lookup), so
  equal bytes give bit-identical tensors on every machine. Encoding need not be: only its bytes
  travel, and the sender's error feedback uses the decode of its own bytes.
- Parts come from untrusted peers: `decode` checks keys, dtypes and lengths, indices (in range,
  strictly increasing within each chunk) and levels (finite), and raises `SparseCodecError`.
- Non-finite input raises `SparseCodecError` in `encode`.

Not here: error feedback (the optimizer's, `outer.py`), sending (`sparse_gather.py`), summing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from meshtrain.collective.flat import all_finite
from meshtrain.errors import ConfigError, MeshtrainError

__all__ = ["ChunkedTopK", "SparseCodecError", "payload_nbytes"]

PACKED_INDEX_MAX_CHUNK = 4096  # chunk sizes up to this send 12-bit indices


class SparseCodecError(MeshtrainError):
    """A tensor cannot be encoded (non-finite), or parts are not a valid encoding."""


@dataclass(frozen=True)
class ChunkedTopK:
    """Chunked top-k with optional b-bit statistical quantisation of the kept values.

    chunk: elements per chunk (paper and Covenant: 4096).
    k: values kept per full chunk (Covenant: 64 of 4096, 1.56%).
    bits: 2 (the paper), or None to send the kept values as float32 (exact).
    range_sigmas: the quantiser's bin width is range_sigmas·σ / 2^bits (module docstring).
    """

    chunk: int = 4096
    k: int = 64
    bits: int | None = 2
    range_sigmas: float = 4.0

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ConfigError(f"chunk must be an integer >= 1, got {self.chunk!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= self.chunk:
            raise ConfigError(f"k must be an integer in [1, chunk={self.chunk}], got {self.k!r}")
        if self.bits not in (None, 2):
            raise ConfigError(f"bits must be 2 or None (float32 values), got {self.bits!r}")
        if not (isinstance(self.range_sigmas, int | float) and 0 < self.range_sigmas < math.inf):
            raise ConfigError(f"range_sigmas must be a positive number, got {self.range_sigmas!r}")

    @property
    def density(self) -> float:
        return self.k / self.chunk

    # -- layout ---------------------------------------------------------------------------------

    def kept(self, numel: int) -> tuple[int, int, int]:
        """(full chunks, length of the short last chunk (0: none), values kept in it)."""
        full, tail = divmod(numel, self.chunk)
        k_tail = min(tail, max(1, -(-self.k * tail // self.chunk))) if tail else 0
        return full, tail, k_tail

    def num_kept(self, numel: int) -> int:
        full, _, k_tail = self.kept(numel)
        return full * self.k + k_tail

    def layout(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        """Every part's (dtype, length) for a tensor of `numel` elements."""
        K = self.num_kept(numel)
        out: dict[str, tuple[torch.dtype, int]] = {}
        if self.chunk <= PACKED_INDEX_MAX_CHUNK:
            out["idx"] = (torch.uint8, -(-12 * K // 8))
        else:
            out["idx"] = (torch.int32, K)
        if self.bits is None:
            out["codes"] = (torch.float32, K)
        else:
            out["codes"] = (torch.uint8, -(-K * self.bits // 8))
            out["levels"] = (torch.float32, 1 << self.bits)
        return out

    def encoded_nbytes(self, numel: int) -> int:
        return sum(dtype.itemsize * n for dtype, n in self.layout(numel).values())

    # -- encode / decode ------------------------------------------------------------------------

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in the flat tensor, ascending within each chunk; the values there)."""
        flat = x.detach().reshape(-1).to(torch.float32)
        numel = flat.numel()
        full, tail, k_tail = self.kept(numel)
        pos: list[torch.Tensor] = []
        if full:
            rows = flat[: full * self.chunk].view(full, self.chunk)
            idx = torch.topk(rows.abs(), self.k, dim=1, sorted=False).indices.sort(dim=1).values
            pos.append((idx + torch.arange(full).unsqueeze(1) * self.chunk).reshape(-1))
        if tail:
            last = flat[full * self.chunk :]
            idx = torch.topk(last.abs(), k_tail, sorted=False).indices.sort().values
            pos.append(idx + full * self.chunk)
        where = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)
        return where, flat[where]

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts for float tensor `x` (any shape); `SparseCodecError` if `x` is not finite."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise SparseCodecError("can only encode a floating-point tensor")
        if not all_finite(x):
            raise SparseCodecError("cannot encode a tensor holding NaN or ±inf; skip or zero this update")
        where, values = self.select(x)
        local = where % self.chunk
        parts = {"idx": _pack12(local) if self.chunk <= PACKED_INDEX_MAX_CHUNK else local.to(torch.int32)}
        if self.bits is None:
            parts["codes"] = values.clone()
        else:
            codes, levels = self._quantize(values)
            parts["codes"] = _pack2(codes)
            parts["levels"] = levels
        return parts

    def decode(self, parts: Mapping[str, torch.Tensor], shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The float32 tensor of `shape` that `parts` describe (zeros where nothing was kept)."""
        numel = math.prod(shape)
        where, values = self.decode_sparse(parts, numel)
        out = torch.zeros(numel, dtype=torch.float32)
        out[where] = values
        return out.view(tuple(shape))

    def decode_sparse(self, parts: Mapping[str, torch.Tensor], numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, float32 values) from untrusted `parts` of a `numel`-element tensor."""
        layout = self.layout(numel)
        if not isinstance(parts, Mapping) or set(parts) != set(layout):
            raise SparseCodecError(f"sparse parts must be exactly {sorted(layout)}")
        for key, (dtype, n) in layout.items():
            t = parts[key]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.numel() != n:
                raise SparseCodecError(f"sparse part {key!r} must be 1-D {dtype} of length {n}")
        K = self.num_kept(numel)
        full, tail, k_tail = self.kept(numel)
        local = _unpack12(parts["idx"], K) if self.chunk <= PACKED_INDEX_MAX_CHUNK else parts["idx"].to(torch.int64)
        base = torch.cat(
            [
                torch.arange(full).repeat_interleave(self.k) * self.chunk,
                torch.full((k_tail,), full * self.chunk, dtype=torch.int64),
            ]
        )
        lengths = torch.cat(
            [
                torch.full((full * self.k,), self.chunk, dtype=torch.int64),
                torch.full((k_tail,), tail, dtype=torch.int64),
            ]
        )
        if K and not bool(((local >= 0) & (local < lengths)).all()):
            raise SparseCodecError("sparse indices out of their chunk")
        if K > 1:
            same_chunk = base[1:] == base[:-1]
            if not bool((~same_chunk | (local[1:] > local[:-1])).all()):
                raise SparseCodecError("sparse indices must be strictly increasing within a chunk")
        where = base + local
        if self.bits is None:
            values = parts["codes"]
            if K and not bool(torch.isfinite(values).all()):
                raise SparseCodecError("sparse values hold NaN or ±inf")
            values = values.clone()
        else:
            levels = parts["levels"]
            if not bool(torch.isfinite(levels).all()):
                raise SparseCodecError("sparse levels hold NaN or ±inf")
            values = levels[_unpack2(parts["codes"], K).to(torch.int64)]
        return where, values

    def _quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bins = 1 << self.bits  # type: ignore[operator]
        n = values.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.uint8), torch.zeros(bins)
        shift = values.mean()
        centred = values - shift
        sigma = centred.norm() / math.sqrt(n - 1) if n > 1 else torch.tensor(0.0)
        width = float(self.range_sigmas * sigma / bins)
        if not (width > 0 and math.isfinite(width)):
            width = 1.0  # all values equal: one bin holds them, decoded as their mean
        codes = (torch.floor(centred / width) + bins // 2).clamp_(0, bins - 1).to(torch.int64)
        sums = torch.zeros(bins, dtype=torch.float64).index_add_(0, codes, values.to(torch.float64))
        counts = torch.bincount(codes, minlength=bins).to(torch.float64)
        levels = torch.where(counts > 0, sums / counts.clamp_min(1), 0.0).to(torch.float32)
        return codes.to(torch.uint8), levels


def payload_nbytes(parts: Mapping[str, Mapping[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> int:
    """Bytes of a payload (a dict of parts, or a dict of such dicts)."""
    total = 0
    for v in parts.values():
        total += payload_nbytes(v) if isinstance(v, Mapping) else v.numel() * v.element_size()
    return total


# -- bit packing ----------------------------------------------------------------------------------


def _pack12(idx: torch.Tensor) -> torch.Tensor:
    """Values in [0, 4096) as 12-bit little-endian pairs: a, b -> a & 255, a >> 8 | (b & 15) << 4, b >> 4."""
    K = idx.numel()
    v = idx.to(torch.int32)
    if K % 2:
        v = torch.cat([v, torch.zeros(1, dtype=torch.int32)])
    a, b = v[0::2], v[1::2]
    out = torch.stack([a & 255, (a >> 8) | ((b & 15) << 4), b >> 4], dim=1).reshape(-1).to(torch.uint8)
    return out[: -(-12 * K // 8)].contiguous()


def _unpack12(packed: torch.Tensor, K: int) -> torch.Tensor:
    p = packed.to(torch.int64)
    if p.numel() % 3:
        p = torch.cat([p, torch.zeros(3 - p.numel() % 3, dtype=torch.int64)])
    t = p.view(-1, 3)
    a = t[:, 0] | ((t[:, 1] & 15) << 8)
    b = (t[:, 1] >> 4) | (t[:, 2] << 4)
    return torch.stack([a, b], dim=1).reshape(-1)[:K]


def _pack2(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes, four per byte, the first in the lowest bits."""
    K = codes.numel()
    v = codes.to(torch.uint8)
    if K % 4:
        v = torch.cat([v, torch.zeros(4 - K % 4, dtype=torch.uint8)])
    q = v.view(-1, 4)
    return (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).contiguous()


def _unpack2(packed: torch.Tensor, K: int) -> torch.Tensor:
    p = packed.to(torch.uint8)
    return torch.stack([p & 3, (p >> 2) & 3, (p >> 4) & 3, (p >> 6) & 3], dim=1).reshape(-1)[:K]
