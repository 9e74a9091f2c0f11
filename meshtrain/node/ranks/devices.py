"""Where a peer's torch work runs and in what precision: device choice, autocast, loss scaling,
and copies between the device and the host.

The problem. A volunteer with a GPU ran `meshtrain swarm join` and trained on the CPU: nothing in
meshtrain named a device. This module is the one place that does, so the trainer, the outer
optimizer and the local-rank group take a `torch.device` as a parameter and run the same code
on a CPU (where the tests run) as on CUDA.

Design.
- `resolve_device(name, local_rank)`: "auto" (the default) picks CUDA if available, then MPS,
  then the CPU; "cuda:1", "mps", "cpu" name one. In a multi-rank peer, local rank r takes
  `cuda:r` under "auto" or "cuda" (one GPU per rank, torchrun's convention). A device that is
  not there is a `ConfigError` naming what is.
- Where things live (the trainer's contract, node/trainer.py): the model θ, its gradients, the
  batches and the inner optimizer's state on the device; the outer copy φ, the outer optimizer's
  state and everything exchanged with the swarm on the host, in fp32. `host_like` allocates those
  host tensors in pinned memory when CUDA is present, so that device-to-host copies can be
  `non_blocking` and overlap with compute; `to_host` / `to_device` move state dicts (checkpoints,
  a late joiner's download) between the two.
- `Precision`: the spec's `precision` key. "fp32" runs as before; "bf16" and "fp16" wrap the
  forward pass in `torch.autocast` (master weights stay fp32: autocast only lowers the
  compute); "fp16" also scales the loss (`torch.amp.GradScaler`, whose state the trainer
  checkpoints with the inner optimizer; its step reads an overflow flag from the device, the one
  per-step sync that torch's own fp16 recipe has too — bf16 has none). CPU autocast supports
  bf16, so that path is tested here; fp16 is meant for CUDA.

Failures: an unknown device name or a device this machine lacks is a one-line `ConfigError`. So is
a model that cannot fit: before the model moves to its device, `check_fits` compares what training
needs at the least — `TRAINING_BYTES_PER_PARAM` (fp32 θ, its gradient, AdamW's two moments), before
any activation — with the device's free memory (`free_bytes`: CUDA's, or the host's MemAvailable),
and `out_of_memory` turns an allocation that failed in a training step into the same kind of error;
both name the knobs (`--context`, `--batch-size`, `--precision bf16`, `--nproc-per-node` with FSDP).

Not here: which device a tensor exchanged with the swarm is on (always the host: optim/ and the
collective never see device tensors), the torch.distributed group (node/local_ranks.py).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch

from meshtrain.errors import ConfigError

DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda)(:\d+)?$")
PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_device_name(name: str) -> str:
    """Syntax only (the config validator): "auto", "cpu", "mps", "cuda" or "cuda:<index>"."""
    m = DEVICE_PATTERN.match(name.strip().lower())
    if m is None or (m.group(2) and m.group(1) != "cuda"):
        raise ValueError("must be auto, cpu, mps, cuda or cuda:<index>")
    return name.strip().lower()


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """The device a peer (or local rank `local_rank` of a multi-rank peer) trains on."""
    name = check_device_name(name)
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif _mps_available():
            name = "mps"
        else:
            name = "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not _mps_available():
            raise ConfigError(f"device mps: this machine has no MPS device ({_available()})")
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name}: torch sees no CUDA device here ({_available()})")
    count = torch.cuda.device_count()
    index = int(name.split(":")[1]) if ":" in name else local_rank
    if ":" in name and local_rank:
        raise ConfigError(
            f"device {name} names one GPU, but this peer runs several local ranks; say `cuda` (rank r takes cuda:r)"
        )
    if not 0 <= index < count:
        raise ConfigError(f"device cuda:{index}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


TRAINING_BYTES_PER_PARAM = 16  # fp32 θ, its gradient, AdamW's exp_avg and exp_avg_sq
KNOBS = (
    "a shorter --context, a smaller --batch-size, --precision bf16 (activations), or several local ranks "
    "with FSDP (--nproc-per-node N --sharding fsdp)"
)


def free_bytes(device: torch.device) -> int | None:
    """Memory a model could still take on `device`: CUDA's free memory, the host's MemAvailable for
    the CPU; None where it cannot be told (MPS, a host without /proc)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            for line in open("/proc/meminfo"):  # noqa: SIM115 — a few lines, read once
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def fit_error(parameters: int, device: torch.device, free: int | None, resident: int = 0) -> str | None:
    """Why `parameters` cannot train on `device` with `free` bytes left, `resident` of what they
    need being there already (a model built on the host, for the CPU); None: they may."""
    need = parameters * TRAINING_BYTES_PER_PARAM
    if free is None or need <= free + resident:
        return None
    return (
        f"the model ({parameters / 1e9:.2f} B parameters) needs at least {need / 2**30:.1f} GiB on {device} for its "
        f"weights, gradients and AdamW state ({TRAINING_BYTES_PER_PARAM} bytes per parameter, before activations), "
        f"and {free / 2**30:.1f} GiB is free: use a device with more memory, or {KNOBS}"
    )


