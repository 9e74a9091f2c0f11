"""The swarm spec's `pipeline` section: whether the model is cut into stages, and how those
stages train (the spec's sections: meshtrain/spec_section.py).

Its rules (`check`): a pipeline needs 2+ stages, and `activation_codec` only applies to one.
Which precisions a pipeline trains in (fp32, bf16) and the bf16 hops of a bf16 pipeline are rules
across sections: node/spec/swarm.py's.
Which models a pipeline can cut, in how many stages, and where (`stage_cut`, cut.py) depend on the
model section, so `SwarmSpec` checks them (node/spec/swarm.py) and `SignedSpec.create` pins the cut.

Not here: cutting (cut.py), the runtime (runtime.py), replica sync (replica_sync.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from meshtrain.errors import ConfigError
from meshtrain.pipeline.hop_codec import ACTIVATION_CODECS
from meshtrain.spec_section import SpecSection


class PipelineSection(SpecSection):
    """How a pipeline swarm cuts and trains the model (`kind` none: no pipeline)."""

    flat_names: ClassVar[dict[str, str]] = {"kind": "pipeline"}

    kind: Literal["none", "skippipe"] = Field(
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
        "stage peers: none | fp16 | bf16 | int8 | int4 | fp4 (pipeline/hop_codec.py; unless given, bf16 under "
        "precision bf16, whose stages compute in bf16 already). Its own key, not "
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

    @field_validator("activation_codec")
    @classmethod
    def _activation_codec(cls, v: str) -> str:
        if v not in ACTIVATION_CODECS:
            raise ValueError(f"must be one of {', '.join(ACTIVATION_CODECS)}")
        return v

    def check(self) -> None:
        if self.kind != "none" and self.stages < 2:
            raise ConfigError(f"swarm spec: pipeline {self.kind} needs stages >= 2 (--stages S), got {self.stages}")
        if self.kind == "none" and self.activation_codec != "none":
            raise ConfigError(
                "swarm spec: activation_codec compresses a pipeline's hops; this swarm has none "
                "(--pipeline skippipe), so leave it none (codec compresses the outer rounds)"
            )
