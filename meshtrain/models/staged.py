"""Models a pipeline can cut: the built-in GPT and LLaMA-family `transformers` causal LMs.

Why: a SkipPipe swarm (pipeline/stages.py, node/pipeline_peer.py) cuts its model into stage 0 —
the token embedding at the start of a microbatch's path and the final norm, LM head and loss at
its end (the origin, which holds the data) — and stages 1..S-1, contiguous runs of decoder
blocks. Only hidden states [batch, time, d_model] cross the wire, so a block stage must compute
locally whatever else its blocks need. This module is the one place that knows how each family
of model is cut; the pipeline sees a `StagedModel`, whatever the model is.

`staged(model)` gives that view:

    GPT (models/gpt.py)              `StagedGPT`: the model's own `GPT.stages` (its blocks take
                                     only the hidden state; positions are added at stage 0)
    HFCausalLM (models/sources.py)   `StagedHF`, when the transformers model's `model_type` is in
                                     `PIPELINE_HF_TYPES` (the LLaMA family: models with
                                     `model.embed_tokens`, `model.layers`, `model.norm`,
                                     `model.rotary_emb` and `lm_head` whose forward is exactly
                                     those in turn — no scaling outside the modules)

`StagedHF`'s cut. Stage 0 is `nn.ModuleDict(embed=embed_tokens, head=HFHead(norm, lm_head))`; a
tied `lm_head` shares the embedding's weight, which `named_parameters()` lists once, so it is one
parameter of stage 0. A block stage is an `HFLayers` over its run of `model.layers`: it computes
the position ids 0..T-1, the rotary embeddings (the model's own `rotary_emb`) and each layer's
causal mask (`transformers.masking_utils`; sliding-window layers, per `layer_types` or a
Mistral's `sliding_window`, get theirs) and runs the layers exactly as the model's own forward
does for a batch without padding or cache — so the staged forward equals the whole model's
(tests/test_pipeline_hf.py). The loss is the mean cross-entropy of the logits against the
targets at every position (the corpus' targets, the inputs shifted by one), as for the GPT; a
non-pipeline swarm's `HFCausalLM(x)` (HF's `labels=x`) is the same objective without the last
position, whose target x does not hold.

Needs transformers >= 4.53 (`MIN_TRANSFORMERS`: its `masking_utils`); an older one is a ConfigError
when the stage is built. Tested against transformers 5.x.

Parameter names are the whole model's (`inner.model.layers.3.mlp.up_proj.weight`), so a stage's
state, its checkpoints and the assembled export (node/pipeline_export.py, written with the HF
model's own `save_pretrained`) use them unchanged.

`pipeline_layers(value)`, at `swarm create`: from the spec's model value and its config file
alone, the number of blocks to cut, or a one-line ConfigError naming what a pipeline supports
(`PIPELINE_MODELS`).

Not here: the cut's text form in the spec (pipeline/cut.py), the per-microbatch compute and the
optimizer (pipeline/stages.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, GPTOutput, ModelInputError, PipelineStage, block_ranges
from meshtrain.models.sources import PRESETS, HFCausalLM, context_limit, hf_config, parse_model_source

# transformers `model_type`s a pipeline can cut: each checked, staged against whole, in
# tests/test_pipeline_hf.py. Left out because their forward scales outside the modules (the cut
# would differ): granite (embedding, residual and logits multipliers), cohere (logit_scale),
# gemma2/gemma3 (logit soft-capping).
PIPELINE_HF_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "phi3",
    "glm",
    "smollm3",
    "olmo",
    "olmo2",
    "starcoder2",
    "stablelm",
)
PIPELINE_MODELS = (
    f"a built-in GPT ({', '.join(PRESETS)}) or a LLaMA-family transformers model "
    f"(hf:<dir> or hf-config:<config.json> of model_type {', '.join(PIPELINE_HF_TYPES)})"
)
# transformers.masking_utils and decoder layers that take `position_embeddings` (tested on 5.x)
MIN_TRANSFORMERS = (4, 53)
# The parts a LLaMA-family model's stages are made of (under `HFCausalLM.inner`).
HF_PARTS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


class StagedModel(Protocol):
    """A model as a pipeline sees it.

    model: the whole model (its `named_parameters()` names every stage's parameters).
    n_layer: number of blocks the block stages share. d_model: width of the hidden states that
    cross the wire. context: the longest sequence it accepts. vocab_size: token ids it embeds.
    `stages(n_stages, cut)`: the `PipelineStage`s (stage 0's module is `nn.ModuleDict(embed=...,
    head=...)`, `head(h, targets)` returning a `GPTOutput`; a block stage's module maps h -> h).
    `check_input(idx)`: ModelInputError unless idx is token ids the model accepts.
    """

    @property
    def model(self) -> nn.Module: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    def stages(self, n_stages: int, cut: Sequence[range] | None = None) -> list[PipelineStage]: ...
    def check_input(self, idx: torch.Tensor) -> None: ...


def staged(model: nn.Module) -> StagedModel:
    """The pipeline's view of `model` (module docstring); ConfigError for a model it cannot cut."""
    if isinstance(model, GPT):
        return StagedGPT(model)
    if isinstance(model, HFCausalLM):
        return StagedHF(model)
    raise ConfigError(f"pipeline swarms cut {PIPELINE_MODELS}, not a {type(model).__name__}")


def pipeline_layers(value: str) -> int:
    """The number of blocks of the spec's model `value` (from its config file for hf: and
    hf-config:, without building it); ConfigError naming `PIPELINE_MODELS` if a pipeline cannot
    cut it."""
    try:
        src = parse_model_source(value)
    except ValueError as e:
        raise ConfigError(f"model {value!r}: {e}") from None
    if src.kind == "builtin":
        return PRESETS[src.location](1).n_layer
    if src.kind not in ("hf", "hf-config"):
        raise ConfigError(f"pipeline swarms cut {PIPELINE_MODELS}, not {value}")
    config = hf_config(value)
    model_type = config.get("model_type")
    if model_type not in PIPELINE_HF_TYPES:
        raise ConfigError(f"pipeline swarms cut {PIPELINE_MODELS}, not {value} (model_type {model_type})")
    n_layer = config.get("num_hidden_layers")
    if not isinstance(n_layer, int) or n_layer < 1:
        raise ConfigError(f"model {value}: its config names no num_hidden_layers")
    return n_layer


def _runs(n_layer: int, n_stages: int, cut: Sequence[range] | None) -> tuple[range, ...]:
    """The block runs of stages 1..S-1: `cut`, or the balanced one (as `GPT.stages` checks them)."""
    if not 2 <= n_stages <= n_layer + 1:
        raise ConfigError(f"a {n_layer}-block model splits into 2..{n_layer + 1} stages, not {n_stages}")
    runs = tuple(cut) if cut is not None else block_ranges(n_layer, n_stages - 1)
    if len(runs) != n_stages - 1 or [b for r in runs for b in r] != list(range(n_layer)):
        raise ConfigError(f"a cut of {n_stages} stages needs {n_stages - 1} block runs covering every block in order")
    return runs


# -- the built-in GPT ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagedGPT:
    """A `GPT` as a pipeline sees it: its own `stages` and `check_input`."""

    model: GPT

    @property
    def n_layer(self) -> int:
        return self.model.config.n_layer

    @property
    def d_model(self) -> int:
        return self.model.config.d_model

    @property
    def context(self) -> int:
        return self.model.config.context

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def stages(self, n_stages: int, cut: Sequence[range] | None = None) -> list[PipelineStage]:
        return self.model.stages(n_stages, cut)

    def check_input(self, idx: torch.Tensor) -> None:
        self.model.check_input(idx)


# -- LLaMA-family transformers models --------------------------------------------------------------


class HFHead(nn.Module):
    """Final norm + LM head + loss of a LLaMA-family model: h [B, T, d] (and targets [B, T]) ->
    `GPTOutput` (the loss: mean cross-entropy over every position)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        logits = self.lm_head(self.norm(h))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return GPTOutput(logits, loss)


def _attention_kind(config: Any, layer: int) -> str:
    """Which mask ("full_attention" or "sliding_attention") the model's own forward gives layer `layer`."""
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and len(kinds) > layer:
        return str(kinds[layer])
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


class HFLayers(nn.Module):
    """A run of a LLaMA-family model's decoder layers: h [B, T, d] -> h. Position ids, rotary
    embeddings and causal masks are computed here from h's shape (module docstring).

    layers: the model's own decoder layers (shared, not copied), in order. indices: their
    positions in `model.layers` (a layer's mask kind is looked up by it). rotary_emb, config:
    the model's.
    """

    def __init__(self, layers: Sequence[nn.Module], indices: range, rotary_emb: nn.Module, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.indices = indices
        self.rotary_emb = rotary_emb  # no parameters: only its (non-persistent) frequency buffer
        self.config = config

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids)
        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks: dict[str, Any] = {}
        for i, layer in zip(self.indices, self.layers, strict=True):
            kind = _attention_kind(self.config, i)
            if kind not in masks:
                masks[kind] = _causal_mask(make[kind], self.config, h, position_ids)
            out = layer(
                h, attention_mask=masks[kind], position_ids=position_ids, position_embeddings=position_embeddings
            )
            h = out[0] if isinstance(out, tuple) else out  # older transformers return a tuple
        return h


def _causal_mask(make: Any, config: Any, h: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """`make(...)` (a transformers.masking_utils mask builder) for a batch without padding or
    cache. Its keywords moved between releases (`input_embeds` and a required `cache_position`
    before 5.0), so they are read off its signature."""
    params = inspect.signature(make).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None, "past_key_values": None}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = h
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids
    if "cache_position" in params:
        kwargs["cache_position"] = position_ids[0]
    return make(**kwargs)


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = (transformers.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@dataclass(frozen=True)
class StagedHF:
    """An `HFCausalLM` of a LLaMA-family model as a pipeline sees it (module docstring).
    ConfigError at construction for any other architecture."""

    model: HFCausalLM

    def __post_init__(self) -> None:
        inner = self.model.inner
        model_type = getattr(getattr(inner, "config", None), "model_type", None)
        missing = [p for p in HF_PARTS if _part(inner, p) is None]
        if model_type not in PIPELINE_HF_TYPES or missing:
            raise ConfigError(
                f"pipeline swarms cut {PIPELINE_MODELS}, not a transformers {model_type or type(inner).__name__}"
            )
        if _transformers_version() < MIN_TRANSFORMERS:
            raise ConfigError(
                "pipeline swarms of transformers models need transformers>="
                f"{'.'.join(map(str, MIN_TRANSFORMERS))} (masking_utils): pip install -U transformers"
            )
        if len(_part(inner, "model.layers")) != self.n_layer:
            raise ConfigError(f"a {model_type} with {self.n_layer} layers in its config holds another number")

    @property
    def config(self) -> Any:
        return self.model.inner.config

    @property
    def n_layer(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def d_model(self) -> int:
        return int(self.config.hidden_size)

    @property
    def context(self) -> int:
        return context_limit(self.model) or 0

    @property
    def vocab_size(self) -> int:
        return int(self.model.inner.get_input_embeddings().num_embeddings)

    def stages(self, n_stages: int, cut: Sequence[range] | None = None) -> list[PipelineStage]:
        """Stage 0: embedding + norm + LM head; stages 1..S-1: runs of decoder layers, balanced
        by `block_ranges` unless `cut` gives them. Every parameter belongs to exactly one stage."""
        inner = self.model.inner
        runs = _runs(self.n_layer, n_stages, cut)
        names = [name for name, _ in self.model.named_parameters()]
        ends_prefixes = ("inner.model.embed_tokens.", "inner.model.norm.", "inner.lm_head.")
        head = HFHead(inner.model.norm, inner.lm_head)
        result = [
            PipelineStage(
                index=0,
                blocks=range(0),
                module=nn.ModuleDict({"embed": inner.model.embed_tokens, "head": head}),
                parameter_names=tuple(n for n in names if n.startswith(ends_prefixes)),
            )
        ]
        layers = inner.model.layers
        for s, run in enumerate(runs, start=1):
            prefixes = tuple(f"inner.model.layers.{i}." for i in run)
            result.append(
                PipelineStage(
                    index=s,
                    blocks=run,
                    module=HFLayers([layers[i] for i in run], run, inner.model.rotary_emb, inner.config),
                    parameter_names=tuple(n for n in names if n.startswith(prefixes)),
                )
            )
        covered = [n for st in result for n in st.parameter_names]
        stray = sorted(set(names) - set(covered))
        if stray:
            raise ConfigError(
                f"this {self.config.model_type} has parameters outside its embedding, layers, norm and "
                f"LM head (e.g. {stray[0]}): a pipeline cannot place them"
            )
        return result

    def check_input(self, idx: torch.Tensor) -> None:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ModelInputError(f"idx must be a [batch, time] integer tensor, got {idx.dtype} {tuple(idx.shape)}")
        if self.context and idx.shape[1] > self.context:
            raise ModelInputError(f"sequence length {idx.shape[1]} exceeds the model's context {self.context}")
        if idx.numel() and idx.device.type == "cpu" and (int(idx.min()) < 0 or int(idx.max()) >= self.vocab_size):
            raise ModelInputError(f"token ids must be in [0, {self.vocab_size})")


def _part(inner: nn.Module, dotted: str) -> Any:
    obj: Any = inner
    for attr in dotted.split("."):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj
