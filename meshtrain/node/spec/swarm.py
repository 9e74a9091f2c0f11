"""The swarm's contract: `SwarmSpec`, what every peer of one swarm trains, and `parse_spec`.

`SwarmSpec` is the swarm's contract — model, tokenizer, data, optimizer, hyper-parameters, and
the digests of the model's, tokenizer's, dataset's and (py:) optimizer's files, pinned when it is
signed (node/spec/signed.py) — written once by the swarm's creator and identical on every peer; a
node may not override it (how a node runs is `config.NodeConfig`'s business).

Sections. Besides its `name`, `seed` and `steps`, the spec is seven sections, each a frozen model
owned by the layer that reads it (meshtrain/spec_section.py): `model` (models/spec_section.py:
source, tokenizer, context, digests, precision — peers that train in different precisions are
different experiments), `data` (data/spec_section.py), `outer` (optim/spec_section.py: the outer
optimizer and its hyper-parameters, the inner AdamW's, `group_size`), `aggregation`
(collective/spec_section.py: how every all-reduce combines the peers' contributions and screens
them), `verification` (node/trust/spec_sections.py: loss scoring, spot-checks, strikes),
`pipeline` (pipeline/spec_section.py) and `admission` (node/trust/spec_sections.py). Readers
say which: `spec.outer.H`, `spec.pipeline.stages`, `spec.aggregation.rule`. A section checks its
own fields (`SpecSection.check`); the rules across sections are here:

- an optimizer's own defaults for keys of any section (its class's `spec_defaults`, by flat key);
- unless the spec names a rule, an open swarm whose optimizer all-reduces dense contributions
  combines robustly (trimmed_mean; `aggregation.screen_*` and `verification` then apply, and an
  explicit `mean` stays); every other swarm keeps the mean; a robust rule is refused for an
  optimizer whose class gives a `not_robust_reason`;
- a file dataset is tokenised as bytes unless the spec names a tokenizer (chars is refused);
- dp in fp16 is refused (loss scaling would part the replicas);
- a spot-check needs diloco and at most H steps (still tested by the optimizer's name, like dp's
  precision rule: no other optimizer's class has anything to declare there);
- a pipeline cuts a built-in GPT or an hf: / hf-config: model of a family models/staged.py
  knows, in fp32 or bf16 (fp16's loss scaling would need every stage to agree to skip a step),
  where `pipeline.stage_cut` says (pipeline/cut.py); `check` checks what it can without reading
  files, and the architecture and layer count of an hf model are checked where the cut is pinned
  (`SignedSpec.create`); a bf16 pipeline's hops are bf16 unless the spec names an
  `activation_codec` (its stages compute in bf16 already: half the bytes a hop).

`SwarmSpec.aggregation_options` (the one place the spec reaches the collective's
`AllReduceConfig`) and `SwarmSpec.group_plan` (collective/groups.py) read several sections.

Flat keys. Users name a key by its flat name: the `swarm create` flag (`--H`,
`--aggregation-trim`, `--pipeline`, `--admission`), a `meshtrain.swarm/1` spec file's key. A
field's flat name is its own, unless its section renames it (`SpecSection.flat_names`:
`aggregation.trim` is `aggregation_trim`, `pipeline.kind` is `pipeline`, `model.source` is
`model`); `FLAT_KEYS`, derived from the sections, is the one table between the two, which the
CLI's flags, the v1 reader and docs/configuration.md use. The one entry point that takes flat
keys is the spec's validation itself (`SwarmSpec(...)`, `SwarmSpec.model_validate`, `parse_spec`):
it takes the nested form (`{"name": ..., "outer": {"H": 10}}`, the `meshtrain.swarm/2` wire form,
`model_dump()`), or the flat form (`{"H": 10}`: every key by its flat name) — flat when a key is
no top-level field or a section's value is not a mapping. Python callers (tests, scripts, the
demo) build specs with flat keys this way; `SwarmSpec.flat()` is the flat form of a spec. Keys a
section added since the signed form was fixed appear in `model_dump()` and `flat()` only where
they say something, and a signed document lacking one reads it as the behaviour before the key
(`parse_spec(..., signed=True)`; meshtrain/spec_section.py).
`parse_spec` validates an untrusted dict into a checked spec (a one-line `ConfigError`, naming the
key as the input named it). `default_of` is a key's value in a spec given no keys — the
cross-section defaults applied —, the default the flags' help and docs/configuration.md show.

A spec that names a py: optimizer is checked with `OuterOptimizer`'s own values: a spec is parsed
(from the network, too) before and without loading the code it names (optim/spec_section.py).

Not here: the spec's signature, the swarm id, the wire and file form (v1 flat, v2 nested) and
`swarm join`'s addresses (node/spec/signed.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from meshtrain.collective.groups import GroupPlan
from meshtrain.collective.spec_section import AggregationSection
from meshtrain.data.spec_section import DataSection
from meshtrain.errors import ConfigError
from meshtrain.models.sources import PRESETS, parse_model_source
from meshtrain.models.spec_section import ModelSection
from meshtrain.models.staged import PIPELINE_MODELS
from meshtrain.node.spec.config import one_line_error
from meshtrain.node.trust.spec_sections import AdmissionSection, VerificationSection
from meshtrain.optim.spec_section import OPTIMIZERS, OuterSection, declared
from meshtrain.pipeline.cut import parse_stage_cut
from meshtrain.pipeline.spec_section import PipelineSection
from meshtrain.spec_section import SIGNED_BEFORE, SpecSection

__all__ = [
    "FLAT_KEYS",
    "OPTIMIZERS",
    "SECTIONS",
    "SwarmSpec",
    "default_of",
    "field_of",
    "is_flat",
    "nested_form",
    "parse_spec",
]


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
    seed: int = Field(
        0,
        ge=0,
        lt=2**31,
        description="the swarm's seed: a fresh model's θ0, every peer's data, the groups of grouped rounds",
    )
    steps: int = Field(2000, ge=0, description="inner steps to train; 0 = until stopped")
    model: ModelSection = Field(ModelSection.model_validate({}), description="what model, tokenizer and precision")
    data: DataSection = Field(DataSection.model_validate({}), description="what data, how much per step, evaluation")
    outer: OuterSection = Field(OuterSection.model_validate({}), description="the outer and inner optimizers")
    aggregation: AggregationSection = Field(
        AggregationSection.model_validate({}), description="how all-reduces combine and screen contributions"
    )
    verification: VerificationSection = Field(
        VerificationSection.model_validate({}), description="loss scoring, spot-checks, strikes"
    )
    pipeline: PipelineSection = Field(PipelineSection.model_validate({}), description="a pipeline swarm's stages")
    admission: AdmissionSection = Field(AdmissionSection.model_validate({}), description="who may take part")

    @model_validator(mode="before")
    @classmethod
    def _nested_with_cross_section_defaults(cls, data: Any) -> Any:
        """The nested form of `data` (flat keys moved into their sections), with the defaults that
        depend on other sections written in (each rule's docstring). A section that is no mapping
        is left for the field's validation to refuse."""
        if not isinstance(data, Mapping):
            return data
        nested = nested_form(data)
        for default in (
            _defaults_of_the_optimizer,
            _robust_in_open_swarms,
            _tokenizer_for_the_data,
            _bf16_hops_for_bf16_pipelines,
        ):
            default(nested)
        return nested

    def check(self) -> SwarmSpec:
        """The sections' own rules and the rules across sections (the module docstring), which the
        optimizers and the trainer would otherwise reject at start-up."""
        self.model.check()
        self.outer.check()
        if self.outer.optimizer == "dp" and self.model.precision == "fp16":
            raise ConfigError(
                "swarm spec: dp with fp16: loss scaling skips overflowing steps on one peer and not "
                "another, and the replicas part; use bf16"
            )
        optimizer = self.outer.declared
        if self.aggregation.robust and optimizer.not_robust_reason:
            raise ConfigError(
                f"swarm spec: aggregation {self.aggregation.rule} needs an all-reduce of dense contributions; "
                f"{self.outer.optimizer} {optimizer.not_robust_reason}: use aggregation mean"
            )
        self.aggregation.check()
        self.verification.check()
        steps = self.verification.spot_check_steps
        if steps and (self.outer.optimizer != "diloco" or steps > self.outer.H):
            raise ConfigError(
                f"swarm spec: spot_check_steps ({steps}) recomputes inner steps of a diloco round "
                f"from its start: it needs optimizer diloco (not {self.outer.optimizer}) and at most H "
                f"({self.outer.H}) steps"
            )
        self.pipeline.check()
        if self.pipeline.kind != "none":
            self._check_pipeline()
        return self

    def _check_pipeline(self) -> None:
        """A pipeline swarm: stages of a built-in GPT or an hf: / hf-config: model
        (models/staged.py), in fp32 or bf16, cut as `stage_cut` says (if pinned). Without reading files: an
        hf model's architecture and layer count are checked where the cut is pinned
        (`SignedSpec.create`)."""
        source, stages = self.model.source, self.pipeline.stages
        kind = parse_model_source(source).kind
        if kind not in ("builtin", "hf", "hf-config"):
            raise ConfigError(f"swarm spec: pipeline swarms cut {PIPELINE_MODELS}, not {source}")
        if self.model.precision == "fp16":
            raise ConfigError(
                "swarm spec: pipeline swarms train in fp32 or bf16, not fp16 (its loss scaling would need "
                "every stage to agree to skip a step): use --precision bf16"
            )
        n_layer = PRESETS[source]().n_layer if kind == "builtin" else None
        if n_layer is not None and not 2 <= stages <= n_layer + 1:
            raise ConfigError(f"swarm spec: {source} has {n_layer} blocks: 2..{n_layer + 1} stages, not {stages}")
        if self.pipeline.stage_cut:
            parse_stage_cut(self.pipeline.stage_cut, stages, n_layer)

    def aggregation_options(self) -> dict[str, Any]:
        """The all-reduce's combination rule (`AllReduceConfig` fields) for this swarm: the one
        place the spec's `aggregation` reaches the collective, for every all-reduce it runs (the
        daemon's, so `meshtrain.Swarm` loops too), keeping the contributions the verification
        section's checks need (`VerificationSection.kept_samples`)."""
        return self.aggregation.options(self.verification.kept_samples)

    def round_window(self) -> int:
        """How far, in inner steps, a round may be from a peer's own step for the peer to take part
        in it (the collective's `round_window`): a join further from a coordinator's step is
        refused, and a peer further behind a round re-syncs before it can share it. Four rounds,
        at least 64 steps."""
        return max(4 * self.outer.H, 64)

    def group_plan(self) -> GroupPlan | None:
        """How the swarm's outer rounds are grouped (collective/groups.py), for the collective: the
        one place the spec's `group_size` reaches it. None where rounds are never grouped: the
        optimizers whose class gives an `ungrouped_reason`, and pipeline swarms (per-stage sync)."""
        if self.outer.declared.ungrouped_reason or self.pipeline.kind != "none":
            return None
        return GroupPlan(group_size=self.outer.group_size, seed=self.seed, period=self.outer.H)

    def flat(self) -> dict[str, Any]:
        """The flat form: every field by its flat name (`FLAT_KEYS`), as a v1 spec file held it —
        a key added since only where it says something (`model_dump()`, meshtrain/spec_section.py)."""
        dump = self.model_dump()
        return {
            key: dump[field] if section is None else dump[section][field]
            for key, (section, field) in FLAT_KEYS.items()
            if section is None or field in dump[section]
        }


def _section_classes() -> dict[str, type[SpecSection]]:
    out: dict[str, type[SpecSection]] = {}
    for name, info in SwarmSpec.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, SpecSection):
            out[name] = info.annotation
    return out


