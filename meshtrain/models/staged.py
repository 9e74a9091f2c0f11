"""Models a pipeline can cut: the built-in GPT and the transformers causal LMs of `HF_FAMILIES`.

Why: a SkipPipe swarm (pipeline/stages.py, node/stages/peer.py) cuts its model into stage 0 —
the token embedding at the start of a microbatch's path and the final norm, LM head and loss at
its end (the origin, which holds the data) — and stages 1..S-1, contiguous runs of decoder
blocks. Only hidden states [batch, time, d_model] cross the wire, so a block stage must compute
locally whatever else its blocks need. This module is the one place that knows how each family
of model is cut; the pipeline sees a `StagedModel`, whatever the model is.

`staged(model)` gives that view:

    GPT (models/gpt.py)              `StagedGPT`: the model's own `GPT.stages` (its blocks take
                                     only the hidden state; positions are added at stage 0)
    HFCausalLM (models/sources.py)   `StagedHF`, when the transformers model's `model_type` is in
                                     `PIPELINE_HF_TYPES`: the LLaMA family (`model.embed_tokens`,
                                     `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`),
                                     the families that scale outside those modules (Granite,
                                     Cohere, Gemma 2, Gemma 3's text model), GPT-2
                                     (`transformer.wte`, `.wpe`, `.h`, `.ln_f`, `lm_head`) and
                                     mixtures of experts cut like their dense family (Mixtral,
                                     Qwen2/3-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE, gpt-oss,
                                     Granite-MoE)

`StagedHF`'s cut. A family is data, not a class (`HFFamily`): where its parts live, and what its
own forward computes outside them, which stage 0 computes the same way — at the embedding,
Granite's `embedding_multiplier`, Gemma's sqrt(hidden_size) normalizer (only where the
embedding module does not apply it itself, as transformers 5 does) and GPT-2's learned absolute
positions and embedding dropout; at the head, Granite's division by `logits_scaling`, Cohere's
`logit_scale` and Gemma 2/3's `final_logit_softcapping`. (Granite's residual and attention
multipliers act inside its layers.) Stage 0 is `nn.ModuleDict(embed=HFEmbed, head=HFHead)`; a
tied `lm_head` shares the embedding's weight, which `named_parameters()` lists once, so it is one
parameter of stage 0. A block stage is an `HFLayers` over its run of decoder layers: it computes
the position ids 0..T-1, the rotary embeddings (the model's own `rotary_emb`, per layer type
for Gemma 3; none for GPT-2) and each layer's causal mask (`transformers.masking_utils`;
sliding-window layers, per `layer_types` or a Mistral's `sliding_window`, get theirs) and runs
the layers exactly as the model's own forward does for a batch without padding or cache — so
the staged forward equals the whole model's (tests/test_pipeline_hf.py). The loss is the mean
cross-entropy of the logits against the targets at every position (the corpus' targets, the
inputs shifted by one), as for the GPT; a non-pipeline swarm's `HFCausalLM(x)` (HF's
`labels=x`) is the same objective without the last position, whose target x does not hold.

Mixtures of experts. Experts and router sit inside a decoder layer, so a stage holds its layers'
experts whole (no expert parallelism across peers) and the cut is the dense family's. What a
pipeline does not do is add the routers' auxiliary load-balancing loss: it would need every
stage's router logits at the loss. transformers leaves that loss off by default
(`output_router_logits` false); a config that turns it on is a ConfigError, at swarm create and
when a stage is built, rather than a swarm that silently trains another objective. Phi-MoE is
left out: its router adds random jitter in training, so no two runs of a layer agree.

Left out: the multimodal Gemma 3 (`gemma3`; its text model `gemma3_text` is cut),
a model with bidirectional attention (`use_bidirectional_attention`), and any family not
checked staged against whole — a family joins `HF_FAMILIES` with its test.

Needs transformers >= 4.53 (`MIN_TRANSFORMERS`: its `masking_utils`); an older one is a ConfigError
when the stage is built. Tested against transformers 5.x.

Parameter names are the whole model's (`inner.model.layers.3.mlp.up_proj.weight`), so a stage's
state, its checkpoints and the assembled export (node/stages/export.py, written with the HF
model's own `save_pretrained`) use them unchanged.

`pipeline_layers(value)`, at `swarm create`: from the spec's model value and its config file
alone (the family's `n_layer_key`: `num_hidden_layers`, GPT-2's `n_layer`), the number of
blocks to cut, or a one-line ConfigError naming what a pipeline supports (`PIPELINE_MODELS`).

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

# What the model's own forward does outside its modules, and where the parts live, for each
# transformers `model_type` a pipeline can cut: each checked, staged against whole, in
# tests/test_pipeline_hf.py. A family's description is data (`HFFamily`); the cut is one code path.
MIN_TRANSFORMERS = (4, 53)  # transformers.masking_utils, layers that take `position_embeddings`


@dataclass(frozen=True)
class HFFamily:
    """Where a transformers family keeps the parts a pipeline cuts (dotted paths under
    `HFCausalLM.inner`) and what its forward computes outside them (module docstring).

    embed, layers, norm, lm_head: the token embedding, the decoder layers (a ModuleList), the
    final norm and the LM head. rotary: the rotary embedding a block stage calls for its
    layers' `position_embeddings` (no parameters), or None for a family whose layers take none.
    positions: a learned absolute position embedding added to the token embedding at stage 0
    (GPT-2's wpe), or None. dropout: the dropout after the embedding (GPT-2's drop), or None.
    n_layer_key: the config.json field naming the number of layers.
    Stage 0's arithmetic, each a config field's value (None: the family has no such step):
    embedding_multiplier (h = embed(x) * m, Granite), normalized_embedding (h = embed(x) *
    sqrt(hidden_size) in h's dtype, Gemma — inside the embedding module since transformers 5,
    in the model's forward before, so applied here only when the embedding module does not),
    logits_divisor (Granite's logits / logits_scaling), logits_multiplier (Cohere's logits *
    logit_scale), logits_softcap (Gemma 2/3's cap * tanh(logits / cap)).
    """

    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str = "model.norm"
    lm_head: str = "lm_head"
    rotary: str | None = "model.rotary_emb"
    positions: str | None = None
    dropout: str | None = None
    n_layer_key: str = "num_hidden_layers"
    embedding_multiplier: str | None = None
    normalized_embedding: bool = False
    logits_divisor: str | None = None
    logits_multiplier: str | None = None
    logits_softcap: str | None = None

    def stage0_parts(self) -> tuple[str, ...]:
        """The parts whose parameters stage 0 holds."""
        return tuple(p for p in (self.embed, self.positions, self.norm, self.lm_head) if p is not None)

    def parts(self) -> tuple[str, ...]:
        """Every part the cut takes from the model (a model lacking one is not of this family)."""
        return (*self.stage0_parts(), self.layers, *(p for p in (self.rotary, self.dropout) if p is not None))


LLAMA = HFFamily()  # a forward that is exactly embed, layers, norm, head: no scaling outside them
GEMMA = HFFamily(normalized_embedding=True)
GEMMA2 = HFFamily(normalized_embedding=True, logits_softcap="final_logit_softcapping")
GRANITE = HFFamily(embedding_multiplier="embedding_multiplier", logits_divisor="logits_scaling")
COHERE = HFFamily(logits_multiplier="logit_scale")
GPT2 = HFFamily(
    embed="transformer.wte",
    positions="transformer.wpe",
    dropout="transformer.drop",
    layers="transformer.h",
    norm="transformer.ln_f",
    rotary=None,
    n_layer_key="n_layer",
)
HF_FAMILIES: dict[str, HFFamily] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "gemma": GEMMA,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA2,  # Gemma 3's text-only model; per-layer-type rotary embeddings
    "granite": GRANITE,  # residual_multiplier and attention_multiplier apply inside the layers
    "cohere": COHERE,
    "phi3": LLAMA,
    "glm": LLAMA,
    "smollm3": LLAMA,
    "olmo": LLAMA,
    "olmo2": LLAMA,
    "starcoder2": LLAMA,
    "stablelm": LLAMA,
    "gpt2": GPT2,
    # Mixtures of experts: the experts and their router live inside each decoder layer, so the
    # cut is their dense family's. Trained without the routers' auxiliary load-balancing loss, as
    # transformers trains them by default (`output_router_logits` false; true is refused).
    "mixtral": LLAMA,
    "qwen2_moe": LLAMA,  # with a shared expert beside the routed ones
    "qwen3_moe": LLAMA,
    "olmoe": LLAMA,
    "deepseek_v3": LLAMA,  # multi-head latent attention; its first layers dense
    "glm4_moe": LLAMA,
    "gpt_oss": LLAMA,  # attention sinks, alternating sliding-window layers
    "granitemoe": GRANITE,
    "granitemoeshared": GRANITE,
}
MOE_AUX_LOSS = "output_router_logits"  # a config asking for the routers' load-balancing loss
PIPELINE_HF_TYPES = tuple(HF_FAMILIES)
PIPELINE_MODELS = (
    f"a built-in GPT ({', '.join(PRESETS)}) or a transformers causal LM "
    f"(hf:<dir> or hf-config:<config.json> of model_type {', '.join(PIPELINE_HF_TYPES)})"
)


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
    family = HF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(f"pipeline swarms cut {PIPELINE_MODELS}, not {value} (model_type {model_type})")
    n_layer = config.get(family.n_layer_key)
    if not isinstance(n_layer, int) or n_layer < 1:
        raise ConfigError(f"model {value}: its config names no {family.n_layer_key}")
    if config.get(MOE_AUX_LOSS):
        raise ConfigError(moe_aux_loss_error(value))
    return n_layer


def moe_aux_loss_error(what: str) -> str:
    return (
        f"model {what} asks for its routers' load-balancing loss ({MOE_AUX_LOSS}: true), which a pipeline "
        f"does not add across its stages: set it to false in config.json (transformers' default)"
    )


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


# -- transformers models -------------------------------------------------------------------------


@dataclass(frozen=True)
class HFScales:
    """One model's numbers for stage 0's arithmetic (its `HFFamily`'s fields, read off its
    config); None where there is no such step.

    embedding_multiplier: h = embed(x) * m, a Python float as Granite multiplies by.
    normalizer: h = embed(x) * sqrt(hidden_size) taken in h's dtype, as Gemma's forward did.
    logits_divisor, logits_multiplier, logits_softcap: the head's logits / d, * m, then
    cap * tanh(logits / cap), in that order.
    """

    embedding_multiplier: float | None = None
    normalizer: float | None = None
    logits_divisor: float | None = None
    logits_multiplier: float | None = None
    logits_softcap: float | None = None

    def embedding(self, h: torch.Tensor) -> torch.Tensor:
        if self.embedding_multiplier is not None:
            h = h * self.embedding_multiplier
        if self.normalizer is not None:
            h = h * torch.tensor(self.normalizer, dtype=h.dtype)
        return h

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.logits_multiplier is not None:
            logits = logits * self.logits_multiplier
        if self.logits_softcap is not None:
            logits = torch.tanh(logits / self.logits_softcap) * self.logits_softcap
        return logits


class HFEmbed(nn.Module):
    """Stage 0's start: token ids [B, T] -> the first hidden state [B, T, d], as the model's own
    forward computes it: the token embedding `tokens`, scaled (`scales.embedding`), plus the
    learned `positions` 0..T-1, through the embedding `dropout` (each None where the family has
    none)."""

    def __init__(
        self, tokens: nn.Module, positions: nn.Module | None, dropout: nn.Module | None, scales: HFScales
    ) -> None:
        super().__init__()
        self.tokens, self.positions, self.dropout, self.scales = tokens, positions, dropout, scales

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.scales.embedding(self.tokens(idx))
        if self.positions is not None:
            h = h + self.positions(torch.arange(idx.shape[1], device=idx.device).unsqueeze(0))
        return self.dropout(h) if self.dropout is not None else h


class HFHead(nn.Module):
    """Final norm + LM head + loss of a transformers model: h [B, T, d] (and targets [B, T]) ->
    `GPTOutput` (the loss: mean cross-entropy over every position), the logits scaled as the
    model's own forward scales them (`scales.logits`)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, scales: HFScales) -> None:
        super().__init__()
        self.norm, self.lm_head, self.scales = norm, lm_head, scales

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        logits = self.scales.logits(self.lm_head(self.norm(h)))
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
    """A run of a transformers model's decoder layers: h [B, T, d] -> h. Position ids, rotary
    embeddings and causal masks are computed here from h's shape (module docstring).

    layers: the model's own decoder layers (shared, not copied), in order. indices: their
    positions in the model's layer list (a layer's mask kind is looked up by it). rotary_emb:
    the model's, or None for layers that take no position embeddings (GPT-2's). config: the
    model's.
    """

    def __init__(self, layers: Sequence[nn.Module], indices: range, rotary_emb: nn.Module | None, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.indices = indices
        self.rotary_emb = rotary_emb  # no parameters: only its (non-persistent) frequency buffers
        self.config = config
        # Gemma 3's rotary embedding has one frequency set per layer type: it is called with the type.
        self.rotary_per_kind = (
            rotary_emb is not None and "layer_type" in inspect.signature(rotary_emb.forward).parameters
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks: dict[str, Any] = {}
        rotary: dict[str, Any] = {}
        for i, layer in zip(self.indices, self.layers, strict=True):
            kind = _attention_kind(self.config, i)
            if kind not in masks:
                masks[kind] = _causal_mask(make[kind], self.config, h, position_ids)
            kwargs: dict[str, Any] = {"attention_mask": masks[kind]}
            if self.rotary_emb is not None:
                key = kind if self.rotary_per_kind else ""
                if key not in rotary:
                    extra = (kind,) if self.rotary_per_kind else ()
                    rotary[key] = self.rotary_emb(h, position_ids, *extra)
                kwargs.update(position_ids=position_ids, position_embeddings=rotary[key])
            out = layer(h, **kwargs)
            h = out[0] if isinstance(out, tuple) else out  # older transformers return a tuple
        return h


def _causal_mask(make: Any, config: Any, h: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """`make(...)` (a transformers.masking_utils mask builder) for a batch without padding or
    cache. Its keywords moved between releases (`input_embeds` and a required `cache_position`
    before 5.0, `past_key_values` renamed `cache` in 5.x), so they are read off its signature."""
    params = inspect.signature(make).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None}
    kwargs["cache" if "cache" in params else "past_key_values"] = None
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
    """An `HFCausalLM` of a family in `HF_FAMILIES` as a pipeline sees it (module docstring).
    ConfigError at construction for any other architecture."""

    model: HFCausalLM

    def __post_init__(self) -> None:
        inner = self.model.inner
        model_type = getattr(getattr(inner, "config", None), "model_type", None)
        family = HF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None or any(_part(inner, p) is None for p in family.parts()):
            raise ConfigError(
                f"pipeline swarms cut {PIPELINE_MODELS}, not a transformers {model_type or type(inner).__name__}"
            )
        if getattr(inner.config, MOE_AUX_LOSS, False):
            raise ConfigError(moe_aux_loss_error(f"a transformers {model_type}"))
        if getattr(inner.config, "use_bidirectional_attention", False):
            raise ConfigError(f"a {model_type} with bidirectional attention is not a causal LM a pipeline can cut")
        if _transformers_version() < MIN_TRANSFORMERS:
            raise ConfigError(
                "pipeline swarms of transformers models need transformers>="
                f"{'.'.join(map(str, MIN_TRANSFORMERS))} (masking_utils): pip install -U transformers"
            )
        if len(_part(inner, family.layers)) != self.n_layer:
            raise ConfigError(f"a {model_type} with {self.n_layer} layers in its config holds another number")

    @property
    def config(self) -> Any:
        return self.model.inner.config

    @property
    def family(self) -> HFFamily:
        return HF_FAMILIES[self.config.model_type]

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
        inner, family = self.model.inner, self.family
        runs = _runs(self.n_layer, n_stages, cut)
        names = [name for name, _ in self.model.named_parameters()]
        ends_prefixes = tuple(f"inner.{p}." for p in family.stage0_parts())
        scales = self._scales()
        embed = HFEmbed(
            _part(inner, family.embed), _part(inner, family.positions), _part(inner, family.dropout), scales
        )
        head = HFHead(_part(inner, family.norm), _part(inner, family.lm_head), scales)
        result = [
            PipelineStage(
                index=0,
                blocks=range(0),
                module=nn.ModuleDict({"embed": embed, "head": head}),
                parameter_names=tuple(n for n in names if n.startswith(ends_prefixes)),
            )
        ]
        layers = _part(inner, family.layers)
        rotary = _part(inner, family.rotary)
        for s, run in enumerate(runs, start=1):
            prefixes = tuple(f"inner.{family.layers}.{i}." for i in run)
            result.append(
                PipelineStage(
                    index=s,
                    blocks=run,
                    module=HFLayers([layers[i] for i in run], run, rotary, inner.config),
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

    def _scales(self) -> HFScales:
        family, config = self.family, self.config

        def value(field: str | None) -> float | None:
            v = getattr(config, field, None) if field else None
            return float(v) if v is not None else None

        # transformers 5 scales a Gemma embedding inside the module (its `embed_scale`); before, the forward did
        normalized = family.normalized_embedding and not hasattr(_part(self.model.inner, family.embed), "embed_scale")
        return HFScales(
            embedding_multiplier=value(family.embedding_multiplier),
            normalizer=self.d_model**0.5 if normalized else None,
            logits_divisor=value(family.logits_divisor),
            logits_multiplier=value(family.logits_multiplier),
            logits_softcap=value(family.logits_softcap),
        )

    def check_input(self, idx: torch.Tensor) -> None:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ModelInputError(f"idx must be a [batch, time] integer tensor, got {idx.dtype} {tuple(idx.shape)}")
        if self.context and idx.shape[1] > self.context:
            raise ModelInputError(f"sequence length {idx.shape[1]} exceeds the model's context {self.context}")
        if idx.numel() and idx.device.type == "cpu" and (int(idx.min()) < 0 or int(idx.max()) >= self.vocab_size):
            raise ModelInputError(f"token ids must be in [0, {self.vocab_size})")


def _part(inner: nn.Module, dotted: str | None) -> Any:
    """The module at `dotted` under `inner`; None if there is none (or no path)."""
    if dotted is None:
        return None
    obj: Any = inner
    for attr in dotted.split("."):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj
