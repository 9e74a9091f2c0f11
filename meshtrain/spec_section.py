"""`SpecSection`: the base of the swarm spec's sections, each owned by the layer that reads it.

The swarm spec (`SwarmSpec`, node/spec/swarm.py) is seven sections — `model` (models/),
`data` (data/), `outer` (optim/), `aggregation` (collective/), `pipeline` (pipeline/),
`verification` and `admission` (node/trust/) — plus its name, seed and steps. Each section is a
frozen pydantic model of its own fields, their bounds and help texts, and the rules that need
only them (`check`); rules across sections stay on `SwarmSpec`. It lives down here, beside the
layers, so every layer may declare its section without importing one above it.

A field's name inside its section drops what the section already says (`aggregation.trim`,
`pipeline.kind`); its flat name — the `swarm create` flag, the key of a `meshtrain.swarm/1`
spec file — is unchanged: the field's name unless the section's `flat_names` renames it. The one
table between the two is `SwarmSpec`'s (node/spec/swarm.py `FLAT_KEYS`), derived from these.

Not here: the sections themselves (in their layers), the spec's cross-section rules and its
wire form (node/spec/).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class SpecSection(BaseModel):
    """One section of the swarm spec (the module docstring). `flat_names`: field -> its flat
    name where that is not the field's own (the section's prefix, dropped inside it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    flat_names: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def flat_name(cls, field: str) -> str:
        """The key a flat (v1) spec and the `swarm create` flag give `field` of this section."""
        return cls.flat_names.get(field, field)

    def check(self) -> None:
        """Rules among this section's own fields that a field's bounds cannot say; a one-line
        `ConfigError` (raised by the sections that have any)."""