def _flat_keys() -> dict[str, tuple[str | None, str]]:
    keys: dict[str, tuple[str | None, str]] = {}
    for name in SwarmSpec.model_fields:
        section = SECTIONS.get(name)
        pairs = (
            [(name, (None, name))]
            if section is None
            else [(section.flat_name(field), (name, field)) for field in section.model_fields]
        )
        for key, where in pairs:
            if key in keys:  # a programming error: two fields would share one flag and v1 key
                raise TypeError(f"the swarm spec's flat key {key} names both {keys[key]} and {where}")
            keys[key] = where
    return keys


# Section name -> its model, and flat key -> (section or None for a top-level field, field).
SECTIONS: Mapping[str, type[SpecSection]] = _section_classes()
FLAT_KEYS: Mapping[str, tuple[str | None, str]] = _flat_keys()
# A field's dotted path -> its flat name: what a validation error of a flat spec calls it.
_FLAT_NAME_OF = {f"{s}.{f}": key for key, (s, f) in FLAT_KEYS.items() if s is not None}


def field_of(key: str) -> FieldInfo:
    """The field a flat key names (`FLAT_KEYS`): its type, default, bounds and help text."""
    section, field = FLAT_KEYS[key]
    return (SwarmSpec if section is None else SECTIONS[section]).model_fields[field]


