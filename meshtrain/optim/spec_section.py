"""The swarm spec's `outer` section: which outer optimizer every peer runs, its hyper-parameters
and the inner AdamW's (the spec's sections: meshtrain/spec_section.py).

What an optimizer's spec may say — its own defaults for spec keys, whether its rounds may run in
groups, whether a robust rule can combine its exchange — its class declares (`OuterOptimizer`'s
docstring); `declared` is the class a spec is checked with. A spec that names a py: optimizer is
checked with `OuterOptimizer`'s own values: a spec is parsed (from the network, too) before and
without loading the code it names. The section satisfies `OuterSpec`, what `from_spec` reads.

Its rules (`check`): the optimizer's own, which its class declares (`check_spec`: Streaming
DiLoCo's schedule — H, fragments, delay; eager needs a delay —, dp's H = 1, SparseLoCo's
k <= chunk), and `group_size` (0, >= 2, and only for optimizers whose rounds may run in groups). Rules that also read other sections (dp and fp16, spot-checks, robust
aggregation) are `SwarmSpec`'s (node/spec/swarm.py).

Not here: building the optimizer from the spec (node/spec/outer.py), the algorithms (this package).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from meshtrain.collective.compression import CODECS
from meshtrain.errors import ConfigError
from meshtrain.optim import BUILTIN_OPTIMIZERS, OuterOptimizer
from meshtrain.pyref import PyRef
from meshtrain.spec_section import SpecSection

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
        if self.group_size == 1:
            raise ConfigError(
                "swarm spec: group_size must be 0 (automatic) or at least 2 (a group of one averages nothing)"
            )
        if self.group_size and self.declared.ungrouped_reason:
            raise ConfigError(
                f"swarm spec: group_size does not apply to {self.optimizer}: {self.declared.ungrouped_reason} "
                "(leave group_size 0)"
            )
