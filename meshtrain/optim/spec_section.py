"""The swarm spec's `outer` section: which outer optimizer every peer runs, its hyper-parameters
and the inner AdamW's (the spec's sections: meshtrain/spec_section.py).

What an optimizer's spec may say — its own defaults for spec keys, whether its rounds may run in
groups, whether a robust rule can combine its exchange — its class declares (`OuterOptimizer`'s
docstring); `declared` is the class a spec is checked with. A spec that names a py: optimizer is
checked with `OuterOptimizer`'s own values: a spec is parsed (from the network, too) before and
without loading the code it names. The section satisfies `OuterSpec`, what `from_spec` reads.

Its rules: a spec written now sets only the `OPTIMIZER_KEYS` its optimizer reads (`check_written`,
from the class's `spec_keys`; any for a py: class); and (`check`) the optimizer's own, which its class declares (`check_spec`: Streaming
DiLoCo's schedule — H, fragments, delay; eager needs a delay —, dp's H = 1, SparseLoCo's
k <= chunk), `noloco_outer` only for noloco, `error_feedback = false` only where there is error
feedback to turn off (codec topk, an optimizer that takes it), and `group_size` (0, >= 2, and
only for optimizers whose rounds may run in groups). Rules that also read other sections (dp and
fp16, spot-checks, robust aggregation) are `SwarmSpec`'s (node/spec/swarm.py).

Keys added since the signed form was fixed (`added_keys`, meshtrain/spec_section.py):
`pace` (written only where it is "swarm"), `error_feedback` (codec topk keeps error feedback,
β = `error_decay`, unless it says false) and `noloco_outer` (NoLoCo reads outer_lr and outer_momentum as its β and μ; set when a noloco spec
written now gives either a value other than its default — optim/noloco.py says why it is a key).
Each is written only where it acts, and a signed spec without it runs as it did before the key:
topk without error feedback, NoLoCo with its own β and μ.

Not here: building the optimizer from the spec (node/spec/outer.py), the algorithms (this package).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from meshtrain.collective.compression import CODECS
from meshtrain.errors import ConfigError
from meshtrain.optim import BUILTIN_OPTIMIZERS, OuterOptimizer
from meshtrain.optim.noloco import NoLoCo
from meshtrain.pyref import PyRef
from meshtrain.spec_section import SpecSection, signed_before

# Keys only some optimizers read (their class's `spec_keys`): a spec written now may set only those.
# Every optimizer's trainer reads optimizer, H, inner_lr, weight_decay and clip; group_size,
# error_feedback and noloco_outer have rules of their own (`OuterSection.check`).
OPTIMIZER_KEYS = (
    "outer_lr",
    "outer_momentum",
    "codec",
    "fragments",
    "delay",
    "alpha",
    "eager",
    "error_decay",
    "sparse_k",
    "sparse_chunk",
)

OPTIMIZERS = tuple(BUILTIN_OPTIMIZERS)  # built in; or py:<module>:<Class>


def declared(optimizer: object) -> type[OuterOptimizer]:
    """The class whose declarations (`spec_defaults`, `ungrouped_reason`, `dense_all_reduce`,
    `not_robust_reason`) a spec naming `optimizer` is checked with: a built-in's own, else
    `OuterOptimizer` — a py: class is not loaded to check a spec (the module docstring)."""
    if isinstance(optimizer, str) and optimizer in BUILTIN_OPTIMIZERS:
        return BUILTIN_OPTIMIZERS[optimizer]
    return OuterOptimizer


class OuterSection(SpecSection):
    """The outer optimizer, its hyper-parameters, and the inner optimizer's."""

    optimizer: str = Field(
        "diloco",
        description="diloco | streaming | noloco | sparseloco | dp (synchronous data parallelism: gradients "
        "all-reduced every step, H = 1) | py:<module or file.py>:<OuterOptimizer subclass>",
    )
    optimizer_digest: str = Field("", max_length=64, description="pinned at swarm create for a py: optimizer")
    H: int = Field(50, ge=1, le=100_000, description="inner steps per outer round (dp: 1, its default)")
    inner_lr: float = Field(2e-3, gt=0, le=1, description="the inner AdamW's learning rate")
    weight_decay: float = Field(0.01, ge=0, le=1, description="the inner AdamW's weight decay")
    clip: float = Field(1.0, gt=0, description="gradient norm clip of every inner step")
    outer_lr: float = Field(
        0.7, gt=0, le=10, description="outer learning rate (sparseloco: 1.0 unless given; noloco: β, see noloco_outer)"
    )
    outer_momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="outer Nesterov momentum (diloco, streaming, a pipeline's replica sync; noloco: its "
        "heavy-ball μ, see noloco_outer)",
    )
    noloco_outer: bool = Field(
        False,
        description="NoLoCo: β is outer_lr and μ outer_momentum (true), or NoLoCo's own β 0.7 and μ 0.5 "
        "(false). Set for you when a noloco spec gives either key a value other than its default (to run "
        "NoLoCo at exactly 0.7 or 0.9, set it too); a noloco spec signed before this key existed ran its own",
    )
    codec: str = Field(
        "none",
        description="how outer rounds compress the pseudo-gradients they exchange: none | fp16 | bf16 | int8 | "
        "int4 | fp4 | topk, deterministic, each with a tested error bound (collective/compression.py); "
        "streaming uses fp4 unless given",
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
        0.95,
        ge=0,
        le=1,
        description="β, the error-feedback decay: SparseLoCo's (sparseloco: 0.9 unless given) and codec topk's",
    )
    error_feedback: bool = Field(
        True,
        description="codec topk: error feedback, as SparseLoCo's — each peer keeps what top-k did not send "
        "and adds it, decayed by error_decay, to its next round's pseudo-gradient (diloco, streaming, dp, "
        "py:; noloco exchanges φ itself and takes none); false: none, as a topk spec signed before this key "
        "existed ran",
    )
    pace: Literal["steps", "swarm"] = Field(
        "steps",
        description="steps: every peer trains every inner step, and a round waits for the slowest (up to the "
        "collective's join_timeout); swarm: a peer behind the swarm's median step skips steps to keep up, and "
        "its Δ weighs the share of the round it trained (optim/outer.py, node/pace.py). diloco, streaming, py:",
    )
    sparse_k: int = Field(64, ge=1, description="SparseLoCo: values kept per chunk")
    sparse_chunk: int = Field(4096, ge=1, le=1 << 20, description="SparseLoCo: values per chunk")

    # Keys added since the signed form was fixed (meshtrain/spec_section.py): written where they act.
    added_keys: ClassVar[tuple[str, ...]] = ("noloco_outer", "error_feedback", "pace")

    @model_validator(mode="before")
    @classmethod
    def _added_keys_as_the_spec_was_written(cls, data: Any, info: ValidationInfo) -> Any:
        """A signed topk spec without `error_feedback` ran without it; one written now gets it (the
        field's default). A noloco spec written now that gives `outer_lr` or `outer_momentum` a
        value other than its default gets `noloco_outer` (NoLoCo honours them), and the key it does
        not give NoLoCo's own value; a signed one without it ran NoLoCo's own (the field's default).
        optim/noloco.py's docstring says why."""
        if not isinstance(data, Mapping):
            return data
        if signed_before(info):
            acts = cls._error_feedback_acts(data.get("codec"), data.get("optimizer", "diloco"))
            return {"error_feedback": False, **data} if acts else data
        if data.get("optimizer") != "noloco":
            return data
        reads = data.get("noloco_outer")
        if reads is None and cls._sets_noloco_keys(data):
            reads = True
        if reads is True:  # the key it does not give: NoLoCo's own, written in
            given = {key: value for key, value in data.items() if value is not None}
            return {**NoLoCo.own_outer, **given, "noloco_outer": True}
        return data

    @staticmethod
    def _error_feedback_acts(codec: object, optimizer: object) -> bool:
        """Codec topk, for an optimizer that takes error feedback (not noloco, whose exchange holds
        φ; not sparseloco, whose own accumulator it is)."""
        return codec == "topk" and optimizer not in ("noloco", "sparseloco")

    @classmethod
    def _sets_noloco_keys(cls, values: Mapping[str, Any]) -> bool:
        """Whether `values` give outer_lr or outer_momentum a value other than its default."""
        return any(
            values.get(key) is not None and values[key] != cls.model_fields[key].default
            for key in ("outer_lr", "outer_momentum")
        )

    def check_written(self) -> None:
        """For a spec being written now (signed, or parsed from a file to be signed): it gives no
        key its optimizer does not read (`spec_keys`) a value other than its default — it would do
        nothing. A spec signed before this rule is never re-checked with it (its id depends on
        what it says), so loading and re-validating a spec do not call this."""
        reads = self.declared.spec_keys
        if reads is None:
            return
        if self.topk_error_feedback is not None:
            reads = reads | {"error_decay"}  # topk's error feedback decays by it
        ignored = [
            key
            for key in OPTIMIZER_KEYS
            if key not in reads and getattr(self, key) != type(self).model_fields[key].default
        ]
        if ignored:
            raise ConfigError(
                f"swarm spec: {', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} nothing for optimizer "
                f"{self.optimizer} (it reads {', '.join(sorted(reads)) or 'none of them'}): leave "
                f"{'it' if len(ignored) == 1 else 'them'} out"
            )

    def writes(self, key: str) -> bool:
        if key == "pace":  # written where it is not the default, so no older swarm's id changes
            return self.pace != "steps"
        if key == "error_feedback":  # where it acts, its absence would read either way
            return self._error_feedback_acts(self.codec, self.optimizer)
        # noloco_outer: where it is set, or where a spec written now without it would set it.
        return self.optimizer == "noloco" and (self.noloco_outer or self._sets_noloco_keys(self.__dict__))

    @property
    def topk_error_feedback(self) -> float | None:
        """β of the error feedback the spec gives the codec (node/spec/outer.py applies it), or None:
        codec topk with `error_feedback`, for an optimizer that takes it (`_error_feedback_acts`)."""
        return (
            self.error_decay if self.error_feedback and self._error_feedback_acts(self.codec, self.optimizer) else None
        )

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

    @field_validator("codec")
    @classmethod
    def _codec(cls, v: str) -> str:
        if v not in CODECS:
            raise ValueError(f"must be one of {', '.join(sorted(CODECS))}")
        return v

    @property
    def declared(self) -> type[OuterOptimizer]:
        """The class this section's optimizer is checked with (`declared`)."""
        return declared(self.optimizer)

    def check(self) -> None:
        try:
            self.declared.check_spec(self)
        except ValueError as e:
            raise ConfigError(f"swarm spec: {e}") from None
        if self.noloco_outer and self.optimizer != "noloco":
            raise ConfigError(f"swarm spec: noloco_outer applies to optimizer noloco, not {self.optimizer}")
        if not self.error_feedback and not self._error_feedback_acts(self.codec, self.optimizer):
            raise ConfigError(
                "swarm spec: error_feedback false turns off codec topk's error feedback; this spec has none "
                f"(codec {self.codec}, optimizer {self.optimizer}: diloco, streaming, dp and py: take it)"
            )
        if self.pace != "steps" and self.declared.unpaced_reason:
            raise ConfigError(
                f"swarm spec: pace {self.pace} does not apply to {self.optimizer}: {self.declared.unpaced_reason} "
                "(leave pace steps)"
            )
        if self.group_size == 1:
            raise ConfigError(
                "swarm spec: group_size must be 0 (automatic) or at least 2 (a group of one averages nothing)"
            )
        if self.group_size and self.declared.ungrouped_reason:
            raise ConfigError(
                f"swarm spec: group_size does not apply to {self.optimizer}: {self.declared.ungrouped_reason} "
                "(leave group_size 0)"
            )