def default_of(key: str) -> Any:
    """The value flat key `key` has in a spec that gives no keys (`SwarmSpec()`): its field's
    default, or the one another section decides (an open diloco swarm's aggregation is
    trimmed_mean, not the field's mean) — what `swarm create --help` shows."""
    section, field = FLAT_KEYS[key]
    spec = _spec_of_no_keys()
    return getattr(spec if section is None else getattr(spec, section), field)


@cache
def _spec_of_no_keys() -> SwarmSpec:
    return SwarmSpec.model_validate({})


def is_flat(data: Mapping[Any, Any]) -> bool:
    """Whether `data` is the flat form: a key that is no top-level field, or a section that is
    not a mapping (a flat spec's `model`, `aggregation`, `pipeline`, `admission` are strings)."""
    return any(
        key not in SwarmSpec.model_fields or (key in SECTIONS and not isinstance(value, Mapping | SpecSection))
        for key, value in data.items()
    )


def nested_form(data: Mapping[Any, Any], *, flat: bool | None = None) -> dict[Any, Any]:
    """`data` in the nested form, as a new dict whose sections are new dicts too (a section given
    as a model becomes its dump); keys no table knows stay at the top, for validation to refuse.
    flat: whether `data` is flat (None: `is_flat` tells)."""
    if not (is_flat(data) if flat is None else flat):
        return {key: _table(value) if key in SECTIONS else value for key, value in data.items()}
    out: dict[Any, Any] = {}
    for key, value in data.items():
        section, field = FLAT_KEYS.get(key, (None, key))
        if section is None:
            out[field] = value
        else:
            out.setdefault(section, {})[field] = value
    return out


