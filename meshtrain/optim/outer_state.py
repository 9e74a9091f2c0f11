"""An outer optimizer's state as it travels: how it is written and loaded, the format, what a
state must hold to be loaded, and the host copies φ lives in.

Problem. `OuterOptimizer.state_dict` (outer.py) is a peer's whole outer state — φ, the outer
optimizer's state, registered buffers, the step counter — written into checkpoints and served to
late joiners. What a peer loads may come from its own disk, from another build of the code, or
from a stranger's donor: before any tensor of ours is written, it must be the same algorithm with
the same schedule (H, fragmentation), the same parameter names and shapes, the same buffers and
outer optimizer, and sane counters. One check says so, and names what differs.

Design.
    OuterState          writes an optimizer's state dict and loads one into it (`state_dict`,
                        `load_state_dict`, outer.py), and keeps its registered buffers
    STATE_FORMAT        the format tag every state carries ("meshtrain.outer/1")
    StateLayout         what a state must match for one optimizer (`OuterOptimizer.state_layout`):
                        `check(state)` raises `OuterStateError` naming the first difference
    OptimizerLayout     the part of it for the torch optimizer over φ (`outer_optimizer`): the
                        same parameter groups over the same parameters, each hyper-parameter of
                        the kind ours is (a finite number where ours is one: a donor's "x" or
                        NaN learning rate loaded fine and failed, or poisoned φ, at the next outer
                        step), and per-parameter state as a step of ours would leave it (a
                        momentum buffer of another shape loaded fine and failed at the next outer
                        step). Hyper-parameters are not compared with ours: peers of
                        one spec hold the same, and a state may carry keys another torch release
                        added.
    fragment_partition  the fragments an optimizer is built with, checked to partition its
                        trainable parameters exactly once
    host_empty, host_copy, synchronize
                        φ and every registered buffer live on the host in fp32, pinned when the
                        model is on a CUDA device (outer.py, "Devices"); a device's queued copies
                        are waited for once

Writing and loading. A state holds φ, the registered buffers and the outer optimizer's state
(`OuterState.write`: copies, or with `copy=False` the live tensors, lent out: outer.py "State
lent out"), the schedule it was made with, the counters (`inner_steps`, `rounds`) and, for a
checkpoint (`inner`), the inner optimizer's state and this peer's error-feedback residual, which
never travel to joiners. `load` checks the whole state first (`StateLayout`) and only then
copies it into the optimizer's own tensors, bit-exactly; a residual whose shapes do not fit is
dropped, not refused. Neither runs while an exchange is in flight: `OuterStateError` for
`write`, `StaleStateError` for `load`.

What a state is checked for is its structure, not its values: φ is not scanned for NaN (a pass
over a model's worth of memory at every join), nor compared with the swarm's beyond the state
download's digest vote (node/state/fetch.py).

Failures. `OuterStateError`: the state cannot be loaded here (another algorithm, schedule or model)
— a different swarm's or a corrupt state, not worth retrying. `StaleStateError`, a subclass: the
state is fine but its moment has passed (a round old, or an exchange of ours is in flight) — fetch
a newer one or try again after the exchange (node/state/download.py tells the two apart).

Not here: what loading a state does to the rest of the optimizer — the model's θ, the weights of
its next exchanges, a joiner's warm-up (`load_state_dict`, `join`, outer.py) —, the files a state
is saved in (node/state/), how it travels to joiners (node/state/donor.py, sync.py).
"""

from __future__ import annotations

import copy as copying
import math
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from meshtrain.errors import MeshtrainError
from meshtrain.transport.validate import is_int, is_number

