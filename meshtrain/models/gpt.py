"""The built-in model: a small decoder-only transformer (GPT) over characters or bytes.

Why it exists: the demo, the convergence benchmark, the trainer and SkipPipe need one model that
trains to a visible loss curve in minutes on a 2-core CPU (docs/algorithms.md, "Convergence testbed":
4 layers, d 64, context 32) and that can also be built at >= 25M parameters to time a late
joiner's state download.

Shape, GPT-2 style (Radford et al. 2019): pre-LayerNorm blocks of causal self-attention
(`torch.nn.functional.scaled_dot_product_attention`) and a GELU MLP, learned position
embeddings, the LM head tied to the token embedding by default. The model is three named parts so
a pipeline can cut it:

    embed   token + position embedding              (SkipPipe stage 0)
    blocks  nn.ModuleList of transformer blocks     (stages 1..S-1, contiguous runs)
    head    final LayerNorm + LM head + loss        (SkipPipe stage 0 again: the microbatch
                                                     returns to its origin for the loss)

Stage 0 holding both ends also keeps the tied embedding/head weight in one stage.
`GPT.forward(..., block_order=...)` runs any sequence of blocks — SkipPipe's skipped and swapped
stages (Blagoev et al. 2025, §3) and "inference with omission" (evaluate with half the layers).

Initial weights are a pure function of (config, seed): every parameter is filled from a private
`torch.Generator`, and the caller's global RNG state is left as it was, so every peer builds
bit-identical weights without talking — given the same torch version, whose CPU normal sampler
defines the bits.

Devices and precision: the model runs wherever it is moved (`model.to(device)`), and under
`torch.autocast` in bf16 or fp16 (node/ranks/devices.py): every op it uses has an autocast rule
(linear and attention run in the low precision; layer norm, softmax and the loss in fp32).
Parameters stay fp32 — the trainer's master weights. Input checks that need a value from the
tensor (token ids in range) run only on CPU inputs: on a GPU they would cost a host-device sync
per forward pass (the corpus' batches are in range by construction).

What it does not do: tokenisation (see `meshtrain.models.corpus`), KV caching.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.transport.validate import is_int, is_number

# GPT-2's init: N(0, 0.02) for every weight matrix; the two projections that write into the
# residual stream are further scaled by 1/sqrt(2 * n_layer) (Radford et al. 2019, §2.3) so the
# residual's variance does not grow with depth.
INIT_STD = 0.02

# `GPTConfig.for_params` searches n_layer up to this (d_model = 64 * n_layer): ~13B parameters.
MAX_FAMILY_LAYERS = 64


class ModelInputError(MeshtrainError, ValueError):
    """A forward pass was asked for something the model cannot do: a block index out of range, a
    sequence longer than the context, a token id outside the vocabulary."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a `GPT`. Peers must agree on it exactly (it is part of what a swarm shares).

    vocab_size: number of token ids (the corpus' `vocab.size`).
    n_layer: number of transformer blocks.
    n_head: attention heads per block; must divide d_model.
    d_model: width of the residual stream.
    context: longest sequence the model accepts (learned position embeddings have this many rows).
    dropout: dropout probability on embeddings, attention and residual branches (0 = off; with
        dropout on, forward passes draw from torch's global RNG).
    tie_embeddings: the LM head reuses the token embedding matrix (saves vocab_size * d_model).
    """

    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    context: int = 32
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "context"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ConfigError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"GPTConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")

    # -- presets -------------------------------------------------------------------------------

    @classmethod
    def tiny(cls, vocab_size: int = 256) -> GPTConfig:
        """2 blocks, d 32, context 32: for unit tests (a training step takes about a millisecond)."""
        return cls(vocab_size, n_layer=2, n_head=2, d_model=32, context=32)

    @classmethod
    def small(cls, vocab_size: int = 256) -> GPTConfig:
        """4 blocks, d 64, 4 heads, context 32: docs/algorithms.md's reference run; the demo's model."""
        return cls(vocab_size, n_layer=4, n_head=4, d_model=64, context=32)

    @classmethod
    def large(cls, vocab_size: int = 256) -> GPTConfig:
        """At least 25M parameters (8 blocks, d 512, context 128): the late-joiner sync benchmark."""
        return cls.for_params(25_000_000, vocab_size=vocab_size, context=128)

    @classmethod
    def for_params(cls, n: int, *, vocab_size: int = 256, context: int = 128) -> GPTConfig:
        """The smallest model of the family (n_layer = L, d_model = 64 L, heads of width 64) with at
        least `n` parameters. For benchmarks that need a model of a given size, not quality."""
        if not is_int(n) or n < 1:
            raise ConfigError(f"for_params needs a positive parameter count, got {n!r}")
        for n_layer in range(1, MAX_FAMILY_LAYERS + 1):
            config = cls(vocab_size, n_layer=n_layer, n_head=n_layer, d_model=64 * n_layer, context=context)
            if config.num_parameters() >= n:
                return config
        raise ConfigError(
            f"for_params({n}): larger than the biggest model of the family ({config.num_parameters()} parameters)"
        )

    # -- derived -------------------------------------------------------------------------------

    def num_parameters(self) -> int:
        """Parameter count of `GPT(self)` (shared tied weights counted once), without building it."""
        d = self.d_model
        embed = (self.vocab_size + self.context) * d
        # ln1 2d, qkv 3d^2+3d, proj d^2+d, ln2 2d, fc 4d^2+4d, proj 4d^2+d
        block = 12 * d * d + 13 * d
        head = 2 * d + (0 if self.tie_embeddings else self.vocab_size * d)
        return embed + self.n_layer * block + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """Inverse of `to_dict`; unknown or missing keys are a `ConfigError`, not a TypeError."""
        if not isinstance(data, dict):
            raise ConfigError(f"a model config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown model config keys: {sorted(unknown)}")
        if "vocab_size" not in data:
            raise ConfigError("model config is missing vocab_size")
        return cls(**data)


class GPTOutput(NamedTuple):
    """logits: [batch, time, vocab]; loss: mean cross-entropy over all positions, or None when no
    targets were given."""

    logits: torch.Tensor
    loss: torch.Tensor | None


class Embedding(nn.Module):
    """Token + learned position embedding: idx [B, T] int -> h [B, T, d_model]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.token(idx) + self.position(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: h -> h (same shape), so blocks compose in any order."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm + LM head + loss: h [B, T, d_model] (and targets [B, T]) -> GPTOutput."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        logits = self.lm_head(self.ln_f(h))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return GPTOutput(logits, loss)


@dataclass(frozen=True)
class PipelineStage:
    """One piece of a model cut for pipelining (see `GPT.stages`; models/staged.py cuts
    transformers models into the same form).

    index: stage number; 0 is the ends (embedding + head), 1.. are runs of blocks.
    blocks: indices into the model's blocks this stage runs, in order (empty for stage 0).
    module: stage 0: `nn.ModuleDict(embed=..., head=...)` (`head(h, targets)` returns a
        `GPTOutput`); other stages: a module that runs the blocks, `module(h) -> h` (for a GPT an
        `nn.Sequential` of them). The modules are the model's own, not copies.
    parameter_names: the model-level names (as in `model.named_parameters()`) of this stage's
        parameters (for a GPT in the order of `module.parameters()`).
    """

    index: int
    blocks: range
    module: nn.Module
    parameter_names: tuple[str, ...]


def block_ranges(n_layer: int, n_block_stages: int) -> tuple[range, ...]:
    """Split blocks 0..n_layer-1 into `n_block_stages` contiguous runs whose sizes differ by at
    most one (earlier runs get the extra block)."""
    if not 1 <= n_block_stages <= n_layer:
        raise ConfigError(f"cannot split {n_layer} blocks into {n_block_stages} non-empty stages")
    base, extra = divmod(n_layer, n_block_stages)
    ranges, start = [], 0
    for s in range(n_block_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return tuple(ranges)


class GPT(nn.Module):
    """Decoder-only transformer: `embed` -> `blocks` -> `head`.

    config: the shape; see `GPTConfig`.
    seed: initial weights are a pure function of (config, seed) — two peers calling
        `GPT(config, seed=s)` get bit-identical parameters. Building never touches torch's global
        RNG.

    `forward(idx, targets, block_order)` returns a `GPTOutput`; `block_order` picks which blocks
    run and in what order (default: all, in order). `stages(n)` cuts the model for a pipeline.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        # Module constructors run torch's default init from the global RNG; fork it so building
        # a model never shifts the caller's random stream (our own init below overwrites it all).
        # Not the meta device: materialising meta tensors imports sympy, ~1 s per process.
        with torch.random.fork_rng(devices=[]):
            self.embed = Embedding(config)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.head = Head(config)
        if config.tie_embeddings:
            self.head.lm_head.weight = self.embed.token.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Fill every parameter from a generator seeded with `seed`, in `named_parameters()` order."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                param.normal_(0.0, residual_std, generator=generator)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, block_order: Sequence[int] | None = None
    ) -> GPTOutput:
        """idx: [B, T] token ids, T <= context. targets: [B, T] next-token ids, or None.
        block_order: indices of the blocks to run, in order; repeats allowed; empty runs no block
        (embedding straight into the head). None runs every block in order."""
        self.check_input(idx)
        order = range(len(self.blocks)) if block_order is None else self._check_order(block_order)
        h = self.embed(idx)
        for i in order:
            h = self.blocks[i](h)
        return self.head(h, targets)

    @torch.no_grad()
    def evaluate(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], block_order: Sequence[int] | None = None
    ) -> float:
        """Mean loss over `batches` in eval mode (restoring the previous mode after); pass a
        `block_order` to measure the model with blocks omitted."""
        was_training = self.training
        self.eval()
        try:
            losses = [self(x, y, block_order).loss.item() for x, y in batches]
        finally:
            self.train(was_training)
        if not losses:
            raise ModelInputError("evaluate() needs at least one batch")
        return sum(losses) / len(losses)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        block_order: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to idx [B, T] (the window slides once the
        context is full). temperature 0 means greedy."""
        for _ in range(max_new_tokens):
            window = idx[:, -self.config.context :]
            logits = self(window, block_order=block_order).logits[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    def block_groups(self) -> list[list[str]]:
        """Parameter names of each block, by block index — what Streaming DiLoCo's strided
        fragments (fragment p = blocks p, p+P, ...) are built from. Every other parameter
        (embedding, head) is in none of the groups."""
        return [[f"blocks.{i}.{name}" for name, _ in block.named_parameters()] for i, block in enumerate(self.blocks)]

    def stages(self, n_stages: int, cut: Sequence[range] | None = None) -> list[PipelineStage]:
        """Cut the model for a pipeline of `n_stages` stages (2 <= n_stages <= n_layer + 1):
        stage 0 holds the embedding and the head (SkipPipe: stage-0 nodes hold the data and
        compute the loss); stages 1..n_stages-1 hold contiguous runs of blocks, balanced by
        `block_ranges` unless `cut` gives them (one non-empty range per block stage, covering
        every block in order). Every parameter belongs to exactly one stage."""
        if not 2 <= n_stages <= self.config.n_layer + 1:
            raise ConfigError(
                f"a {self.config.n_layer}-block model splits into 2..{self.config.n_layer + 1} stages, not {n_stages}"
            )
        runs = tuple(cut) if cut is not None else block_ranges(self.config.n_layer, n_stages - 1)
        if len(runs) != n_stages - 1 or [b for r in runs for b in r] != list(range(self.config.n_layer)):
            raise ConfigError(
                f"a cut of {n_stages} stages needs {n_stages - 1} block runs covering every block in order"
            )
        names = [name for name, _ in self.named_parameters()]
        ends = nn.ModuleDict({"embed": self.embed, "head": self.head})
        result = [
            PipelineStage(
                index=0,
                blocks=range(0),
                module=ends,
                parameter_names=tuple(n for n in names if n.startswith(("embed.", "head."))),
            )
        ]
        for s, run in enumerate(runs, start=1):
            prefixes = tuple(f"blocks.{i}." for i in run)
            result.append(
                PipelineStage(
                    index=s,
                    blocks=run,
                    module=nn.Sequential(*(self.blocks[i] for i in run)),
                    parameter_names=tuple(n for n in names if n.startswith(prefixes)),
                )
            )
        return result

    def check_input(self, idx: torch.Tensor) -> None:
        """ModelInputError unless idx is [batch, time] integer ids, time <= context, ids in the vocabulary."""
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ModelInputError(f"idx must be a [batch, time] integer tensor, got {idx.dtype} {tuple(idx.shape)}")
        if idx.shape[1] > self.config.context:
            raise ModelInputError(f"sequence length {idx.shape[1]} exceeds the model's context {self.config.context}")
        if (
            idx.numel()
            and idx.device.type == "cpu"
            and (int(idx.min()) < 0 or int(idx.max()) >= self.config.vocab_size)
        ):
            raise ModelInputError(f"token ids must be in [0, {self.config.vocab_size})")

    def _check_order(self, block_order: Sequence[int]) -> list[int]:
        order = list(block_order)
        n = len(self.blocks)
        for i in order:
            if not is_int(i) or not 0 <= i < n:
                raise ModelInputError(f"block_order entries must be block indices in [0, {n}), got {i!r} in {order}")
        return order