def _table(section: Any) -> Any:
    """A section's value as a new dict (anything else as it is, for validation to refuse)."""
    if isinstance(section, SpecSection):
        return section.model_dump()
    return dict(section) if isinstance(section, Mapping) else section


def _given(nested: dict[Any, Any], section: str, field: str) -> Any:
    """The value `nested` gives `section.field` (None: not given, or the section is no mapping)."""
    values = nested.get(section, {})
    return values.get(field) if isinstance(values, dict) else None


def _default(nested: dict[Any, Any], section: str, field: str, value: Any) -> None:
    """Write `value` into `section.field` of `nested` unless the spec gives one (None: not given)."""
    values = nested.setdefault(section, {})
    if isinstance(values, dict) and values.get(field) is None:
        values[field] = value


def _defaults_of_the_optimizer(nested: dict[Any, Any]) -> None:
    """An optimizer's own defaults (its class's `spec_defaults`, by flat key) for the keys the
    spec does not give. The fields' defaults stay, so other optimizers' specs — and their swarm
    ids — are unchanged."""
    for key, value in declared(_given(nested, "outer", "optimizer")).spec_defaults.items():
        section, field = FLAT_KEYS[key]
        if section is None:
            if nested.get(field) is None:
                nested[field] = value
        else:
            _default(nested, section, field, value)


def _robust_in_open_swarms(nested: dict[Any, Any]) -> None:
    """Unless the rule is given, a swarm open to strangers whose optimizer all-reduces dense
    contributions combines them robustly (trimmed_mean: a per-coordinate rule that bounds a
    scaled, flipped or noisy update best in scripts/bench/bench_adversarial.py); others: mean."""
    optimizer = declared(_given(nested, "outer", "optimizer") or "diloco")
    dense = optimizer.dense_all_reduce and (_given(nested, "pipeline", "kind") or "none") == "none"
    robust = dense and (_given(nested, "admission", "mode") or "open") == "open"
    _default(nested, "aggregation", "rule", "trimmed_mean" if robust else "mean")


def _tokenizer_for_the_data(nested: dict[Any, Any]) -> None:
    """A file dataset is streamed, and chars needs the whole text for its alphabet: unless a
    tokenizer is named, a file dataset is tokenised as bytes; chars for one is an error."""
    if (_given(nested, "data", "dataset") or "builtin") == "builtin":
        return
    if _given(nested, "model", "tokenizer") == "chars":
        raise ValueError(
            "tokenizer chars needs the whole text for its alphabet; a file dataset is streamed: use bytes or hf:<dir>"
        )
    _default(nested, "model", "tokenizer", "bytes")


def _bf16_hops_for_bf16_pipelines(nested: dict[Any, Any]) -> None:
    """A pipeline whose stages compute in bf16 sends its hops in bf16 (half float32's bytes) unless
    the spec names an activation codec (pipeline/hop_codec.py)."""
    pipeline = _given(nested, "pipeline", "kind") or "none"
    if pipeline != "none" and _given(nested, "model", "precision") == "bf16":
        _default(nested, "pipeline", "activation_codec", "bf16")


def parse_spec(
    data: Mapping[str, Any], *, form: Literal["flat", "nested"] | None = None, signed: bool = False
) -> SwarmSpec:
    """`data`, nested or flat (the module docstring; `form` None: `is_flat` tells, else as
    `form` says — a signed spec's format does), as a checked spec; a one-line `ConfigError`
    naming the key as `data` named it. signed: `data` is a signed document, as its owner signed
    it (a key added since that it lacks reads as the behaviour before the key: spec_section.py)."""
    flat = is_flat(data) if form is None else form == "flat"
    try:
        context = {SIGNED_BEFORE: True} if signed else None
        spec = SwarmSpec.model_validate(nested_form(data, flat=flat), context=context).check()
    except ValidationError as e:
        raise one_line_error(e, "swarm spec", shown_as=_FLAT_NAME_OF if flat else None) from None
    if not signed:
        spec.outer.check_written()
    return spec