__all__ = [
    "STATE_FORMAT",
    "OptimizerLayout",
    "OuterState",
    "OuterStateError",
    "StaleStateError",
    "StateHolder",
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
class OptimizerLayout:
    """What a torch optimizer's `state_dict()` must match to be loaded into ours: `groups`, per
    parameter group its parameter indices and its other values (ours, for their kinds); `shapes`,
    per parameter index its shape; `stepped`, per parameter index the state a step leaves (each
    key's tensor shape, None for a value that is not a tensor), or None where that is unknown.

    `stepped` comes from a twin of the optimizer over meta-device parameters (no memory), stepped
    once: a loaded parameter's state is then empty (never stepped) or holds every key the twin's
    does, shaped alike — a 0-d momentum buffer loads fine and fails at the next step, as does an
    AdamW state without its `exp_avg`. For an optimizer the twin cannot be built or stepped for (a
    user's, whose constructor takes other arguments, or one whose step needs real data), and for
    keys its step does not make, only the structure is checked (tensors or plain values): such an
    optimizer's state may be shaped in ways no rule here knows (factored or quantized moments)."""

    groups: tuple[tuple[tuple[int, ...], Mapping[str, Any]], ...]
    shapes: tuple[torch.Size, ...]
    stepped: tuple[Mapping[str, torch.Size | None], ...] | None = None

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerLayout:
        """The layout of `optimizer`'s own state (its params in order: their indices in its state)."""
        state = optimizer.state_dict()
        groups = tuple(
            (tuple(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in state["param_groups"]
        )
        params = _params(optimizer)
        shapes = tuple(p.shape for p in params)
        # the twin once per optimizer and hyper-parameters: a join checks a state up to three times
        key = repr((shapes, [p.dtype for p in params], groups))
        cached = _TWINS.get(optimizer)
        if cached is None or cached[0] != key:
            cached = _TWINS[optimizer] = (key, _stepped_twin(optimizer))
        return cls(groups, shapes, cached[1])

    def check(self, state: Any, what: str = "state's outer optimizer") -> None:
        """`OuterStateError` naming the first way `state` (a torch optimizer state dict) differs;
        `what` names the state in the message."""
        if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
            raise OuterStateError(f"{what} is not a torch optimizer state")
        groups = state.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.groups):
            raise OuterStateError(f"{what} has other parameter groups than this optimizer's")
        for group, (params, ours) in zip(groups, self.groups, strict=True):
            indices = group.get("params") if isinstance(group, dict) else None
            if not isinstance(indices, list) or not all(map(is_int, indices)) or indices != list(params):
                raise OuterStateError(f"{what} groups other parameters than this optimizer's")
            for key, value in group.items():
                if key != "params" and not _same_kind(value, ours.get(key, _ABSENT)):
                    raise OuterStateError(f"{what} {key!r} is {str(value)[:64]!r}, not a value of its kind")
        for index, per_param in state["state"].items():
            if not is_int(index) or not 0 <= index < len(self.shapes) or not isinstance(per_param, dict):
                raise OuterStateError(f"{what} keeps state for a parameter this optimizer lacks")
            stepped = self.stepped[index] if self.stepped is not None and per_param else {}
            for key in stepped:
                if key not in per_param:
                    raise OuterStateError(f"{what} lacks {key!r} of parameter {index}")
            for key, value in per_param.items():
                if key in stepped:
                    shape = stepped[key]
                    fits = _scalar(value) if shape is None else isinstance(value, torch.Tensor) and value.shape == shape
                else:  # a key our step does not make (ignored by it), or an optimizer without a twin
                    fits = isinstance(value, torch.Tensor) or _scalar(value)
                if not isinstance(key, str) or not fits:
                    raise OuterStateError(f"{what} {key!r} of parameter {index} has the wrong shape")


_TWINS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[str, Any]] = weakref.WeakKeyDictionary()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _stepped_twin(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Size | None], ...] | None:
    """Per parameter of `optimizer` (state index order), the state one step leaves, from a twin
    over meta-device parameters with the same groups (`OptimizerLayout`); None if the twin cannot
    be built or stepped."""
    twins: list[torch.Tensor] = []
    groups = []
    for group in optimizer.param_groups:
        params = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in group["params"]]
        for p in params:
            p.grad = torch.empty_like(p)
        twins.extend(params)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin: torch.optim.Optimizer = cast(Any, type(optimizer))(groups)
            twin.step()
    except Exception:  # noqa: BLE001 - any optimizer the twin does not suit: the looser rule
        return None
    return tuple(
        {k: v.shape if isinstance(v, torch.Tensor) else None for k, v in twin.state.get(p, {}).items()} for p in twins
    )


def _equal(value: Any, expected: Any) -> bool:
    """`value == expected` for a plain value (a str, an int, lists of them) from an untrusted
    state: of the same type at every level first (a tensor's `==` is elementwise, not a bool)."""
    if isinstance(expected, list):
        return (
            isinstance(value, list)
            and len(value) == len(expected)
            and all(_equal(v, e) for v, e in zip(value, expected, strict=True))
        )
    return type(value) is type(expected) and value == expected


_ABSENT = object()  # a hyper-parameter key our optimizer's groups lack (`_same_kind`)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str) and _finite(value)


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _number(value: Any) -> bool:
    return is_number(value) and _finite(value)


