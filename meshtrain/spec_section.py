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

Keys added since the signed form was fixed (`meshtrain.swarm/2`). A signed spec's id is a hash
of its dict as its owner signed it, and a meshtrain refuses a key it does not know. So a key a
section adds (`added_keys`) is written — `model_dump()`, the signed form, `SwarmSpec.flat()` —
only where it says something (`writes`; by default: where it is not at its default): a spec
that leaves it alone is signed as an older meshtrain would, keeps that swarm id, and an older
meshtrain can join it. A document signed before the key existed lacks it and still runs as it
did then: `SwarmSpec` validates a signed document with `signed_before` in the validation context,
and a section whose key's default would change such a spec's behaviour reads the key's absence
there as the old behaviour (the outer section's `noloco_outer` and `error_feedback`,
optim/spec_section.py).

Not here: the sections themselves (in their layers), the spec's cross-section rules and its
wire form (node/spec/).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, ValidationInfo, model_serializer

# The validation context's key that says the dict is a signed document, as its owner signed it.
SIGNED_BEFORE = "signed_before"


def signed_before(info: ValidationInfo) -> bool:
    """Whether the dict being validated is a signed document (the module docstring: a key it
    lacks was not there when it was signed), not a spec being written now."""
    return isinstance(info.context, Mapping) and bool(info.context.get(SIGNED_BEFORE))


class SpecSection(BaseModel):
    """One section of the swarm spec (the module docstring). `flat_names`: field -> its flat
    name where that is not the field's own (the section's prefix, dropped inside it).
    `added_keys`: its fields added since the signed form was fixed, written only where `writes`
    says (the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    flat_names: ClassVar[Mapping[str, str]] = {}
    added_keys: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _added_keys_where_they_say_something(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for key in self.added_keys:
            if not self.writes(key):
                out.pop(key, None)
        return out

    def writes(self, key: str) -> bool:
        """Whether added key `key` is written (the module docstring): where it is not at its default."""
        return bool(getattr(self, key) != type(self).model_fields[key].default)

    @classmethod
    def flat_name(cls, field: str) -> str:
        """The key a flat (v1) spec and the `swarm create` flag give `field` of this section."""
        return cls.flat_names.get(field, field)

    def check(self) -> None:
        """Rules among this section's own fields that a field's bounds cannot say; a one-line
        `ConfigError` (raised by the sections that have any)."""
