"""The swarm spec's `model` section: which model and tokenizer every peer trains, their pinned
digests, the context length and the precision (the spec's sections: meshtrain/spec_section.py).

Its rule: a pretrained hf: model needs the tokenizer it was trained with. The tokenizer's default
depends on the data section (bytes for a file dataset), so `SwarmSpec` sets it (node/spec/swarm.py).

Not here: loading the model or tokenizer (sources.py, tokenizers.py), the digests' computation
(`SignedSpec.create` pins them).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from meshtrain.errors import ConfigError
from meshtrain.models.sources import parse_model_source
from meshtrain.models.tokenizers import check_tokenizer_name
from meshtrain.spec_section import SpecSection


class ModelSection(SpecSection):
    """What model the swarm trains, and how it reads text."""

    flat_names: ClassVar[dict[str, str]] = {"source": "model", "digest": "model_digest"}

    source: str = Field(
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
    context: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="tokens per training sequence; 0 = the model's own (swarm create pins 2048 for an HF "
        "model that allows more: models/sources.py, CONTEXT_CAP)",
    )
    digest: str = Field("", max_length=256, description="pinned at swarm create (models/sources.py)")
    tokenizer_digest: str = Field("", max_length=64, description="pinned at swarm create (models/tokenizers.py)")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="forward pass under autocast: fp32 | bf16 | fp16 (fp16 adds loss scaling); "
        "master weights, φ and pseudo-gradients stay fp32",
    )

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        parse_model_source(v)
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str) -> str:
        return check_tokenizer_name(v)

    def check(self) -> None:
        if self.source.startswith("hf:") and not self.tokenizer.startswith("hf:"):
            raise ConfigError(
                f"swarm spec: the pretrained model {self.source} needs the tokenizer it was trained "
                f"with (--tokenizer {self.source}), not {self.tokenizer}"
            )
