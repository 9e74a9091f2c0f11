"""How a dict of named tensors is laid out as bytes: specs, zero-copy views, validated allocation.

A tensor dict travels (and is checkpointed) as its specs — name, dtype, shape, byte size, in
order — followed by the tensors' raw bytes concatenated in that order. `byte_views` exposes each
tensor's storage as a `memoryview` without copying, so the data plane can encrypt straight out of
and decrypt straight into parameter memory. Specs arriving from the network are checked against a
dtype allow-list and size limits before anything is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshtrain.errors import MeshtrainError
from meshtrain.transport.validate import is_int

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_TENSORS = 100_000
MAX_NAME_BYTES = 512
MAX_NDIM = 16


class LayoutError(MeshtrainError):
    """A tensor spec is invalid, too large, or does not match the expected tensors."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, raw: object) -> TensorSpec:
        if not (isinstance(raw, list) and len(raw) == 3):
            raise LayoutError("tensor spec must be [name, dtype, shape]")
        name, dtype, shape = raw
        if not isinstance(name, str) or len(name.encode()) > MAX_NAME_BYTES:
            raise LayoutError("tensor name must be a string of at most 512 bytes")
        if dtype not in DTYPES:
            raise LayoutError(f"dtype {dtype!r:.40} is not allowed")
        if not (
            isinstance(shape, list) and len(shape) <= MAX_NDIM and all(is_int(d) and 0 <= d < 2**40 for d in shape)
        ):
            raise LayoutError(f"bad shape for {name!r}")
        return cls(name, dtype, tuple(shape))


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    out = []
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise LayoutError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        out.append(TensorSpec(name, DTYPE_NAMES[t.dtype], tuple(t.shape)))
    return out


def validate_specs(raw: object, *, max_bytes: int) -> list[TensorSpec]:
    """Parse specs from the wire, enforcing count, uniqueness and total size limits."""
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise LayoutError(f"expected a list of at most {MAX_TENSORS} tensor specs")
    specs = [TensorSpec.from_wire(r) for r in raw]
    if len({s.name for s in specs}) != len(specs):
        raise LayoutError("duplicate tensor names")
    total = sum(s.nbytes for s in specs)
    if total > max_bytes:
        raise LayoutError(f"payload of {total} bytes exceeds the limit of {max_bytes}")
    return specs


def total_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable memoryview (no copy). The tensor must be contiguous CPU."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise LayoutError("tensor must be a contiguous CPU tensor for zero-copy I/O")
    if t.numel() == 0:
        return memoryview(bytearray(0))
    # numpy's stubs give ndarray `__buffer__` only for Python >= 3.12; it is a buffer on 3.11 too
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def byte_views(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    return [byte_view(t) for t in tensors.values()]


def contiguous_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same dict with every tensor on CPU and contiguous (a copy only where needed)."""
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def allocate(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    return {s.name: torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in specs}


def check_matches(specs: list[TensorSpec], into: dict[str, torch.Tensor]) -> None:
    """Raise `LayoutError` unless `into` has exactly these names, dtypes and shapes, in order."""
    mine = specs_of(into)
    if mine != specs:
        names = [s.name for s in specs]
        raise LayoutError(
            f"incoming tensors do not match the receive buffers ({len(names)} vs {len(mine)} tensors; "
            f"first difference at {next((i for i, (a, b) in enumerate(zip(specs, mine, strict=False)) if a != b), min(len(specs), len(mine)))})"
        )
