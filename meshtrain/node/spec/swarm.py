"""The swarm's contract: `SwarmSpec`, what every peer of one swarm trains, and `parse_spec`.

`SwarmSpec` is the swarm's contract — model, tokenizer, data, optimizer, hyper-parameters, and
the digests of the model's, tokenizer's, dataset's and (py:) optimizer's files, pinned when it is
signed (node/spec/signed.py) — written once by the swarm's creator and identical on every peer; a node may not override
it (how a node runs is `config.NodeConfig`'s business). The spec's `precision` is the swarm's:
peers that train in different precisions are different experiments. So is its `aggregation`: how
every all-reduce of the swarm combines the peers' contributions (`SwarmSpec.aggregation_options`,
the one place it reaches the collective's `AllReduceConfig`). Unless the spec names one, an open
swarm of diloco, streaming or dp combines robustly (trimmed_mean), and its owners screen what
they combine (`screen_norm`, `screen_alignment`; `screen_echo` for replays, collective/echoes.py) and score a few sampled peers' updates by the
loss on their assigned batches (`score_samples`, `score_ratio`, `score_floor`, `score_batches`,
node/trust/scoring.py); a diloco swarm may also spot-check sampled peers by recomputing their first inner steps
(`spot_check_steps`, `spot_check_samples`, `spot_check_margin`, node/trust/spot_check.py; off by default);
peers flagged in `strikes` rounds within `strikes_window` rounds are excluded (node/trust/strikes.py).
dp screens nothing unless its spec sets `screen_norm` (its class's `spec_defaults`). Every other swarm
keeps the mean, and an explicit `aggregation = "mean"` stays. Its `group_size`: how large a swarm's outer rounds get before they run in groups
(`SwarmSpec.group_plan`, collective/groups.py). `parse_spec` validates an untrusted dict into one
(a one-line `ConfigError`).

What an optimizer's spec may say — its own defaults for spec keys, whether its rounds may run in
groups, whether a robust rule can combine its exchange — its class declares (`OuterOptimizer`'s
docstring; the built-in names' classes are `meshtrain.optim.BUILTIN_OPTIMIZERS`). A spec that names
a py: optimizer is checked with `OuterOptimizer`'s own values: a spec is parsed (from the network,
too) before and without loading the code it names.

A pipeline swarm's `stage_cut` (pipeline/cut.py) is part of the contract: every peer cuts the model
where the spec says. A pipeline cuts a built-in GPT or an hf: / hf-config: model of a family
models/staged.py knows; `SwarmSpec.check` checks what it can without reading files, and the
architecture and layer count of an hf model are checked where the cut is pinned
(`SignedSpec.create`).

Not here: the spec's signature, the swarm id, the wire and file form and `swarm join`'s addresses
(node/spec/signed.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshtrain.collective.compression import CODECS
from meshtrain.collective.groups import GroupPlan
from meshtrain.errors import ConfigError
from meshtrain.models.sources import PRESETS, parse_model_source
from meshtrain.models.staged import PIPELINE_MODELS
from meshtrain.models.tokenizers import check_tokenizer_name
from meshtrain.node.spec.config import one_line_error
from meshtrain.optim import BUILTIN_OPTIMIZERS, OuterOptimizer
from meshtrain.optim.schedule import RoundSchedule
from meshtrain.pipeline.cut import parse_stage_cut
from meshtrain.pipeline.hop_codec import ACTIVATION_CODECS
from meshtrain.pyref import PyRef

OPTIMIZERS = tuple(BUILTIN_OPTIMIZERS)  # built in; or py:<module>:<Class>
DEFAULT_POW_BITS = 16  # ~65k hashes: ~0.1 s for one identity in Python, a thousand cost a thousand times that
MAX_POW_BITS = 32
MAX_ALLOWLIST = 256  # peer ids in the signed spec (it must fit a swarm advert; more at run time, in the config CRDT)
# How every all-reduce of the swarm combines the peers' contributions (collective/data_phase.py).
Aggregation = Literal["mean", "trimmed_mean", "clipped_mean"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def declared(optimizer: object) -> type[OuterOptimizer]:
    """The class whose declarations (`spec_defaults`, `ungrouped_reason`, `dense_all_reduce`,
    `not_robust_reason`) a spec naming `optimizer` is checked with: a built-in's own, else
    `OuterOptimizer` — a py: class is not loaded to check a spec (the module docstring)."""
    if isinstance(optimizer, str) and optimizer in BUILTIN_OPTIMIZERS:
        return BUILTIN_OPTIMIZERS[optimizer]
    return OuterOptimizer


class SwarmSpec(BaseModel):
    """What the swarm trains. Every peer runs exactly this (the spec's digest is part of the
    swarm id, so two different specs are two different swarms)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        "meshtrain-demo",
        min_length=1,
        max_length=64,
        description="the swarm's name in `meshtrain swarm list`, which `swarm join <name>` takes (not unique: "
        "join by id when it matters)",
    )
    model: str = Field(
        "gpt-small",
        description="gpt-tiny | gpt-small | gpt-large | hf:<pretrained dir> | "
        "hf-config:<config.json> | py:<module or file.py>:<factory> | user (members build the model in "
        "their own loop over meshtrain.Swarm)",
    )
    tokenizer: str = Field(
        "chars",
        description="chars | bytes | hf:<dir or tokenizer.json> (default: chars for "
        "the builtin text, bytes for a file dataset)",
    )
    context: int = Field(0, ge=0, le=1 << 20, description="tokens per training sequence; 0 = the model's own")
    model_digest: str = Field("", max_length=256, description="pinned at swarm create (models/sources.py)")
    tokenizer_digest: str = Field("", max_length=64, description="pinned at swarm create (models/tokenizers.py)")
    dataset: str = Field(
        "builtin",
        description="builtin (offline English text), or a text, JSONL or Parquet file or directory, at the same path "
        "on every peer (meshtrain.data)",
    )
    dataset_field: str = Field(
        "text", min_length=1, max_length=256, description="JSONL/Parquet: the field that holds a document's text"
    )
    held_out: float = Field(
        0.05, gt=0, lt=1, description="fraction of a file dataset's documents held out for evaluation (chosen by hash)"
    )
    eval_dataset: str = Field("", description="held-out data as its own file or directory (instead of held_out)")
    dataset_digest: str = Field(
        "",
        pattern=r"^([0-9a-f]{64})?$",
        description="content digest of the dataset's files (swarm create "
        "computes it; peers whose files differ are refused)",
    )
    optimizer: str = Field(
        "diloco",
        description="diloco | streaming | noloco | sparseloco | dp (synchronous data parallelism: gradients "
        "all-reduced every step, H = 1) | py:<module or file.py>:<OuterOptimizer subclass>",
    )
    optimizer_digest: str = Field("", max_length=64, description="pinned at swarm create for a py: optimizer")
    H: int = Field(50, ge=1, le=100_000, description="inner steps per outer round (dp: 1, its default)")
    steps: int = Field(2000, ge=0, description="inner steps to train; 0 = until stopped")
    batch_size: int = Field(
        16, ge=1, le=4096, description="sequences a peer trains per inner step (a multi-rank peer splits them)"
    )
    inner_lr: float = Field(2e-3, gt=0, le=1, description="the inner AdamW's learning rate")
    weight_decay: float = Field(0.01, ge=0, le=1, description="the inner AdamW's weight decay")
    clip: float = Field(1.0, gt=0, description="gradient norm clip of every inner step")
    outer_lr: float = Field(0.7, gt=0, le=10, description="outer learning rate (sparseloco: 1.0 unless given)")
    outer_momentum: float = Field(
        0.9, ge=0, lt=1, description="outer Nesterov momentum (diloco, streaming, a pipeline's replica sync)"
    )
    codec: str = Field(
        "none",
        description="how outer rounds compress the pseudo-gradients they exchange: none | fp16 | bf16 | int8 | "
        "int4 | fp4 | topk, deterministic, each with a tested error bound (collective/compression.py); "
        "streaming uses fp4 unless given",
    )
    aggregation: Aggregation = Field(
        "mean",
        description="how every all-reduce combines the peers' contributions: mean | trimmed_mean "
        "(per coordinate, the aggregation_trim largest and smallest dropped) | clipped_mean (each "
        "contribution clipped to aggregation_clip x the median norm); robust rules need 3+ peers "
        "(with fewer they are the mean). Default: trimmed_mean in an open swarm whose optimizer "
        "all-reduces dense contributions (diloco, streaming, dp), else mean",
    )
    aggregation_trim: int = Field(
        0,
        ge=0,
        le=1024,
        description="trimmed_mean: values dropped at each end (at most (n-1)/2 of n peers); 0 (default): a "
        "quarter of the round's contributors, at least one",
    )
    aggregation_clip: float = Field(
        2.0, gt=0, le=1e6, description="clipped_mean: contributions clipped to this multiple of the median norm"
    )
    screen_norm: float = Field(
        4.0,
        ge=0,
        le=1e6,
        description="robust aggregation: each part's owner flags a contribution whose norm is over this "
        "multiple of the median or under its inverse (0 = no screening; else > 1)",
    )
    screen_alignment: float = Field(
        0.25,
        ge=0,
        le=1,
        description="robust aggregation: flag a contribution whose cosine with the aggregate is below this "
        "fraction of the group's median cosine (a flipped update, or noise; 0 = no direction rule)",
    )
    screen_echo: float = Field(
        0.9999,
        ge=0,
        le=1,
        description="robust aggregation: flag a contribution whose cosine with a contribution or aggregate of "
        "the owner's part in one of its last 8 rounds is at least this (a replayed update; honest updates of "
        "different rounds stayed below 0.9987 even at H = 2); 0 = off; only where screening is on",
    )
    score_samples: int = Field(
        2,
        ge=0,
        le=64,
        description="loss scoring (node/trust/scoring.py): in each screened round this many peers, drawn from the "
        "round's committed digest, have their update applied to each owner's part of the outer parameters "
        "and its loss measured on their own assigned batches (score_batches); 0 = off; only where screening is on",
    )
    score_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description="loss scoring: flag an update whose loss drop on its own assigned batches is below this "
        "fraction of the round aggregate's drop there by more than score_floor; a batch the aggregate did not lower "
        "by more than score_floor is not scored",
    )
    score_floor: float = Field(
        2e-3,
        ge=0,
        le=1,
        description="loss scoring: slack, as a fraction of the loss, below which a shortfall is noise, not evidence",
    )
    score_batches: int = Field(
        4,
        ge=1,
        le=64,
        description="loss scoring: the sampled peer's assigned batches of the round's last this many inner steps "
        "(all H if fewer) are scored, the loss their mean; more batches, less chance in an honest peer's score, and "
        "3 forward passes per batch, sampled peer and owner each round",
    )
    spot_check_steps: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="replay spot-check (node/trust/spot_check.py): every owner recomputes this many first inner steps "
        "of the round's sampled peers from the outer parameters on their assigned batches and compares the result "
        "with their update on its part; costs this many training steps per sampled peer and owner each round; "
        "0 = off; at most H; diloco only, and only where screening is on",
    )
    spot_check_samples: int = Field(
        1,
        ge=1,
        le=64,
        description="replay spot-check: peers checked per round, drawn from the round's committed digest",
    )
    spot_check_margin: float = Field(
        0.2,
        ge=0,
        le=2,
        description="replay spot-check: flag an update whose cosine with the recomputation is below the round "
        "aggregate's cosine with it by more than this",
    )
    strikes: int = Field(
        3,
        ge=0,
        le=1000,
        description="a peer flagged in this many distinct rounds (by 2+ reporters each) within "
        "strikes_window rounds is excluded everywhere (node/trust/strikes.py); 0 = never",
    )
    strikes_window: int = Field(
        6,
        ge=0,
        le=1 << 20,
        description="the strikes that exclude a peer must fall within this many consecutive rounds "
        "(H steps each), so chance flags of an honest peer over a long run add up to nothing; "
        "0 = no window (strikes count forever); else at least strikes",
    )
    group_size: int = Field(
        0,
        ge=0,
        le=1 << 16,
        description="grouped averaging (collective/groups.py): each outer round all-reduces in groups of at "
        "most this many peers that change every round, so every update reaches every peer within d + 1 "
        "rounds for d = log_g(peers); 0 = automatic (the whole swarm up to 32 peers, groups of 16 above); "
        "a value >= the swarm's size = always the whole swarm. diloco, streaming and py: optimizers",
    )
    fragments: int = Field(2, ge=1, le=64, description="Streaming DiLoCo: P")
    delay: int = Field(1, ge=0, description="Streaming DiLoCo: τ")
    alpha: float = Field(0.5, ge=0, le=1, description="Streaming DiLoCo: merge weight")
    eager: bool = Field(False, description="Streaming DiLoCo: eager updates (arXiv 2502.12996)")
    error_decay: float = Field(
        0.95, ge=0, le=1, description="SparseLoCo: β, the error-feedback decay (sparseloco: 0.9 unless given)"
    )
    sparse_k: int = Field(64, ge=1, description="SparseLoCo: values kept per chunk")
    sparse_chunk: int = Field(4096, ge=1, le=1 << 20, description="SparseLoCo: values per chunk")
    seed: int = Field(
        0,
        ge=0,
        lt=2**31,
        description="the swarm's seed: a fresh model's θ0, every peer's data, the groups of grouped rounds",
    )
    eval_every: int = Field(50, ge=0, description="held-out evaluation every this many steps")
    eval_batches: int = Field(8, ge=1, le=1024, description="held-out batches per evaluation")
    pipeline: Literal["none", "skippipe"] = Field(
        "none",
        description="none (every peer trains the whole model) | skippipe (the model is cut into stages; "
        "peers hold one stage each; microbatches take SkipPipe paths through them)",
    )
    stages: int = Field(0, ge=0, le=64, description="pipeline: S, the number of stages (stage 0: embedding + head)")
    stage_cut: str = Field(
        "",
        max_length=512,
        description="pipeline: the blocks of stages 1..S-1, e.g. 0-1,2-3 (pinned at swarm create: the balanced cut)",
    )
    skip_ratio: float = Field(0.0, ge=0, lt=1, description="pipeline: fraction of the block stages each path skips")
    microbatches: int = Field(8, ge=1, le=4096, description="pipeline: microbatches per iteration (of batch_size rows)")
    activation_codec: str = Field(
        "none",
        description="pipeline: how activations and their gradients are compressed on every hop between "
        "stage peers: none | fp16 | bf16 | int8 | int4 | fp4 (pipeline/hop_codec.py). Its own key, not "
        "codec: codec compresses outer-optimizer pseudo-gradients, which tolerate coarser codes (fp4) than "
        "activations, whose error every later stage sees; top-k is not offered (no error feedback per hop)",
    )
    replica_sync: Literal["every-step", "diloco", "noloco"] = Field(
        "every-step",
        description="pipeline: how a stage's replicas agree: every-step (gradient all-reduce every "
        "iteration) | diloco | noloco (an outer step every H iterations, per stage)",
    )
    stage_backup: bool = Field(
        True,
        description="pipeline: as every epoch starts and ends a peer of another stage keeps a copy of each "
        "stage that has one replica, so that a crash of that replica does not restart the stage from its "
        "initial weights (node/stages/state.py; costs at most two stage downloads per such stage and epoch)",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="forward pass under autocast: fp32 | bf16 | fp16 (fp16 adds loss scaling); "
        "master weights, φ and pseudo-gradients stay fp32",
    )
    admission: Literal["open", "allowlist", "private"] = Field(
        "open",
        description="who may take part (node/trust/admission.py): open (anyone with a proof of work on its "
        "peer id), allowlist (the owner and the peer ids the owner signs), private (holders of the swarm key; "
        "`swarm create --private` makes one)",
    )
    pow_bits: int = Field(
        DEFAULT_POW_BITS,
        ge=0,
        le=MAX_POW_BITS,
        description="open admission: leading zero bits of the proof of work on each peer id "
        "(an identity costs about 2**pow_bits hashes; 0 = none)",
    )
    allowlist: tuple[str, ...] = Field(
        (),
        max_length=MAX_ALLOWLIST,
        description="allowlist admission: peer ids admitted from the start (more at run time: "
        "`meshtrain swarm allow <peer id>` on the owner's node)",
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults_of_the_optimizer(cls, data: Any) -> Any:
        """An optimizer's own defaults (its class's `spec_defaults`) for the keys the spec does not
        give. The fields' defaults stay, so other optimizers' specs — and their swarm ids — are
        unchanged."""
        if isinstance(data, dict):
            own = declared(data.get("optimizer")).spec_defaults
            data = {**data, **{k: v for k, v in own.items() if data.get(k) is None}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _robust_in_open_swarms(cls, data: Any) -> Any:
        """Unless `aggregation` is given, a swarm open to strangers whose optimizer all-reduces
        dense contributions combines them robustly (trimmed_mean: a per-coordinate rule that bounds
        a scaled, flipped or noisy update best in scripts/bench/bench_adversarial.py); others: mean."""
        if isinstance(data, dict) and data.get("aggregation") is None:
            optimizer = declared(data.get("optimizer", "diloco"))
            dense = optimizer.dense_all_reduce and data.get("pipeline", "none") == "none"
            robust = dense and data.get("admission", "open") == "open"
            data = {**data, "aggregation": "trimmed_mean" if robust else "mean"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_for_the_data(cls, data: Any) -> Any:
        """A file dataset is streamed, and chars needs the whole text for its alphabet: unless a
        tokenizer is named, a file dataset is tokenised as bytes; chars for one is an error."""
        if isinstance(data, dict) and data.get("dataset", "builtin") != "builtin":
            if data.get("tokenizer") is None:
                data = {**data, "tokenizer": "bytes"}
            elif data["tokenizer"] == "chars":
                raise ValueError(
                    "tokenizer chars needs the whole text for its alphabet; a file dataset is "
                    "streamed: use bytes or hf:<dir>"
                )
        return data

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        parse_model_source(v)
        return v

    @field_validator("allowlist")
    @classmethod
    def _allowlist(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from meshtrain.transport.identity import IdentityError, public_key_of

        for peer in v:
            try:
                public_key_of(peer)
            except IdentityError:
                raise ValueError(f"{peer!r:.70} is not a peer id (12D3KooW...)") from None
        return tuple(dict.fromkeys(v))

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str) -> str:
        if v not in OPTIMIZERS:
            try:
                PyRef.parse(v)
            except ValueError:
                raise ValueError(
                    f"must be one of {', '.join(OPTIMIZERS)} or py:<module or file.py>:<Class>, "
                    f"a meshtrain.OuterOptimizer subclass"
                ) from None
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str) -> str:
        return check_tokenizer_name(v)

    @field_validator("codec")
    @classmethod
    def _codec(cls, v: str) -> str:
        if v not in CODECS:
            raise ValueError(f"must be one of {', '.join(sorted(CODECS))}")
        return v

    @field_validator("activation_codec")
    @classmethod
    def _activation_codec(cls, v: str) -> str:
        if v not in ACTIVATION_CODECS:
            raise ValueError(f"must be one of {', '.join(ACTIVATION_CODECS)}")
        return v

    def check(self) -> SwarmSpec:
        """Cross-field rules the optimizers would otherwise reject at start-up."""
        if self.optimizer == "streaming":
            try:
                RoundSchedule(self.H, self.fragments, self.delay)
            except ValueError as e:
                raise ConfigError(f"swarm spec: {e}") from None
            if self.eager and self.delay < 1:
                raise ConfigError("swarm spec: eager updates need delay >= 1")
        if self.model.startswith("hf:") and not self.tokenizer.startswith("hf:"):
            raise ConfigError(
                f"swarm spec: the pretrained model {self.model} needs the tokenizer it was trained "
                f"with (--tokenizer {self.model}), not {self.tokenizer}"
            )
        if self.optimizer == "dp":
            if self.H != 1:
                raise ConfigError(f"swarm spec: dp all-reduces gradients every step; H must be 1, not {self.H}")
            if self.precision == "fp16":
                raise ConfigError(
                    "swarm spec: dp with fp16: loss scaling skips overflowing steps on one peer and not "
                    "another, and the replicas part; use bf16"
                )
        optimizer = declared(self.optimizer)
        if self.aggregation != "mean" and optimizer.not_robust_reason:
            raise ConfigError(
                f"swarm spec: aggregation {self.aggregation} needs an all-reduce of dense contributions; "
                f"{self.optimizer} {optimizer.not_robust_reason}: use aggregation mean"
            )
        if self.screen_norm and self.screen_norm <= 1:
            raise ConfigError(f"swarm spec: screen_norm must be 0 (no screening) or above 1, not {self.screen_norm}")
        if self.strikes_window and self.strikes_window < self.strikes:
            raise ConfigError(
                f"swarm spec: strikes_window ({self.strikes_window}) must be 0 (no window) or at least "
                f"strikes ({self.strikes})"
            )
        if self.spot_check_steps and (self.optimizer != "diloco" or self.spot_check_steps > self.H):
            raise ConfigError(
                f"swarm spec: spot_check_steps ({self.spot_check_steps}) recomputes inner steps of a diloco round "
                f"from its start: it needs optimizer diloco (not {self.optimizer}) and at most H ({self.H}) steps"
            )
        if self.pipeline != "none":
            self._check_pipeline()
        elif self.activation_codec != "none":
            raise ConfigError(
                "swarm spec: activation_codec compresses a pipeline's hops; this swarm has none "
                "(--pipeline skippipe), so leave it none (codec compresses the outer rounds)"
            )
        if self.group_size == 1:
            raise ConfigError(
                "swarm spec: group_size must be 0 (automatic) or at least 2 (a group of one averages nothing)"
            )
        if self.group_size and optimizer.ungrouped_reason:
            raise ConfigError(
                f"swarm spec: group_size does not apply to {self.optimizer}: {optimizer.ungrouped_reason} "
                "(leave group_size 0)"
            )
        if self.optimizer == "sparseloco" and self.sparse_k > self.sparse_chunk:
            raise ConfigError(
                f"swarm spec: sparse_k ({self.sparse_k}) must be at most sparse_chunk ({self.sparse_chunk})"
            )
        return self

    def _check_pipeline(self) -> None:
        """A pipeline swarm: S >= 2 stages of a built-in GPT or an hf: / hf-config: model
        (models/staged.py), cut as `stage_cut` says (if pinned). Without reading files: an hf model's
        architecture and layer count are checked where the cut is pinned (`SignedSpec.create`)."""
        if self.stages < 2:
            raise ConfigError(f"swarm spec: pipeline {self.pipeline} needs stages >= 2 (--stages S), got {self.stages}")
        kind = parse_model_source(self.model).kind
        if kind not in ("builtin", "hf", "hf-config"):
            raise ConfigError(f"swarm spec: pipeline swarms cut {PIPELINE_MODELS}, not {self.model}")
        if self.precision != "fp32":
            raise ConfigError("swarm spec: pipeline swarms train in fp32 (precision fp32)")
        n_layer = PRESETS[self.model]().n_layer if kind == "builtin" else None
        if n_layer is not None and not 2 <= self.stages <= n_layer + 1:
            raise ConfigError(
                f"swarm spec: {self.model} has {n_layer} blocks: 2..{n_layer + 1} stages, not {self.stages}"
            )
        if self.stage_cut:
            parse_stage_cut(self.stage_cut, self.stages, n_layer)

    def aggregation_options(self) -> dict[str, Any]:
        """The all-reduce's combination rule (`AllReduceConfig` fields) for this swarm: the one
        place the spec's `aggregation` reaches the collective, for every all-reduce it runs (the
        daemon's, so `meshtrain.Swarm` loops too). A default that depends on other keys (a robust
        rule for a swarm open to strangers) belongs here, not at the call site."""
        robust = self.aggregation != "mean"
        return {
            "robust": self.aggregation if robust else "none",
            "trim": self.aggregation_trim,
            "clip": self.aggregation_clip,
            # Screening needs a part's contributions side by side, which only robust modes keep.
            "screen_norm": self.screen_norm if robust else 0.0,
            "screen_alignment": self.screen_alignment,
            "screen_echo": self.screen_echo if robust and self.screen_norm else 0.0,
            # Loss scoring (node/trust/scoring.py) and spot-checks (node/trust/spot_check.py) keep a few
            # contributions of screened rounds: the larger sample holds the smaller (`sampled_peers`).
            "score_samples": self.kept_samples if robust and self.screen_norm else 0,
        }

    @property
    def kept_samples(self) -> int:
        """How many sampled peers' contributions a screened round keeps for the node's checks:
        loss scoring's and the spot-check's, whichever samples more."""
        return max(self.score_samples, self.spot_check_samples if self.spot_check_steps else 0)

    def group_plan(self) -> GroupPlan | None:
        """How the swarm's outer rounds are grouped (collective/groups.py), for the collective: the
        one place the spec's `group_size` reaches it. None where rounds are never grouped: the
        optimizers whose class gives an `ungrouped_reason`, and pipeline swarms (per-stage sync)."""
        if declared(self.optimizer).ungrouped_reason or self.pipeline != "none":
            return None
        return GroupPlan(group_size=self.group_size, seed=self.seed, period=self.H)


def parse_spec(data: Mapping[str, Any]) -> SwarmSpec:
    try:
        return SwarmSpec.model_validate(dict(data)).check()
    except ValidationError as e:
        raise one_line_error(e, "swarm spec") from None
