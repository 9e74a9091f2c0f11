"""The pipeline's hop codec: how one activation or activation gradient crosses a hop between peers.

Problem. Every microbatch crosses every hop of its path twice — its activations forward, their
gradients back — as float32 [batch, time, d_model]: 4 bytes an element, every microbatch, every
iteration. On a slow link that transfer, not the compute, sets the iteration time.

Design. A `HopCodec` is one of the collective's codecs (collective/compression.py: fp16, bf16,
int8 / int4 / fp4 blockwise absmax), picked by name, applied to every activation and gradient
hop of a run. Every peer of a run uses the same one (the run's `PipelineRun.activation_codec`,
in a swarm the spec's `activation_codec`), so no hop carries codec options. Its own name, not
the spec's `codec`: that one compresses outer-optimizer pseudo-gradients, which tolerate far
coarser codes (fp4) than activations, whose error every later stage and the loss see at once.
top-k is not offered: it drops most of an activation, and a hop, unlike an outer round, has no
state to keep the dropped part for (error feedback). "none" (the default) is the float32 tensor
as it is, byte for byte what a run without codecs sends.

Wire: the data-plane payload of one `pipeline/hop` (the control message is runtime.py's, and it
names the codec so that a peer of a differently configured run is refused before any data moves):
- "none": one tensor "h", float32 of the announced shape [b, t, d];
- any other: the codec's parts, 1-D, named, typed and sized by `Codec.layout(b·t·d)` over the
  tensor flattened row-major (int8: "codes" i8[n] and "absmax" f32[⌈n/128⌉], 1.03 bytes an
  element; fp16 / bf16: "values" [n], 2; int4 / fp4: "codes" u8[⌈n/2⌉] and "absmax"
  f32[⌈n/64⌉], 0.56). `nbytes(shape)` is the payload's size.
The error bounds per element are compression.py's table (int8: absmax/254 of each block). int8
and bf16 are scale-free; fp16 flushes magnitudes below ~2^-25 to zero, which small activation
gradients can reach, so prefer bf16 to fp16.

Untrusted input: the receiver allocates exactly the buffers `buffers(shape)` gives for the shape
it accepted, so the data plane refuses other names, dtypes or lengths and a truncated or
over-long payload (a `TransferError` there); `decode` then checks the parts again and refuses
NaN, ±inf or negative scales and non-finite values with `CodecError` (compression.py's checks:
the one set), so what reaches a stage is always finite. `encode` refuses a tensor holding NaN or
±inf (or, fp16, a value beyond its range) with `CodecError`: the runtime reports the hop failed
to the microbatch's origin instead of sending, as it does for input a stage refuses.

Devices: the codec is the one place a hop meets the host. A stage computes on its peer's device
(pipeline/stages.py); `encode` takes the tensor there and hands the data plane host tensors — a
cast codec (fp16, bf16) casts on the device, so half the bytes cross to the host; a blockwise one
copies its chunks to the host as it quantises them, "none" copies the float32 tensor — and
`decode` checks and rebuilds the tensor on the host and moves it to the `device` it was built for,
once. Under the spec's precision bf16 the hops default to bf16 (node/spec/swarm.py): the stages
compute in bf16 anyway, and a hop then costs 2 bytes an element instead of 4.

Cost: one pass over the tensor on each side (encode before the send, decode after the receive),
which the runtime runs in a worker thread (`inline`: all but "none" on the CPU, which is no work).
Whether it pays depends on link speed against CPU: scripts/bench/bench_skippipe.py
`--activation-codec` measures it on a throttled link.

Not here: the hop control message (runtime.py, hop.py), routing and failure handling (runtime.py,
rerouting.py); the codecs themselves (collective/compression.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from meshtrain.collective.compression import CODECS, Codec, CodecError, get_codec
from meshtrain.errors import ConfigError

__all__ = ["ACTIVATION_CODECS", "RAW_PART", "HopCodec"]

# The collective's dense codecs; top-k is left out (module docstring).
ACTIVATION_CODECS: tuple[str, ...] = tuple(c for c in CODECS if c != "topk")
RAW_PART = "h"  # the one tensor of a "none" hop


@dataclass(frozen=True)
class HopCodec:
    """Encode / decode the tensor of one hop with the codec called `name` (`ACTIVATION_CODECS`).

    name: "none" (float32 as it is) or a codec of collective/compression.py, default options.
        An unknown name is a `ConfigError` (a run's codec is configuration, never a peer's input).
    device: where this peer's stage computes: `decode` returns tensors there (default: the CPU).
    """

    name: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    codec: Codec | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.name not in ACTIVATION_CODECS:
            raise ConfigError(
                f"activation codec must be one of {', '.join(ACTIVATION_CODECS)}, got {self.name!r}"
                + (" (top-k drops most of an activation)" if self.name == "topk" else "")
            )
        if self.name != "none":
            object.__setattr__(self, "codec", get_codec(self.name))

    @property
    def inline(self) -> bool:
        """Whether encoding and decoding are no work ("none" on the CPU: the tensor as it is), so
        the runtime need not send them to a worker thread."""
        return self.codec is None and self.device.type == "cpu"

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the payload for a tensor of `shape`."""
        numel = math.prod(shape)
        return 4 * numel if self.codec is None else self.codec.encoded_nbytes(numel)

    def buffers(self, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Empty receive buffers (on the host) for the payload of a tensor of `shape`: exactly what
        `encode` sends, so the data plane refuses anything else."""
        if self.codec is None:
            return {RAW_PART: torch.empty(shape, dtype=torch.float32)}
        layout = self.codec.layout(math.prod(shape))
        return {key: torch.empty(spec.numel, dtype=spec.dtype) for key, spec in layout.items()}

    def encode(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The payload of `t` (float32, or a stage's bf16 output; on any device), as host tensors.
        `CodecError` if a compressing codec cannot encode it (NaN, ±inf, or beyond fp16's range);
        "none" sends `t` as float32, unchecked, as before (a host float32 `t` itself, no copy)."""
        if self.codec is None:
            return {RAW_PART: t.to("cpu", torch.float32)}
        return {key: part.to("cpu") for key, part in self.codec.encode(t).items()}

    def decode(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The float32 tensor of `shape`, on `device`, from an untrusted payload (host tensors);
        `CodecError` if it is not a valid encoding of one (wrong parts, sizes or dtypes; NaN, ±inf
        or negative scales)."""
        if self.codec is None:
            if set(parts) != {RAW_PART}:
                raise CodecError(f"a 'none' hop holds exactly one tensor {RAW_PART!r}")
            h = parts[RAW_PART]
            if not isinstance(h, torch.Tensor) or h.dtype != torch.float32 or tuple(h.shape) != tuple(shape):
                raise CodecError(f"a 'none' hop holds float32 {list(shape)}")
            return h.to(self.device)
        return self.codec.decode(parts, shape, torch.float32).to(self.device)
