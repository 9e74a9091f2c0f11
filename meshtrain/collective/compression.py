"""Compression codecs for the tensors outer optimizers exchange: fp16, bf16, int8/int4/fp4, top-k.

Why: an outer round moves a full pseudo-gradient per peer. Streaming DiLoCo (Douillard et al.
2025, §3 and Fig. 11) sends outer gradients as FP4 E3M0 and accumulates in fp32 with no loss in
eval loss, 8x fewer bytes than fp32; our own reference run (docs/algorithms.md) agrees. The collectives
(`RoundRequest(..., codec=name)`, contract.py) and the optimizers pick a codec by name from `CODECS`.

A codec turns one float tensor into a dict of named 1-D tensors ("parts") of fixed dtypes, which
the data plane sends as is, and back. Everything the decoder needs is in the parts or derivable
from the `shape` and `dtype` the caller passes to `decode` (the collective knows them from its own
tensors), so parts hold no Python objects and no header. `Codec.layout(numel)` gives every part's
dtype and length in advance, so a receiver can size buffers and check what arrived;
`Codec.encoded_nbytes(numel)` is their total.

Bounds, per element, for a finite input x decoded to float32 (x in its block of `block_size`
consecutive elements of the flattened tensor, a = that block's max |x|; every quantised bound also
carries an fp32 arithmetic slack of a·2^-20 + 2^-149, which `error_bound` includes):

    codec  parts (dtype[length])                bytes/element              |x - x̂| <=
    none   values f32[n]                        4                          0
    fp16   values f16[n]                        2                          |x|·2^-11 + 2^-25
    bf16   values bf16[n]                       2                          |x|·2^-8 + 2^-134
    int8   codes i8[n], absmax f32[n/B]         1 + 4/B   (B=128: 1.03)   a/254
    int4   codes u8[n/2], absmax f32[n/B]       0.5 + 4/B (B=64: 0.5625)  a/14
    fp4    codes u8[n/2], absmax f32[n/B]       0.5 + 4/B (B=64: 0.5625)  max(|x|/3, a/128)
    topk   values f32[k], indices i32[k]        8·k/n                      0 kept, |x| dropped
           (i64, 12·k/n, if n >= 2^31), k = round(ratio·n), at least 1

(lengths rounded up; "none", and "fp16"/"bf16" on inputs of that same dtype, are lossless.)
- int8 / int4: symmetric blockwise absmax, q = round_half_even(x / a · L) with L = 127 / 7, decoded
  as (q / L) · a, so the step is a/L and a block's largest element is reproduced exactly (int4
  nibble = q + 8, two per byte, low nibble first).
- fp4 is E3M0: a sign bit and a 3-bit exponent e, no mantissa; e = 0 means 0, e = 1..7 means
  2^(e-7), all times the block's absmax. So each element keeps its sign and its magnitude to the
  nearest power of two (ties away from zero) from a down to a/64, relative error <= 1/3 there;
  smaller elements round to 0 or a/64.
- topk keeps the k largest |x| exactly (ties broken by the lower index) and zeroes the rest; the
  error feedback that makes top-k converge is the caller's: `residual` gives t - decode(encode(t)).
Decoding to float16/bfloat16 adds that dtype's rounding (`error_bound(t, dtype)` accounts for it).

Decisions a peer relies on:
- Deterministic: encoding uses only IEEE-exact elementwise arithmetic, max and comparisons (no
  sums, no stochastic rounding), so the same input gives the same bytes on every machine and
  thread count, and every peer decoding the same bytes gets bit-identical tensors.
- Non-finite input (NaN, ±inf, or a value beyond fp16/bf16 range for those codecs) raises
  `CodecError` in `encode`: one NaN would poison a whole block and, once averaged, every peer's
  model. The caller decides whether to skip or zero the update.
- Parts come from untrusted peers. `decode` checks keys, dtypes, lengths and values (finite,
  non-negative scales; sorted in-range top-k indices) and raises `CodecError`, never IndexError,
  RuntimeError or an assertion; its output is always finite.
- Inputs may be float32, float16 or bfloat16 of any shape (0-dim and empty included); `decode`
  returns the dtype asked for. Work runs in fp32 on chunks of 2^20 elements, so memory beyond the
  input and the parts stays at a few MiB whatever the tensor size.

Not here: error feedback state, choosing a codec per tensor, and sending the parts.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.transport.validate import is_int

__all__ = [
    "CODECS",
    "Codec",
    "CodecError",
    "PartSpec",
    "get_codec",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The magnitude from which rounding to each dtype gives ±inf (round half to even at max + ulp/2).
_OVERFLOWS_AT = {
    torch.float32: math.inf,
    torch.float16: 65520.0,
    torch.bfloat16: 2.0**128 * (1 - 2.0**-9),
}
_REL_SLACK = 2.0**-20  # fp32 rounding in the few operations between x and x̂, relative to a
_ABS_SLACK = 2.0**-149  # fp32's smallest subnormal: products with a subnormal scale lose that
# Elements processed at a time (4 MiB of fp32): bounds temporaries, while keeping the number of
# torch calls (and of intra-op parallel regions, costly when cores are contended) small; 2^16
# was 1.6x slower single-threaded and up to 5x slower with a second busy process on 2 cores.
_CHUNK_ELEMENTS = 1 << 20
_INT32_MAX_NUMEL = 2**31 - 1


class CodecError(MeshtrainError):
    """A tensor cannot be encoded (non-finite, out of range) or parts are not a valid encoding."""


@dataclass(frozen=True)
class PartSpec:
    """The dtype and length of one part (all parts are 1-D)."""

    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Codec(ABC):
    """A lossless or lossy tensor codec: `encode` to named parts, `decode` back.

    Subclasses are frozen dataclasses whose fields are the codec's options; two peers must use
    equal codecs (same class and options) for one to decode the other's parts.
    """

    name: ClassVar[str]

    # --- public API -------------------------------------------------------------------------

    @abstractmethod
    def layout(self, numel: int) -> dict[str, PartSpec]:
        """The parts `encode` produces for a tensor of `numel` elements, in a fixed order."""

    def encoded_nbytes(self, numel: int) -> int:
        """Bytes of all parts for a tensor of `numel` elements."""
        return sum(spec.nbytes for spec in self.layout(numel).values())

    def encode(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode a float32/float16/bfloat16 tensor; raise `CodecError` if it is not finite.

        The parts are new contiguous 1-D tensors (never views of `t`), in `layout` order.
        """
        flat = _flat_input(t)
        with torch.no_grad():
            parts = self._encode(flat)
        return parts

    def decode(
        self,
        parts: Mapping[str, torch.Tensor],
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Rebuild a tensor of `shape` and `dtype` from untrusted `parts`; `CodecError` if invalid.

        Raises `CodecError` too when a decoded value does not fit `dtype` (e.g. fp32 data above
        65504 decoded to float16); the result is always finite.
        """
        shape = _check_shape(shape)
        if dtype not in FLOAT_DTYPES:
            raise CodecError(f"cannot decode to {dtype}; ask for one of {FLOAT_DTYPES}")
        numel = math.prod(shape)
        _check_parts(self.name, parts, self.layout(numel))
        with torch.no_grad():
            out = self._decode(parts, numel, dtype)
        return out.view(shape)

    def residual(self, t: torch.Tensor, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """t − decode(parts) in float32: what the codec lost, for the caller's error feedback."""
        x = _flat_input(t).to(torch.float32)
        return (x - self.decode(parts, (x.numel(),), torch.float32)).view(t.shape)

    def error_bound(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Per-element bound on |t − decode(encode(t), t.shape, dtype)|, as float64 of t's shape.

        `dtype` defaults to t's dtype. The bound is the table in this module's docstring plus,
        when decoding to float16/bfloat16, that dtype's rounding of the result.
        """
        dtype = t.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise CodecError(f"no bound for decoding to {dtype}; decode returns {FLOAT_DTYPES}")
        x = _flat_input(t).to(torch.float64)
        bound = self._bound(x)
        if dtype == torch.float32:
            pass  # decode computes in fp32: nothing more
        elif dtype == t.dtype:
            # x is representable in dtype, so rounding x̂ to the nearest dtype value moves it at
            # most |x̂ − x| further away: the error at most doubles.
            bound = 2 * bound
        else:
            info = torch.finfo(dtype)
            bound = bound + (x.abs() + bound) * (info.eps / 2) + info.smallest_normal * info.eps / 2
        return bound.view(t.shape)

    # --- what each codec provides -----------------------------------------------------------

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode flat `x` (any float dtype, maybe a view of the caller's tensor)."""

    @abstractmethod
    def _decode(self, parts: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Decode parts whose dtypes and lengths are already checked into a new flat tensor."""

    @abstractmethod
    def _bound(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32-decode bound for flat float64 `x`."""


# --- lossless-ish: cast codecs --------------------------------------------------------------


@dataclass(frozen=True)
class _CastCodec(Codec):
    """Send the values cast to one float dtype."""

    wire_dtype: ClassVar[torch.dtype]

    def layout(self, numel: int) -> dict[str, PartSpec]:
        return {"values": PartSpec(self.wire_dtype, numel)}

    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        limit = _OVERFLOWS_AT[self.wire_dtype]
        if not _max_abs(x) < limit:
            raise CodecError(
                f"cannot encode with {self.name!r}: the tensor holds NaN, ±inf or a value whose "
                f"magnitude is >= {limit:g}; skip or zero this update, or use codec 'none'"
            )
        return {"values": x.to(self.wire_dtype, copy=True)}

    def _decode(self, parts: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        values = parts["values"]
        _check_fits(self.name, _max_abs(values), dtype, what="a value")
        return values.to(dtype, copy=True)

    def _bound(self, x: torch.Tensor) -> torch.Tensor:
        if self.wire_dtype == torch.float32:
            return torch.zeros_like(x)
        info = torch.finfo(self.wire_dtype)
        # Round to nearest: half an ulp, relative for normals, absolute (half the smallest
        # subnormal) below them.
        return x.abs() * (info.eps / 2) + info.smallest_normal * info.eps / 2


@dataclass(frozen=True)
class NoCompression(_CastCodec):
    """float32 values as they are: exact for float32, float16 and bfloat16 inputs."""

    name: ClassVar[str] = "none"
    wire_dtype: ClassVar[torch.dtype] = torch.float32


@dataclass(frozen=True)
class Float16Codec(_CastCodec):
    """float16 values: relative error 2^-11, range ±65504 (larger values raise CodecError)."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True)
class BFloat16Codec(_CastCodec):
    """bfloat16 values: relative error 2^-8, fp32's range."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16


# --- blockwise quantisers -------------------------------------------------------------------


@dataclass(frozen=True)
class _BlockwiseCodec(Codec):
    """Cut the flat tensor into blocks of `block_size`, send each block's absmax in fp32 and
    every element quantised relative to it (the last block is zero-padded; padding is not sent).

    The absmax itself, not absmax/levels, is the scale on the wire: decoding computes
    (code value in [-1, 1]) · absmax, so a block's largest element comes back exactly and no
    decoded value can exceed the block's absmax (nor overflow fp32).
    """

    block_size: int = 64
    codes_dtype: ClassVar[torch.dtype]
    codes_per_byte: ClassVar[int]

    def __post_init__(self) -> None:
        b = self.block_size
        if not (is_int(b) and 1 <= b <= _CHUNK_ELEMENTS):
            raise ConfigError(f"{self.name} block_size must be an int in [1, {_CHUNK_ELEMENTS}], got {b!r}")
        if b % self.codes_per_byte:
            raise ConfigError(f"{self.name} block_size must be even (two codes per byte), got {b}")

    def layout(self, numel: int) -> dict[str, PartSpec]:
        return {
            "codes": PartSpec(self.codes_dtype, -(-numel // self.codes_per_byte)),
            "absmax": PartSpec(torch.float32, -(-numel // self.block_size)),
        }

    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        numel, block = x.numel(), self.block_size
        spec = self.layout(numel)
        codes = torch.empty(spec["codes"].numel, dtype=self.codes_dtype)
        absmax = torch.empty(spec["absmax"].numel, dtype=torch.float32)
        chunk_blocks = max(1, _CHUNK_ELEMENTS // block)
        buf = torch.empty(min(absmax.numel(), chunk_blocks) * block, dtype=torch.float32)
        for first in range(0, absmax.numel(), chunk_blocks):
            last = min(absmax.numel(), first + chunk_blocks)
            lo, hi = first * block, min(numel, last * block)
            work = buf[: (last - first) * block]
            work[: hi - lo].copy_(x[lo:hi])
            work[hi - lo :].zero_()  # padding of the last block: must not change its absmax
            blocks = work.view(last - first, block)
            low, high = torch.aminmax(blocks, dim=1)
            # NaN propagates through aminmax and maximum. abs() on both sides, not maximum(high,
            # -low): for an all-zero block that would be max(0.0, -0.0), whose sign bit depends
            # on which kernel (vectorised or scalar tail) ran, and the bytes must not.
            a = torch.maximum(high.abs(), low.abs())
            if not bool(torch.isfinite(a).all()):
                raise CodecError(
                    f"cannot encode with {self.name!r}: the tensor holds NaN or ±inf "
                    f"(in elements {lo}..{hi - 1}); skip or zero this update"
                )
            absmax[first:last] = a
            # |x / a| <= 1 exactly in fp32 (rounding is monotone and 1 is representable); an
            # all-zero block divides by 1 instead of 0.
            blocks.div_(torch.where(a > 0, a, 1.0).unsqueeze(1))
            per_byte = self.codes_per_byte
            self._quantize(work, codes[lo // per_byte : -(-hi // per_byte)])
        return {"codes": codes, "absmax": absmax}

    def _decode(self, parts: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        codes, absmax = parts["codes"], parts["absmax"]
        # A negative, NaN or infinite scale can only come from a broken or hostile peer.
        if absmax.numel() and not bool(((absmax >= 0) & (absmax <= torch.finfo(torch.float32).max)).all()):
            raise CodecError(f"{self.name} parts hold a negative or non-finite block absmax")
        _check_fits(self.name, float(absmax.max()) if absmax.numel() else 0.0, dtype, what="a block absmax")
        block, per_byte = self.block_size, self.codes_per_byte
        out = torch.empty(numel, dtype=dtype)
        chunk_blocks = max(1, _CHUNK_ELEMENTS // block)
        buf = torch.empty(min(absmax.numel(), chunk_blocks) * block, dtype=torch.float32)
        for first in range(0, absmax.numel(), chunk_blocks):
            last = min(absmax.numel(), first + chunk_blocks)
            lo, hi = first * block, min(numel, last * block)
            # Write straight into the output when no cast and no padding is involved.
            direct = dtype == torch.float32 and hi - lo == (last - first) * block
            work = out[lo:hi] if direct else buf[: (last - first) * block]
            self._dequantize(codes[lo // per_byte : -(-hi // per_byte)], work)
            work.view(last - first, block).mul_(absmax[first:last].unsqueeze(1))
            if not direct:
                out[lo:hi].copy_(work[: hi - lo])
        return out

    def _bound(self, x: torch.Tensor) -> torch.Tensor:
        a = _block_absmax_per_element(x, self.block_size)
        return self._quantisation_bound(x, a) + a * _REL_SLACK + _ABS_SLACK

    @abstractmethod
    def _quantize(self, work: torch.Tensor, codes: torch.Tensor) -> None:
        """Write codes for `work` (values in [-1, 1], may be overwritten) into `codes`, whose
        length is that of `work` divided by codes per byte and rounded up, or less (the tail of
        the last chunk, which is padding, is then dropped)."""

    @abstractmethod
    def _dequantize(self, codes: torch.Tensor, work: torch.Tensor) -> None:
        """Write the code values in [-1, 1] into `work` (entries beyond the codes: anything)."""

    @abstractmethod
    def _quantisation_bound(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The exact-arithmetic bound for values `x` in blocks of absmax `a` (float64)."""


@dataclass(frozen=True)
class Int8Codec(_BlockwiseCodec):
    """Blockwise absmax int8: q in [-127, 127], step absmax/127."""

    name: ClassVar[str] = "int8"
    block_size: int = 128
    codes_dtype: ClassVar[torch.dtype] = torch.int8
    codes_per_byte: ClassVar[int] = 1

    def _quantize(self, work: torch.Tensor, codes: torch.Tensor) -> None:
        work.mul_(127).round_()  # round half to even, exact integers in [-127, 127]
        codes.copy_(work[: codes.numel()])

    def _dequantize(self, codes: torch.Tensor, work: torch.Tensor) -> None:
        work[: codes.numel()].copy_(codes)
        work[codes.numel() :].zero_()
        # -128 is never sent; clamping it keeps every decoded |value| <= its block's absmax.
        # q/127 <= 1 exactly, so q=127 gives back the absmax bit for bit.
        work.clamp_(min=-127).div_(127)

    def _quantisation_bound(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return a / 254


class _PackedNibbleCodec(_BlockwiseCodec):
    """Two 4-bit codes per byte, the first element in the low nibble; decoded by table lookup."""

    codes_dtype: ClassVar[torch.dtype] = torch.uint8
    codes_per_byte: ClassVar[int] = 2
    # value of each nibble in [-1, 1], and of each byte as (low nibble, high nibble)
    nibble_values: ClassVar[torch.Tensor]
    byte_values: ClassVar[torch.Tensor]

    def _quantize(self, work: torch.Tensor, codes: torch.Tensor) -> None:
        nibbles = self._nibbles(work).view(-1, 2)[: codes.numel()]
        torch.bitwise_or(nibbles[:, 0], nibbles[:, 1] << 4, out=codes)

    def _dequantize(self, codes: torch.Tensor, work: torch.Tensor) -> None:
        pairs = work.view(-1, 2)
        torch.index_select(self.byte_values, 0, codes.to(torch.int32), out=pairs[: codes.numel()])
        pairs[codes.numel() :].zero_()

    @abstractmethod
    def _nibbles(self, work: torch.Tensor) -> torch.Tensor:
        """uint8 codes in [0, 15] for `work` (values in [-1, 1], may be overwritten)."""


def _byte_table(nibble_values: torch.Tensor) -> torch.Tensor:
    byte = torch.arange(256)
    return torch.stack([nibble_values[byte & 15], nibble_values[byte >> 4]], dim=1).contiguous()


@dataclass(frozen=True)
class Int4Codec(_PackedNibbleCodec):
    """Blockwise absmax int4: q in [-7, 7], step absmax/7, nibble q + 8 (nibble 0 decodes as -7)."""

    name: ClassVar[str] = "int4"
    nibble_values: ClassVar[torch.Tensor] = (torch.arange(16) - 8).clamp(-7, 7).float() / 7
    byte_values: ClassVar[torch.Tensor] = _byte_table(nibble_values)

    def _nibbles(self, work: torch.Tensor) -> torch.Tensor:
        return work.mul_(7).round_().add_(8).to(torch.uint8)

    def _quantisation_bound(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return a / 14


def _fp4_e3m0_values() -> torch.Tensor:
    code = torch.arange(16)
    exponent = code & 7
    magnitude = torch.where(exponent > 0, torch.exp2((exponent - 7).float()), 0.0)
    return torch.where(code >= 8, -magnitude, magnitude)


@dataclass(frozen=True)
class Fp4Codec(_PackedNibbleCodec):
    """Blockwise FP4 E3M0: nibble = sign << 3 | e; value ±2^(e−7)·absmax for e >= 1, 0 for e = 0.

    Rounding to the nearest representable magnitude is done on the fp32 bit pattern of
    y = |x|/absmax in [0, 1]: adding half a mantissa (0x400000) carries into the exponent field
    exactly when y >= 1.5 · 2^floor(log2 y), i.e. when the next power of two is nearer (ties
    up); the exponent field is then the rounded exponent. Below the smallest level 2^-6 the
    choice is between 0 and 2^-6 with the midpoint 2^-7 instead, handled by one comparison.
    """

    name: ClassVar[str] = "fp4"
    nibble_values: ClassVar[torch.Tensor] = _fp4_e3m0_values()
    byte_values: ClassVar[torch.Tensor] = _byte_table(nibble_values)
    _HALF_MANTISSA: ClassVar[int] = 1 << 22
    _EXP_OF_2_TO_MINUS_7: ClassVar[int] = 127 - 7  # biased fp32 exponent of 2^-7

    def _nibbles(self, work: torch.Tensor) -> torch.Tensor:
        bits = work.view(torch.int32)
        negative = bits < 0
        bits.bitwise_and_(0x7FFFFFFF)  # |y|
        at_least_smallest_midpoint = bits >= (self._EXP_OF_2_TO_MINUS_7 << 23)
        # rounded biased exponent − 120 = e; y <= 1 keeps it <= 7, tiny y go negative → 0
        bits.add_(self._HALF_MANTISSA).bitwise_right_shift_(23).sub_(self._EXP_OF_2_TO_MINUS_7)
        exponent = bits.clamp_(0, 7).to(torch.uint8)
        exponent = torch.maximum(exponent, at_least_smallest_midpoint.to(torch.uint8))
        return exponent.bitwise_or_(negative.to(torch.uint8) << 3)

    def _quantisation_bound(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x.abs() / 3, a / 128)


# --- sparsification -------------------------------------------------------------------------


@dataclass(frozen=True)
class TopKCodec(Codec):
    """Keep the k = round(ratio · numel) (at least 1) largest-magnitude values, exactly.

    Ties at the k-th magnitude go to the lower indices, so the choice is deterministic; indices
    are sent sorted ascending and the decoder insists on that (no duplicates, in range).
    """

    name: ClassVar[str] = "topk"
    ratio: float = 0.01

    def __post_init__(self) -> None:
        if not (isinstance(self.ratio, int | float) and 0 < self.ratio <= 1):
            raise ConfigError(f"topk ratio must be in (0, 1], got {self.ratio!r}")

    def k(self, numel: int) -> int:
        """How many values are kept of `numel`."""
        return 0 if numel == 0 else min(numel, max(1, round(self.ratio * numel)))

    def layout(self, numel: int) -> dict[str, PartSpec]:
        k = self.k(numel)
        index_dtype = torch.int32 if numel <= _INT32_MAX_NUMEL else torch.int64
        return {"values": PartSpec(torch.float32, k), "indices": PartSpec(index_dtype, k)}

    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        numel = x.numel()
        spec = self.layout(numel)
        if not _max_abs(x) < math.inf:
            raise CodecError("cannot encode with 'topk': the tensor holds NaN or ±inf; skip or zero this update")
        k = spec["values"].numel
        if k == numel:
            kept = torch.arange(numel)
        else:
            magnitude = x.abs()
            threshold = torch.topk(magnitude, k, sorted=False).values.min()  # k-th largest |x|
            above = (magnitude > threshold).nonzero().view(-1)
            at = (magnitude == threshold).nonzero().view(-1)[: k - above.numel()]
            kept = torch.cat([above, at]).sort().values
        return {
            "values": x[kept].to(torch.float32),
            "indices": kept.to(spec["indices"].dtype),
        }

    def _decode(self, parts: Mapping[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        values, indices = parts["values"], parts["indices"]
        _check_fits(self.name, _max_abs(values), dtype, what="a value")
        if indices.numel() and not (
            int(indices[0]) >= 0 and int(indices[-1]) < numel and bool((indices[1:] > indices[:-1]).all())
        ):
            raise CodecError("topk indices must be strictly increasing and within the tensor")
        out = torch.zeros(numel, dtype=dtype)
        out[indices.to(torch.int64)] = values.to(dtype)
        return out

    def _bound(self, x: torch.Tensor) -> torch.Tensor:
        k = self.k(x.numel())
        if k == x.numel():
            return torch.zeros_like(x)
        magnitude = x.abs()
        threshold = torch.topk(magnitude, k).values.min()
        # above the k-th magnitude: kept exactly; at or below it: maybe dropped
        return torch.where(magnitude > threshold, 0.0, magnitude)


# --- registry -------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (
        NoCompression,
        Float16Codec,
        BFloat16Codec,
        Int8Codec,
        Int4Codec,
        Fp4Codec,
        TopKCodec,
    )
}
CODECS: tuple[str, ...] = tuple(_REGISTRY)


def get_codec(name: str, **options: object) -> Codec:
    """The codec called `name` (one of `CODECS`), with options such as `block_size` or `ratio`.

    An unknown name is a `CodecError` (names arrive from peers); a bad option a `ConfigError`.
    """
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(CODECS)}")
    try:
        return cls(**options)
    except TypeError as e:
        raise ConfigError(f"bad options for codec {name!r}: {e}") from None


# --- helpers --------------------------------------------------------------------------------


def _flat_input(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"can only encode a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise CodecError(f"can only encode {FLOAT_DTYPES}, got {t.dtype}; cast first")
    return t.detach().reshape(-1)


def _max_abs(t: torch.Tensor) -> float:
    """max |t| as a Python float: NaN if t holds a NaN, 0 if empty. One fast pass, no temporary."""
    if t.numel() == 0:
        return 0.0
    low, high = torch.aminmax(t)
    return max(float(high), -float(low)) if not (low.isnan() or high.isnan()) else math.nan


def _check_fits(codec: str, max_abs: float, dtype: torch.dtype, *, what: str) -> None:
    if not max_abs < math.inf:  # also catches NaN
        raise CodecError(f"{codec} parts hold NaN or ±inf")
    if not max_abs < _OVERFLOWS_AT[dtype]:
        raise CodecError(f"{codec} parts hold {what} of {max_abs:g}, too large for {dtype}; decode to float32")


def _check_shape(shape: object) -> tuple[int, ...]:
    if not isinstance(shape, tuple | list | torch.Size) or not all(is_int(d) and d >= 0 for d in shape):
        raise CodecError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    return tuple(shape)


def _check_parts(codec: str, parts: object, layout: dict[str, PartSpec]) -> None:
    if not isinstance(parts, Mapping):
        raise CodecError(f"{codec} parts must be a dict of tensors, got {type(parts).__name__}")
    if set(parts) != set(layout):
        raise CodecError(f"{codec} parts must be exactly {sorted(layout)}, got {sorted(map(str, parts))}")
    for key, spec in layout.items():
        part = parts[key]
        if not isinstance(part, torch.Tensor):
            raise CodecError(f"{codec} part {key!r} is a {type(part).__name__}, not a tensor")
        if part.dtype != spec.dtype or part.dim() != 1 or part.numel() != spec.numel:
            raise CodecError(
                f"{codec} part {key!r} must be 1-D {spec.dtype} of length {spec.numel}, "
                f"got {part.dtype} of shape {tuple(part.shape)} (sender used other codec options?)"
            )


def _block_absmax_per_element(x: torch.Tensor, block: int) -> torch.Tensor:
    numel = x.numel()
    padded = torch.zeros(-(-numel // block) * block, dtype=x.dtype)
    padded[:numel] = x.abs()
    blocks = padded.view(-1, block)
    return blocks.amax(dim=1, keepdim=True).expand_as(blocks).reshape(-1)[:numel]