def _same_kind(value: Any, ours: Any) -> bool:
    """Whether a loaded hyper-parameter `value` may stand where ours is `ours` (`_ABSENT`: a key
    ours lacks, another torch release's): a finite number for a number, as many for a sequence of
    them (Adam's betas), a tensor shaped as ours (a capturable optimizer's learning rate), a flag
    or None for a flag or None, the same name for a name; for an absent key a flag, None or a
    finite number; for anything else (a user's optimizer may keep any value) the same type."""
    if _number(ours):
        return _number(value)
    if isinstance(ours, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.shape == ours.shape
    if isinstance(ours, list | tuple) and all(map(_number, ours)):
        return isinstance(value, list | tuple) and len(value) == len(ours) and all(map(_number, value))
    if ours is None or isinstance(ours, bool):
        return value is None or isinstance(value, bool)
    if ours is _ABSENT:
        return value is None or isinstance(value, bool) or _number(value)
    if isinstance(ours, str):
        return isinstance(value, str) and value == ours
    return isinstance(value, list | tuple) if isinstance(ours, list | tuple) else type(value) is type(ours)


@dataclass(frozen=True)
class StateLayout:
    """What a state dict must match to be loaded into one optimizer.

    algorithm: the optimizer's class name. H, fragments: its schedule. shapes: φ's parameter names
    and shapes (every registered buffer is shaped alike). buffers: the registered buffers' names.
    outer_optimizer: the layout of its torch optimizer over φ (whose state travels too), None
    where it keeps none.
    """

    algorithm: str
    H: int
    fragments: tuple[tuple[str, ...], ...]
    shapes: Mapping[str, torch.Size]
    buffers: frozenset[str]
    outer_optimizer: OptimizerLayout | None

    def check(self, state: Any) -> None:
        """`OuterStateError` naming the first way `state` differs from this layout."""
        if not isinstance(state, dict) or not _equal(state.get("format"), STATE_FORMAT):
            raise OuterStateError(f"not a {STATE_FORMAT} state dict")
        if not _equal(state.get("algorithm"), self.algorithm):
            raise OuterStateError(f"state is from {str(state.get('algorithm'))[:64]!r}, this is {self.algorithm}")
        if not _equal(state.get("H"), self.H) or not _equal(state.get("fragments"), [list(f) for f in self.fragments]):
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
        if (self.outer_optimizer is None) != (state.get("outer_optimizer") is None):
            raise OuterStateError("state's outer optimizer does not match this optimizer's")
        if self.outer_optimizer is not None:
            self.outer_optimizer.check(state["outer_optimizer"])
        for key in ("inner_steps", "rounds"):
            if not is_int(state.get(key)) or state[key] < 0:
                raise OuterStateError(f"state's {key} must be a non-negative integer")

    def _fits(self, name: str, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.shape == self.shapes[name]


class StateHolder(Protocol):
    """What of an optimizer (`OuterOptimizer`, outer.py) its state is."""

    outer_params: dict[str, torch.Tensor]
    inner: torch.optim.Optimizer | None
    residual: dict[str, torch.Tensor]
    inner_steps: int
    rounds: int

    @property
    def H(self) -> int: ...
    @property
    def fragments(self) -> list[tuple[str, ...]]: ...
    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None: ...
    @property
    def in_flight(self) -> bool: ...


class OuterState:
    """Writes `owner`'s state dict and loads one into it (module docstring, "Writing and loading").

    owner: the optimizer whose state it is. `buffers`: its registered per-parameter buffers by
    name (`register_buffers`), saved and restored with the rest.
    """

    def __init__(self, owner: StateHolder) -> None:
        self.owner = owner
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}

    def write(self, *, inner: bool, copy: bool) -> dict[str, Any]:
        """The state (`OuterOptimizer.state_dict`): tensors copied, or with `copy=False` the live ones."""
        owner = self.owner
        if owner.in_flight:
            raise OuterStateError("an outer exchange is in flight; take state between rounds or after finish()")
        same: Callable[[Any], Any] = copying.deepcopy if copy else _as_is
        outer_optimizer = owner.outer_optimizer
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "algorithm": type(owner).__name__,
            "H": owner.H,
            "fragments": [list(f) for f in owner.fragments],
            "inner_steps": owner.inner_steps,
            "rounds": owner.rounds,
            "outer_params": same(dict(owner.outer_params)),
            "buffers": same({k: dict(b) for k, b in self.buffers.items()}),
            "outer_optimizer": same(outer_optimizer.state_dict()) if outer_optimizer is not None else None,
        }
        if inner and owner.inner is not None:
            state["inner"] = same(owner.inner.state_dict())
        if inner and owner.residual:  # this peer's error feedback: checkpoints only, never joiners
            state["residual"] = same(dict(owner.residual))
        return state

    def load(self, state: dict[str, Any], *, inner: bool) -> None:
        """Check `state` whole, then copy it into the owner's tensors and counters."""
        owner = self.owner
        if owner.in_flight:
            raise StaleStateError("cannot load state while an outer exchange is in flight")
        self.layout().check(state)
        with torch.no_grad():
            for n, t in state["outer_params"].items():
                owner.outer_params[n].copy_(t)
            for k, b in state["buffers"].items():
                for n, t in b.items():
                    self.buffers[k][n].copy_(t)
        if owner.outer_optimizer is not None:
            owner.outer_optimizer.load_state_dict(copying.deepcopy(state["outer_optimizer"]))
        if inner and owner.inner is not None and "inner" in state:
            owner.inner.load_state_dict(copying.deepcopy(state["inner"]))
        if inner and isinstance(state.get("residual"), dict):
            owner.residual = {
                n: t.to(torch.float32).clone()
                for n, t in state["residual"].items()
                if n in owner.outer_params and isinstance(t, torch.Tensor) and t.shape == owner.outer_params[n].shape
            }
        owner.inner_steps = int(state["inner_steps"])
        owner.rounds = int(state["rounds"])

    def layout(self) -> StateLayout:
        """What a state must match to be loaded into the owner."""
        owner = self.owner
        return StateLayout(
            type(owner).__name__,
            owner.H,
            tuple(owner.fragments),
            {n: phi.shape for n, phi in owner.outer_params.items()},
            frozenset(self.buffers),
            None if owner.outer_optimizer is None else OptimizerLayout.of(owner.outer_optimizer),
        )


def _as_is(tree: Any) -> Any:
    return tree


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
