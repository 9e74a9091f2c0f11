"""A microbatch's hop: the pipeline's RPC names and the `Hop` that a `pipeline/hop` request announces.

The vocabulary that the runtime (the wire protocol, its validation and its handlers:
`runtime.py`, the protocol's whole story), the worker (`iteration.py`) and the re-routing
(`rerouting.py`) share. A `Hop` is one step of microbatch `mb`, attempt `att`, of iteration `it`
along its source route: `route` = [origin, hop 1, ..., hop L]; position p ≤ L is route[p], and
L + 1 (forward) and 0 (backward) are the origin (`at`); `kind` is "fwd" for activations and
"bwd" for gradients, `shape` the [batch, time, d_model] of the tensor it carries.

Not here: checking a request from the network (`runtime.parse_hop`), encoding the tensor
(`hop_codec.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

HOP_RPC, ABANDON_RPC, FAILED_RPC, DONE_RPC = "pipeline/hop", "pipeline/abandon", "pipeline/failed", "pipeline/done"

WireKind = Literal["fwd", "bwd"]


@dataclass(frozen=True)
class Hop:
    it: int
    mb: int
    att: int
    kind: WireKind
    pos: int
    route: tuple[str, ...]
    shape: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        """The tensor's float32 bytes (what travels is `HopCodec.nbytes(shape)`)."""
        return 4 * math.prod(self.shape)

    def tag(self, run: str) -> str:
        return f"pp/{run}/{self.it}/{self.mb}/{self.att}/{self.kind}/{self.pos}"


def at(route: tuple[str, ...], pos: int) -> str:
    """The peer at position `pos` of a route: route[pos], or the origin past the last hop."""
    return route[pos] if pos < len(route) else route[0]


def sender_of(hop: Hop) -> str:
    return at(hop.route, hop.pos - 1) if hop.kind == "fwd" else at(hop.route, hop.pos + 1)


def shape_of(t: torch.Tensor) -> tuple[int, int, int]:
    b, n, d = t.shape
    return (int(b), int(n), int(d))


__all__ = ["ABANDON_RPC", "DONE_RPC", "FAILED_RPC", "HOP_RPC", "Hop", "WireKind", "at", "sender_of", "shape_of"]