def check_fits(model: torch.nn.Module, device: torch.device) -> None:
    """`ConfigError` (`fit_error`) if `model` cannot train on `device`: said before it moves there."""
    params = list(model.parameters())
    resident = sum(p.numel() * p.element_size() for p in params if p.device == device)
    error = fit_error(sum(p.numel() for p in params), device, free_bytes(device), resident)
    if error is not None:
        raise ConfigError(error)


def out_of_memory(e: BaseException, device: torch.device, step: int) -> ConfigError | None:
    """The one-line error for an allocation that failed in training step `step` (CUDA's
    `OutOfMemoryError`, or the CPU allocator's RuntimeError); None for any other error."""
    if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
        return None
    return ConfigError(f"out of memory on {device} in training step {step}: try {KNOBS}")


def device_label(device: torch.device) -> str:
    """What the status page shows: "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _available() -> str:
    have = ["cpu"]
    if torch.cuda.is_available():
        have.append(f"cuda:0..{torch.cuda.device_count() - 1}")
    if _mps_available():
        have.append("mps")
    return "available: " + ", ".join(have)


# -- host copies ---------------------------------------------------------------------------------


def pinned_host() -> bool:
    """Host tensors that meet a device are pinned when CUDA is present (non_blocking copies)."""
    return torch.cuda.is_available()


def host_like(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty host tensor shaped like `t` (pinned when CUDA is present)."""
    return torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=pinned_host())


def host_copy(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`t` copied to a (pinned) host tensor of `dtype`; synchronous."""
    return host_like(t, dtype).copy_(t.detach())


def to_host(tree: Any, *, copy: bool = True) -> Any:
    """A nested dict/list of tensors with every tensor on the CPU (checkpoints): copies, or with
    `copy=False` host tensors are passed through as they are (for trees that are copies already)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=copy)
    if isinstance(tree, dict):
        return {k: to_host(v, copy=copy) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_host(v, copy=copy) for v in tree)
    return tree


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (after non_blocking copies to the host)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


# -- precision -----------------------------------------------------------------------------------


class Precision:
    """Autocast and loss scaling for one spec `precision` on one device.

    precision: "fp32" (no autocast), "bf16", or "fp16" (autocast + GradScaler).
    device: where the forward pass runs.
    """

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.name = precision
        self.device = device
        self.dtype = _AUTOCAST_DTYPE.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield


class ScaledInner:
    """The inner optimizer seen through a `GradScaler` (fp16): `step()` skips steps whose
    gradients overflowed and updates the scale, so the outer optimizer, which steps "the inner
    optimizer", needs no fp16 knowledge. `state_dict` carries the scaler's state with the
    optimizer's, so a checkpoint resumes the same scale.

    optimizer: the real inner optimizer. scaler: the run's `GradScaler`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.param_groups = optimizer.param_groups

    def step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
