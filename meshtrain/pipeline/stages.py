"""Pipeline stages: a model cut into pieces, and one peer's replica of one piece.

Why: a SkipPipe peer holds one stage of the model (docs/algorithms.md, "SkipPipe"): stage 0 is the
embedding and the head/loss (the microbatch's origin, which holds the data), stages 1..S-1 are
contiguous runs of transformer blocks. The runtime (`runtime.py`) moves activations and gradients
between peers; this module is the compute one peer does on what arrives, with no I/O:

- `cut_blocks` splits any stack of residual blocks (an `nn.ModuleList` / `nn.Sequential`) into
  contiguous, balanced runs — the generic cut; `GPT.stages` uses the same `block_ranges`.
- `StageReplica` holds one stage of a model a pipeline can cut — the built-in `GPT` or a
  transformers causal LM, seen through `models.staged.staged` (which knows how each is
  cut; stage 0's module is `embed` + `head`, a block stage's maps h -> h): its forward keeps an
  autograd *tape* per microbatch
  until that microbatch's backward arrives; the backward returns the gradient for the previous
  hop and this stage's parameter gradients *separately per microbatch* (`torch.autograd.grad`,
  never `.backward()` into `.grad`). Keeping contributions apart is what lets a microbatch whose
  path broke be re-run from its origin without counting the part that already ran twice: at the
  end of an iteration only the attempts the origins committed are summed (`iteration.py`).
- `apply_update` takes the stage's averaged gradient (after the replicas' all-reduce) and runs
  the optimizer: AdamW, with the gradient norm clipped per stage (a global norm over all stages
  would need one more round trip through every stage each iteration; per-stage clipping bounds
  each replica's step the same way, and replicas of one stage clip identically).
- `stage_state` / `load_stage_states` move a stage's weights by their model-level names, e.g. to
  assemble the trained model for evaluation (`omission.py`).

Devices and precision. A replica computes on the `device` it is given (a `torch.device`, the
CPU by default: the same code runs on CUDA): its stage's modules move there — the rest of the
locally built model stays where it was built, untouched — and so do the tapes, the per-microbatch
gradients and the optimizer's state; token ids, targets and arriving tensors are moved there as
a visit starts (the hop codec, `hop_codec.py`, brings hops from the host once). `compute_dtype`
(bf16 for the spec's precision bf16; None: fp32) runs every forward under `torch.autocast`, as
the data-parallel trainer does (node/ranks/devices.py `Precision`): the weights stay fp32 masters,
autocast lowers only the matmuls, the backward runs in the dtypes the forward recorded, and the
parameter gradients come out fp32. A gradient arriving for a forward whose output was bf16 is
cast to it. fp16 is not offered: its loss scaling would need every stage to agree to skip a step.

Replicas of a stage start bit-identical (`GPT(config, seed)` is a pure function of its inputs, a
pretrained model's weights are its files) and stay so because they apply the same averaged
gradient with the same optimizer state.

What it does not do: place stages on peers, talk to the network, or decide paths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.models.gpt import GPT, block_ranges
from meshtrain.models.staged import staged

DEFAULT_LR = 3e-3
DEFAULT_WEIGHT_DECAY = 0.1
DEFAULT_BETAS = (0.9, 0.95)
DEFAULT_CLIP = 1.0


class StageError(MeshtrainError):
    """A stage was asked to do something its role cannot: an embedding on a block stage, a
    backward without its forward, an input of the wrong shape."""


def cut_blocks(blocks: Sequence[nn.Module], n_block_stages: int) -> list[nn.Sequential]:
    """Split a stack of blocks (each h -> h of the same shape) into `n_block_stages` contiguous
    runs of balanced size (earlier runs get the extra block). The modules are shared, not copied."""
    blocks = list(blocks)
    return [nn.Sequential(*(blocks[i] for i in run)) for run in block_ranges(len(blocks), n_block_stages)]


@dataclass
class Tape:
    """What a forward keeps until its backward: the input it differentiates to (None at stage 0,
    whose input is token ids) and the output whose gradient will arrive."""

    inputs: torch.Tensor | None
    output: torch.Tensor


class StageReplica:
    """One peer's replica of stage `index` of `model` cut into `n_stages` stages.

    model: the full model — a `GPT` or an `HFCausalLM` of a family models/staged.py cuts — built
        identically on every peer; only this stage's parameters are trained here, the rest is
        never touched and could be freed.
    n_stages: S; stage 0 = embedding + head, stages 1..S-1 = runs of blocks (`StagedModel.stages`).
    index: which stage this replica runs.
    lr, weight_decay, betas: AdamW on this stage's parameters (SkipPipe trains with Adam).
    clip: max gradient norm of this stage per update (None = no clipping).
    cut: the blocks of stages 1..S-1 (None: the balanced cut; pipeline/cut.py).
    device: where this stage's modules, tapes, gradients and optimizer state live (default: CPU).
    compute_dtype: the autocast dtype of every forward (torch.bfloat16), or None for fp32.

    Compute methods are synchronous torch code; call them from a worker thread.
    """

    def __init__(
        self,
        model: nn.Module,
        n_stages: int,
        index: int,
        *,
        lr: float = DEFAULT_LR,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        betas: tuple[float, float] = DEFAULT_BETAS,
        clip: float | None = DEFAULT_CLIP,
        cut: Sequence[range] | None = None,
        device: torch.device | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.staged = staged(model)
        stages = self.staged.stages(n_stages, cut)
        if not 0 <= index < n_stages:
            raise ConfigError(f"stage index {index} is outside 0..{n_stages - 1}")
        self.model = model
        self.n_stages = n_stages
        self.index = index
        self.stage = stages[index]
        self.device = device if device is not None else torch.device("cpu")
        self.compute_dtype = compute_dtype
        self.stage.module.to(self.device)  # in place: the model's own parameters, now on the device
        named = dict(model.named_parameters())
        self.names: tuple[str, ...] = self.stage.parameter_names
        self.params: list[nn.Parameter] = [named[n] for n in self.names]
        self.clip = clip
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas)

    @property
    def is_ends(self) -> bool:
        """Stage 0: the embedding at the start of a path and the head/loss at its end."""
        return self.index == 0

    @property
    def d_model(self) -> int:
        return self.staged.d_model

    # -- compute ---------------------------------------------------------------------------------

    def embed(self, idx: torch.Tensor) -> Tape:
        """Stage 0 forward: token ids [B, T] -> activations [B, T, d] (kept for the backward)."""
        self._need(ends=True, what="embed")
        self.staged.check_input(idx)  # on the host: on a GPU the range check would be a sync
        with torch.enable_grad(), self._autocast():
            return Tape(None, self._end("embed")(idx.to(self.device)))

    def forward(self, h: torch.Tensor) -> Tape:
        """Block-stage forward: h [B, T, d] -> this stage's blocks applied in order."""
        self._need(ends=False, what="run blocks")
        x = self._activation(h).requires_grad_(True)
        with torch.enable_grad(), self._autocast():
            return Tape(x, self.stage.module(x))

    def head(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
        """Stage 0 at the end of a path: the loss of h [B, T, d] against targets [B, T], and its
        backward through the head at once (nothing waits in between). Returns (loss, gradient for
        the last hop's output, this stage's parameter gradients)."""
        self._need(ends=True, what="compute the loss")
        if tuple(targets.shape) != tuple(h.shape[:2]):
            raise StageError(f"targets {tuple(targets.shape)} do not match activations {tuple(h.shape)}")
        x = self._activation(h).requires_grad_(True)
        with torch.enable_grad():
            with self._autocast():  # the forward only: the backward follows the forward's dtypes
                loss = self._end("head")(x, targets.to(self.device)).loss
            grads = torch.autograd.grad(loss, [x, *self.params], allow_unused=True)
        return float(loss.detach()), grads[0], self._dense(grads[1:])

    def backward(self, tape: Tape, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Backward of one forward: (gradient for the previous hop — None at stage 0 — and this
        stage's parameter gradients for this microbatch alone)."""
        if tuple(grad_output.shape) != tuple(tape.output.shape):
            raise StageError(
                f"gradient {tuple(grad_output.shape)} does not match the activations "
                f"{tuple(tape.output.shape)} it is for"
            )
        wrt = ([tape.inputs] if tape.inputs is not None else []) + self.params
        grad_output = grad_output.to(self.device, tape.output.dtype)  # fp32 from the wire; bf16 if the output was
        with torch.enable_grad():
            grads = torch.autograd.grad(tape.output, wrt, grad_output, allow_unused=True)
        if tape.inputs is None:
            return None, self._dense(grads)
        return grads[0], self._dense(grads[1:])

    # -- updates ---------------------------------------------------------------------------------

    def zeros(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p) for p in self.params]

    def apply_update(self, grads: Sequence[torch.Tensor]) -> float:
        """One optimizer step with `grads` (the stage's averaged gradient, aligned with `params`).
        Returns the gradient norm before clipping."""
        if len(grads) != len(self.params):
            raise StageError(f"{len(grads)} gradients for {len(self.params)} parameters")
        for p, g in zip(self.params, grads, strict=True):
            if g.shape != p.shape:
                raise StageError(f"gradient of shape {tuple(g.shape)} for a parameter of {tuple(p.shape)}")
            p.grad = g.detach().to(p.device, copy=True)
        limit = self.clip if self.clip is not None else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, limit))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # -- state -----------------------------------------------------------------------------------

    def stage_state(self) -> dict[str, torch.Tensor]:
        """This stage's weights by model-level name (copies, on the host)."""
        return {n: p.detach().to("cpu", copy=True) for n, p in zip(self.names, self.params, strict=True)}

    def grads_by_name(self, grads: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, grads, strict=True))

    # -- checks ----------------------------------------------------------------------------------

    def _need(self, *, ends: bool, what: str) -> None:
        if self.is_ends != ends:
            raise StageError(f"stage {self.index} cannot {what}")

    def _end(self, name: str) -> nn.Module:
        """Stage 0's `embed` or `head`: its module is an `nn.ModuleDict` of the two
        (`PipelineStage`, models/gpt.py)."""
        return cast(nn.ModuleDict, self.stage.module)[name]

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """Arriving activations `h`, checked, detached and on this stage's device."""
        d, context = self.staged.d_model, self.staged.context
        if h.dim() != 3 or h.shape[2] != d or h.shape[1] > context or h.dtype != torch.float32:
            raise StageError(f"activations must be float32 [batch, ≤{context}, {d}], got {h.dtype} {tuple(h.shape)}")
        x = h.detach().to(self.device)
        if not bool(torch.isfinite(x).all()):
            raise StageError("activations contain NaN or infinity")
        return x

    def _autocast(self) -> torch.autocast:
        """The forward's precision: autocast to `compute_dtype`, or off (fp32)."""
        return torch.autocast(self.device.type, self.compute_dtype, enabled=self.compute_dtype is not None)

    def _dense(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        return [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads, strict=True)]


def load_stage_states(model: nn.Module, states: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Copy stage weights (from `StageReplica.stage_state`, any number of stages) into `model`.
    Every parameter of `model` must be covered exactly once."""
    named = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for state in states:
            for name, value in state.items():
                if name not in named:
                    raise StageError(f"unknown parameter {name!r}")
                if name in seen:
                    raise StageError(f"parameter {name!r} given twice")
                if value.shape != named[name].shape:
                    raise StageError(f"{name}: shape {tuple(value.shape)}, expected {tuple(named[name].shape)}")
                named[name].copy_(value)
                seen.add(name)
    missing = set(named) - seen
    if missing:
        raise StageError(f"no weights for {sorted(missing)[:4]}{'...' if len(missing) > 4 else ''}")


def reference_gradients(
    model: GPT, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_order: Sequence[int] | None = None
) -> dict[str, torch.Tensor]:
    """Single-process gradients of the mean over `batches` of each batch's loss — what a pipeline
    iteration whose microbatches all took `block_order` must reproduce (for tests)."""
    model.zero_grad(set_to_none=True)
    loss = sum(model(x, y, block_order).loss for x, y in batches) / len(batches)
    loss.backward()
    out = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return out
