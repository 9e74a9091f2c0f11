"""A swarm's identity: its spec (`SwarmSpec`, node/spec/swarm.py), signed by its creator
(`SignedSpec`), and the swarm id derived from both; the spec's wire and file form, and the
addresses `swarm join` takes.

    swarm id = "ms" + blake3(canonical msgpack of {spec, owner})[:20 hex]

where `spec` is the dict as its owner signed it (`SignedSpec.signed`), not as this version would
write it: a spec signed by an older meshtrain lacks keys added since, which parse to their
defaults — or, where a key's default would change how such a swarm trains, to the behaviour before
the key (`parse_spec(..., signed=True)`, meshtrain/spec_section.py) — and still verifies, keeps its
id and is passed on unchanged. A key added since is signed only where it says something, so a
spec that leaves it alone is signed as an older meshtrain would sign it.

so the id names one spec *and* one owner: a peer cannot hand a joiner a different spec under the
same id (the id would not match), nor re-sign someone else's spec as its own (the id would
change). The owner's key also is the only key that may write the swarm's CRDT config
(`SwarmView.set_config`), where the node publishes the spec for everyone already in the swarm.

Wire and file form: `{"format", "spec", "owner", "signature", "swarm_id"}`. Two formats:

- `meshtrain.swarm/2` (`FORMAT`, what `create` signs): `spec` is the nested dict, the spec's
  sections as tables (`SwarmSpec.model_dump()`: `{"name": ..., "outer": {"H": 50, ...}, ...}`).
- `meshtrain.swarm/1` (`FORMAT_V1`, before the spec had sections): `spec` is the flat dict, every
  key by its flat name (`FLAT_KEYS`, node/spec/swarm.py). Still read: it verifies, keeps its id
  (computed over the flat dict as signed) and is passed on as it came — `to_wire` of a v1 spec
  writes v1 — so every swarm created before keeps its id and its members. Nothing writes a new v1.

A key this version does not know — flat in v1, at the top or in a section in v2 — is refused in
one line that says a newer meshtrain created the spec; so is a section that is not a table.

Joining needs one address: `swarm join <multiaddr>` (or `<swarm id>@<multiaddr>`, which also
pins the id) dials the peer and asks for the spec over the `swarm/spec` RPC; the answer is
verified (signature, id, schema) before anything else happens. `swarm join <swarm id | name>`
first finds the swarm's entry addresses in the DHT's swarm index (node/spec/listing.py), then
does the same, pinning the id it found. A spec file (`swarm.json`,
written by `swarm create`) holds the same signed document.

Content, not paths: `SignedSpec.create` pins `model.digest` and `model.tokenizer_digest` (computed
from the creator's files, models/sources.py) when the spec has none, so the signature covers what
the model and tokenizer *are*; every node checks its own copy against them before it trains
(`check_local_copy`, called by the daemon). A `py:` outer optimizer's source is pinned the same
way (`outer.optimizer_digest`, meshtrain/pyref.py; checked by `outer_spec.check_copy`). A pipeline
swarm's `pipeline.stage_cut` (pipeline/cut.py) is pinned too: every peer cuts the model where the
spec says. For an hf: / hf-config: model the architecture and layer count come from its config
file, so they are checked when the cut is pinned (`SignedSpec.create`, i.e. `swarm create`),
where the files are at hand.

Not here: what the spec holds and how it is validated (`SwarmSpec`, `parse_spec`, node/spec/swarm.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.models.sources import capped_context, model_digest
from meshtrain.models.staged import pipeline_layers
from meshtrain.models.tokenizers import tokenizer_digest
from meshtrain.node.spec.swarm import FLAT_KEYS, SECTIONS, SwarmSpec, parse_spec
from meshtrain.pipeline.cut import balanced_cut, format_stage_cut, parse_stage_cut
from meshtrain.pyref import PREFIX as PY_PREFIX
from meshtrain.pyref import PyRef
from meshtrain.transport.framing import packb_canonical
from meshtrain.transport.identity import Identity, verify

SPEC_RPC = "swarm/spec"
FORMAT = "meshtrain.swarm/2"  # the spec's sections as tables
FORMAT_V1 = "meshtrain.swarm/1"  # flat: read, passed on, never written anew


class SpecError(MeshtrainError):
    """A signed spec is malformed, forged, or not the swarm we asked for."""


def swarm_id_of(signed: dict[str, Any], owner: str) -> str:
    """The id of the spec dict `signed` (as its owner signed it) and its owner."""
    body = packb_canonical({"spec": signed, "owner": owner})
    return "ms" + blake3.blake3(body).hexdigest()[:20]


@dataclass(frozen=True)
class SignedSpec:
    """spec: the parsed spec (keys the signer's version lacked at their defaults). owner: peer id
    of the creator. signature: over `signed`, the spec dict as the owner signed it (None: the
    spec's own form in `format`, as `create` signs), which the id and the wire form carry.
    format: the wire format it was signed in (`FORMAT`, or `FORMAT_V1` for an older spec)."""

    spec: SwarmSpec
    owner: str
    signature: bytes
    signed: dict[str, Any] | None = None
    format: str = FORMAT

    def __post_init__(self) -> None:
        if self.signed is None:
            object.__setattr__(self, "signed", self.spec.flat() if self.format == FORMAT_V1 else self.spec.model_dump())

    @property
    def swarm_id(self) -> str:
        assert self.signed is not None  # __post_init__
        return swarm_id_of(self.signed, self.owner)

    @staticmethod
    def signed_message(signed: dict[str, Any], owner: str) -> bytes:
        """The bytes an owner signs: the spec dict as signed, and the owner's peer id."""
        return b"meshtrain-swarm-spec\n" + packb_canonical({"spec": signed, "owner": owner})

    @classmethod
    def create(cls, spec: SwarmSpec, identity: Identity) -> SignedSpec:
        """Sign `spec` (in `FORMAT`), first pinning the model, tokenizer and (py:) optimizer digests
        if it has none, the context of an HF model that allows more than `CONTEXT_CAP` positions if
        it names none (models/sources.py, "Context"), and a pipeline swarm's stage cut (the balanced
        one) if it names none — after
        checking that a pipeline can cut the model (`pipeline_layers`: a one-line ConfigError
        naming what it can) and that the cut fits its layers."""
        spec.outer.check_written()  # a key its optimizer does not read: refused before it is signed
        pins: dict[str, dict[str, str | int]] = {"model": {}, "outer": {}, "pipeline": {}}
        if spec.pipeline.kind != "none":  # first: a model no pipeline can cut is the error to report
            n_layer = pipeline_layers(spec.model.source)
            if spec.pipeline.stage_cut:
                parse_stage_cut(spec.pipeline.stage_cut, spec.pipeline.stages, n_layer)
            else:
                pins["pipeline"]["stage_cut"] = format_stage_cut(balanced_cut(n_layer, spec.pipeline.stages))
        pins["model"]["digest"] = spec.model.digest or model_digest(spec.model.source)
        if not spec.model.context and (capped := capped_context(spec.model.source)) is not None:
            pins["model"]["context"] = capped[0]  # an HF model's own limit would not fit a device
        pins["model"]["tokenizer_digest"] = spec.model.tokenizer_digest or tokenizer_digest(spec.model.tokenizer)
        if spec.outer.optimizer.startswith(PY_PREFIX) and not spec.outer.optimizer_digest:
            pins["outer"]["optimizer_digest"] = PyRef.parse(spec.outer.optimizer).source_digest()
        spec = spec.model_copy(
            update={name: getattr(spec, name).model_copy(update=values) for name, values in pins.items() if values}
        )
        owner = identity.peer_id_str
        return cls(spec, owner, identity.sign(cls.signed_message(spec.model_dump(), owner)))

    def to_wire(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "spec": self.signed,
            "owner": self.owner,
            "signature": self.signature.hex(),
            "swarm_id": self.swarm_id,
        }

    @classmethod
    def from_wire(cls, data: Any, *, expect_id: str | None = None) -> SignedSpec:
        """Parse and verify, in either format (the module docstring); `SpecError` (one line) for
        anything wrong."""
        form = data.get("format") if isinstance(data, dict) else None
        if form not in (FORMAT, FORMAT_V1):
            raise SpecError(f"not a {FORMAT} (or {FORMAT_V1}) document")
        owner, sig, body = data.get("owner"), data.get("signature"), data.get("spec")
        if not isinstance(owner, str) or not isinstance(sig, str) or not isinstance(body, dict):
            raise SpecError("spec document lacks spec, owner or signature")
        unknown = _unknown_keys(body) if form == FORMAT else [repr(k)[:40] for k in body if k not in FLAT_KEYS]
        if unknown:
            raise SpecError(
                f"the swarm spec has keys this meshtrain does not know ({', '.join(sorted(unknown)[:5])}): "
                "a newer meshtrain created it; upgrade to join this swarm"
            )
        try:
            spec = parse_spec(body, form="nested" if form == FORMAT else "flat", signed=True)
            signature = bytes.fromhex(sig)
        except (ConfigError, ValueError) as e:
            raise SpecError(f"invalid swarm spec: {e}") from None
        signed = cls(spec, owner, signature, body, form)
        if not verify(owner, cls.signed_message(body, owner), signature):
            raise SpecError("the swarm spec's signature does not verify: forged or corrupted")
        if expect_id is not None and signed.swarm_id != expect_id:
            raise SpecError(f"this peer serves swarm {signed.swarm_id}, not {expect_id}")
        return signed

    def save(self, path: str | os.PathLike[str]) -> Path:
        from meshtrain.durable import write_atomic

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(p, (json.dumps(self.to_wire(), indent=2) + "\n").encode())
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SignedSpec:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"swarm spec {p} does not exist (create one with `meshtrain swarm create`)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read swarm spec {p}: {e}") from None
        try:
            return cls.from_wire(data)
        except SpecError as e:
            raise ConfigError(f"swarm spec {p}: {e}") from None


def _unknown_keys(nested: dict[Any, Any]) -> list[str]:
    """The keys of a v2 spec this version does not know, at the top and in its sections (a
    section that is not a table: `SpecError`)."""
    unknown = [repr(k)[:40] for k in nested if k not in SwarmSpec.model_fields]
    for name, section in SECTIONS.items():
        values = nested.get(name, {})
        if not isinstance(values, dict):
            raise SpecError(f"the swarm spec's {name} is a {type(values).__name__}, not a table")
        unknown += [f"{name}.{k!r:.40}" for k in values if k not in section.model_fields]
    return unknown


SWARM_ID_CHARS = 22  # "ms" + 20 hex


def is_swarm_id(text: str) -> bool:
    return len(text) == SWARM_ID_CHARS and text.startswith("ms") and all(c in "0123456789abcdef" for c in text[2:])


@dataclass(frozen=True)
class JoinTarget:
    """What `swarm join` was given: a peer multiaddr to fetch the spec from (optionally pinning
    the swarm id), or a swarm id or name to look up in the DHT's swarm index (`addr` None)."""

    swarm_id: str | None
    addr: str | None
    name: str | None = None

    @property
    def wanted(self) -> str:
        """The swarm id or name to look up (only when `addr` is None)."""
        return self.swarm_id or self.name or ""


def parse_join_address(address: str) -> JoinTarget:
    """`<multiaddr>`, `<swarm id>@<multiaddr>`, `<swarm id>` or `<swarm name>`."""
    from meshtrain.transport.host import parse_multiaddr, peer_id_of

    if "/" not in address:  # no multiaddr: a swarm id or a name, found through the DHT
        if is_swarm_id(address):
            return JoinTarget(address, None)
        if not 0 < len(address) <= 64 or "@" in address:
            raise ConfigError(f"{address!r} is neither a multiaddr, a swarm id nor a swarm name (1..64 characters)")
        return JoinTarget(None, None, address)
    swarm_id, _, addr = address.rpartition("@") if "@" in address else (None, "", address)
    try:
        parse_multiaddr(addr)
        peer_id_of(addr)
    except Exception:  # noqa: BLE001 — py-multiaddr raises many types
        raise ConfigError(f"{addr!r} is not a peer multiaddr (like /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo...)") from None
    if swarm_id is not None and not is_swarm_id(swarm_id):
        raise ConfigError(f"{swarm_id!r} is not a swarm id (ms + 20 hex characters)")
    return JoinTarget(swarm_id or None, addr)
