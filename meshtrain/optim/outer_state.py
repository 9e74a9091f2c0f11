"""An outer optimizer's state as it travels: the format, what a state must hold to be loaded, and
the host copies φ lives in.

Problem. `OuterOptimizer.state_dict` (outer.py) is a peer's whole outer state — φ, the outer
optimizer's state, registered buffers, the step counter — written into checkpoints and served to
late joiners. What a peer loads may come from its own disk, from another build of the code, or
from a stranger's donor: before any tensor of ours is written, it must be the same algorithm with
the same schedule (H, fragmentation), the same parameter names and shapes, the same buffers and
outer optimizer, and sane counters. One check says so, and names what differs.

Design.
    STATE_FORMAT        the format tag every state carries ("meshtrain.outer/1")
    StateLayout         what a state must match for one optimizer (`OuterOptimizer.state_layout`):
                        `check(state)` raises `OuterStateError` naming the first difference
    fragment_partition  the fragments an optimizer is built with, checked to partition its
                        trainable parameters exactly once
    host_empty, host_copy, synchronize
                        φ and every registered buffer live on the host in fp32, pinned when the
                        model is on a CUDA device (outer.py, "Devices"); a device's queued copies
                        are waited for once

Failures. `OuterStateError`: the state cannot be loaded here (another algorithm, schedule or model)
— a different swarm's or a corrupt state, not worth retrying. `StaleStateError`, a subclass: the
state is fine but its moment has passed (a round old, or an exchange of ours is in flight) — fetch
a newer one or try again after the exchange (node/state/download.py tells the two apart).

Not here: writing and loading the state (`state_dict`, `load_state_dict`, `join`, outer.py), the
files it is saved in (node/state/), how it travels to joiners (node/state/donor.py, sync.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.errors import MeshtrainError
from meshtrain.transport.validate import is_int

__all__ = [
    "STATE_FORMAT",
    "OuterStateError",
    "StaleStateError",
    "StateLayout",
    "fragment_partition",
    "host_copy",
    "host_empty",
    "synchronize",
]

STATE_FORMAT = "meshtrain.outer/1"


class OuterStateError(MeshtrainError):
    """A state dict cannot be produced or loaded (wrong algorithm, shapes, or an exchange in flight)."""


class StaleStateError(OuterStateError):
    """The state is fine but its moment has passed (a round old, or an exchange is in flight):
    a transient — fetch a newer state, or try again after the exchange."""


@dataclass(frozen=True)
class StateLayout:
    """What a state dict must match to be loaded into one optimizer.

    algorithm: the optimizer's class name. H, fragments: its schedule. shapes: φ's parameter names
    and shapes (every registered buffer is shaped alike). buffers: the registered buffers' names.
    has_outer_optimizer: whether it keeps a torch optimizer over φ (whose state travels too).
    """

    algorithm: str
    H: int
    fragments: tuple[tuple[str, ...], ...]
    shapes: Mapping[str, torch.Size]
    buffers: frozenset[str]
    has_outer_optimizer: bool

    def check(self, state: Any) -> None:
        """`OuterStateError` naming the first way `state` differs from this layout."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise OuterStateError(f"not a {STATE_FORMAT} state dict")
        if state.get("algorithm") != self.algorithm:
            raise OuterStateError(f"state is from {state.get('algorithm')!r}, this is {self.algorithm}")
        if state.get("H") != self.H or [list(f) for f in self.fragments] != state.get("fragments"):
            raise OuterStateError(
                "state was made with a different H or fragmentation; every peer of a swarm must use the same schedule"
            )
        phi = state.get("outer_params")
        if not isinstance(phi, dict) or set(phi) != set(self.shapes):
            raise OuterStateError("state's parameter names differ from this model's")
        for n, t in phi.items():
            if not self._fits(n, t):
                raise OuterStateError(f"state's {n} has the wrong shape")
        buffers = state.get("buffers")
        if not isinstance(buffers, dict) or set(buffers) != self.buffers:
            raise OuterStateError("state's buffers differ from this optimizer's")
        for k, b in buffers.items():
            if not isinstance(b, dict) or set(b) != set(self.shapes) or not all(self._fits(n, t) for n, t in b.items()):
                raise OuterStateError(f"state's buffer {k!r} does not match the parameters")
        if self.has_outer_optimizer != (state.get("outer_optimizer") is not None):
            raise OuterStateError("state's outer optimizer does not match this optimizer's")
        for key in ("inner_steps", "rounds"):
            if not is_int(state.get(key)) or state[key] < 0:
                raise OuterStateError(f"state's {key} must be a non-negative integer")

    def _fits(self, name: str, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.shape == self.shapes[name]


def fragment_partition(names: Sequence[str], fragments: Sequence[Sequence[str]] | None) -> list[tuple[str, ...]]:
    """`fragments` as tuples, checked to partition `names` (the trainable parameters) exactly once;
    None is one fragment of them all. `ValueError` naming what is missing or unknown."""
    if fragments is None:
        return [tuple(names)]
    out = [tuple(f) for f in fragments]
    seen = [n for f in out for n in f]
    if not out or any(not f for f in out):
        raise ValueError("fragments must be non-empty lists of parameter names")
    if len(seen) != len(set(seen)) or set(seen) != set(names):
        missing, extra = set(names) - set(seen), set(seen) - set(names)
        raise ValueError(
            f"fragments must partition the trainable parameters exactly once "
            f"(missing {sorted(missing)[:3]}, unknown {sorted(extra)[:3]})"
        )
    return out


def host_empty(t: torch.Tensor) -> torch.Tensor:
    """A host fp32 tensor shaped like `t`: pinned when `t` is on a CUDA device, so copies between
    the two can be non_blocking (a model on the CPU pins nothing, CUDA present or not: pinned
    memory is locked out of the kernel's reach)."""
    return torch.empty(t.shape, dtype=torch.float32, device="cpu", pin_memory=t.is_cuda)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into `host_empty(t)`."""
    return host_empty(t).copy_(t.detach())


def synchronize(device: torch.device) -> None:
    """Wait for the copies and compute queued on `device`'s current stream (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()
