"""A signed swarm spec across meshtrain versions (node/spec/signed.py): the signature and the swarm
id cover the spec dict as its owner signed it, so a spec signed before a key existed still
verifies under a version that has the key (at its default), keeps its id, and is passed on
unchanged; anything changed after signing is refused. Two formats: meshtrain.swarm/2 (the spec's
sections as tables, what `create` signs) and meshtrain.swarm/1 (flat, before the sections), still
read, verified and passed on as v1 with its id."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.errors import ConfigError
from meshtrain.node.spec.signed import FORMAT, FORMAT_V1, SignedSpec, SpecError, swarm_id_of
from meshtrain.node.spec.swarm import FLAT_KEYS, OPTIMIZERS, SECTIONS, SwarmSpec, default_of, parse_spec
from meshtrain.transport.identity import Identity


def older_document(tmp_path, dropped: tuple[str, ...], **given) -> dict:
    """A v1 (flat) spec document as a meshtrain without the `dropped` keys signed it (`given`:
    keys given; a value of the dropped keys' time overrides what this version writes)."""
    owner = Identity.load_or_create(tmp_path / "owner")
    spec = {**SignedSpec.create(SwarmSpec(model="gpt-tiny", name="old", **given), owner).spec.flat(), **given}
    for key in dropped:
        spec.pop(key, None)
    signature = owner.sign(SignedSpec.signed_message(spec, owner.peer_id_str))
    doc = {"spec": spec, "owner": owner.peer_id_str, "signature": signature.hex()}
    return json.loads(json.dumps({"format": FORMAT_V1, **doc}))  # as read from a file


def document(tmp_path, **given) -> dict:
    """A v2 spec document, as `swarm create` writes it."""
    owner = Identity.load_or_create(tmp_path / "owner")
    spec = SwarmSpec(model="gpt-tiny", name="new", H=7, **given)
    return json.loads(json.dumps(SignedSpec.create(spec, owner).to_wire()))


def test_a_spec_signed_before_newer_keys_existed_verifies_keeps_its_id_and_is_passed_on_unchanged(tmp_path):
    dropped = ("stage_backup", "activation_codec", "spot_check_steps", "score_batches")
    doc = older_document(tmp_path, dropped)
    signed = SignedSpec.from_wire(doc)
    assert signed.spec.flat() == {**SwarmSpec().flat(), **doc["spec"], "allowlist": ()}  # the keys it lacked: defaults
    assert signed.swarm_id == swarm_id_of(doc["spec"], doc["owner"])  # the id its owner's version gave it
    relayed = signed.to_wire()
    assert relayed["format"] == FORMAT_V1 and relayed["spec"] == doc["spec"] and not set(dropped) & set(relayed["spec"])
    assert SignedSpec.from_wire(relayed, expect_id=signed.swarm_id) == signed
    path = signed.save(tmp_path / "swarm.json")  # and a node's spec file keeps it so
    assert SignedSpec.from_wire(json.loads(path.read_text())).swarm_id == signed.swarm_id


def test_a_v1_spec_parses_to_the_same_spec_as_its_v2_form_under_its_own_id(tmp_path):
    v1 = SignedSpec.from_wire(older_document(tmp_path, ()))
    v2 = SignedSpec.from_wire(document(tmp_path))
    assert v1.spec == parse_spec(v1.spec.model_dump()) == parse_spec(v1.spec.flat())
    assert (v2.format, v2.signed) == (FORMAT, v2.spec.model_dump(mode="json"))
    assert v1.swarm_id == swarm_id_of(v1.spec.flat(), v1.owner) != swarm_id_of(v1.spec.model_dump(), v1.owner)


def test_a_v2_spec_round_trips_through_its_wire_and_file_form(tmp_path):
    doc = document(tmp_path)
    assert doc["format"] == FORMAT and doc["spec"]["outer"]["H"] == 7 and "H" not in doc["spec"]
    signed = SignedSpec.from_wire(doc, expect_id=doc["swarm_id"])
    assert signed.spec.outer.H == 7 and signed.to_wire() == doc
    path = signed.save(tmp_path / "swarm.json")
    assert SignedSpec.load(path) == signed


@pytest.mark.parametrize(
    "tamper",
    [
        lambda spec: spec.update(H=spec["H"] + 1),  # a value changed
        lambda spec: spec.update(stage_backup=False),  # a key added after signing
        lambda spec: spec.pop("name"),  # a key removed after signing
    ],
)
def test_a_spec_changed_after_signing_is_refused(tmp_path, tamper):
    doc = older_document(tmp_path, ("stage_backup",))
    tamper(doc["spec"])
    with pytest.raises(SpecError, match="does not verify"):
        SignedSpec.from_wire(doc)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda spec: spec["outer"].update(H=8),  # a value changed
        lambda spec: spec["pipeline"].pop("stage_backup"),  # a key removed after signing
        lambda spec: spec.pop("verification"),  # a section removed after signing
    ],
)
def test_a_v2_spec_changed_after_signing_is_refused(tmp_path, tamper):
    doc = document(tmp_path)
    tamper(doc["spec"])
    with pytest.raises(SpecError, match="does not verify"):
        SignedSpec.from_wire(doc)


def test_a_spec_from_a_newer_version_is_refused_in_one_line_that_says_to_upgrade(tmp_path):
    doc = older_document(tmp_path, ())
    doc["spec"]["a_key_from_the_future"] = 1
    with pytest.raises(SpecError, match="a newer meshtrain created it; upgrade") as e:
        SignedSpec.from_wire(doc)
    assert "'a_key_from_the_future'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "future",
    [
        lambda spec: spec.update(telemetry={"on": True}),  # a section from the future
        lambda spec: spec["outer"].update(nesterov=False),  # a key from the future in a section
        lambda spec: spec.update(H=50),  # a flat key is no v2 key
    ],
)
def test_a_v2_spec_with_a_key_this_version_lacks_is_refused_in_one_line_that_says_to_upgrade(tmp_path, future):
    doc = document(tmp_path)
    future(doc["spec"])
    with pytest.raises(SpecError, match="a newer meshtrain created it; upgrade") as e:
        SignedSpec.from_wire(doc)
    assert "\n" not in str(e.value)


def test_a_v1_spec_in_sections_is_no_v1_spec(tmp_path):
    doc = document(tmp_path)
    doc["format"] = FORMAT_V1
    with pytest.raises(SpecError, match="upgrade|invalid"):
        SignedSpec.from_wire(doc)


def deep(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "hostile",
    [
        lambda spec: spec.update(outer=[1, 2]),  # a section that is a list
        lambda spec: spec.update(model="gpt-tiny"),  # a section that is a string (a v1 key)
        lambda spec: spec.update(aggregation=None),
        lambda spec: spec["outer"].update(H=deep(5000)),  # huge nesting
        lambda spec: spec["outer"].update(H={"a": {"b": {"c": 1}}}),
        lambda spec: spec.update({"7": 1}),
        lambda spec: spec["model"].update(source=deep(100)),
        lambda spec: spec.clear(),
    ],
)
def test_a_hostile_spec_is_a_spec_error_not_a_traceback(tmp_path, hostile):
    doc = document(tmp_path)
    hostile(doc["spec"])
    with pytest.raises(SpecError) as e:
        SignedSpec.from_wire(doc)
    assert "\n" not in str(e.value) and len(str(e.value)) < 2000


def test_a_hostile_document_is_a_spec_error(tmp_path):
    for doc in (None, [], {"format": FORMAT}, {"format": FORMAT, "spec": [], "owner": "x", "signature": ""}):
        with pytest.raises(SpecError):
            SignedSpec.from_wire(doc)


def test_the_flat_table_names_every_field_of_every_section_once():
    fields = [(None, name) for name in SwarmSpec.model_fields if name not in SECTIONS]
    fields += [(section, field) for section, cls in SECTIONS.items() for field in cls.model_fields]
    assert sorted(FLAT_KEYS.values(), key=str) == sorted(fields, key=str)  # each once: a dict's keys are unique
    assert set(SECTIONS) == {"model", "data", "outer", "aggregation", "verification", "pipeline", "admission"}
    added = {key for key, (section, field) in FLAT_KEYS.items() if section and field in SECTIONS[section].added_keys}
    assert added == {
        "noloco_outer",
        "error_feedback",
        "pace",
    }  # since the signed form was fixed: written where they act
    assert len(FLAT_KEYS) - len(added) == 60  # the flat spec's keys before the sections, every one kept


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(FLAT_KEYS)), st.just(None), max_size=8))
def test_any_flat_spec_and_its_nested_form_are_one_spec(keys):
    """Keys given flat (at their defaults) or in their sections give one spec; its flat form names
    every key once, by the name the flat spec gave it."""
    flat = {key: default_of(key) for key in keys}
    spec = SwarmSpec.model_validate(flat)
    assert SwarmSpec.model_validate(spec.model_dump()) == spec
    written = spec.flat()  # every key but the ones added since, which say nothing here
    assert set(written) == set(FLAT_KEYS) - {"noloco_outer", "error_feedback", "pace"}
    assert {k: written.get(k, default_of(k)) for k in flat} == flat


def test_keys_added_since_are_signed_only_where_they_act():
    for optimizer in OPTIMIZERS:  # a spec that leaves them alone is signed as before they existed
        assert not {"noloco_outer", "error_feedback", "pace"} & set(
            SwarmSpec(optimizer=optimizer).model_dump()["outer"]
        )
    assert SwarmSpec(codec="topk").model_dump()["outer"]["error_feedback"] is True
    assert SwarmSpec(codec="topk", error_feedback=False).flat()["error_feedback"] is False
    assert "error_feedback" not in SwarmSpec(optimizer="noloco", codec="topk").flat()  # noloco takes none
    noloco = SwarmSpec(optimizer="noloco", outer_lr=0.5).model_dump()["outer"]
    assert (noloco["noloco_outer"], noloco["outer_lr"], noloco["outer_momentum"]) == (True, 0.5, 0.5)  # μ: its own
    assert SwarmSpec(optimizer="noloco", outer_momentum=0.9, noloco_outer=True).outer.outer_momentum == 0.9
    for optimizer in ("diloco", "streaming"):  # pace "swarm" is signed; a swarm of it has another id
        paced = SwarmSpec(optimizer=optimizer, pace="swarm")
        assert paced.model_dump()["outer"]["pace"] == "swarm" and paced.flat()["pace"] == "swarm"
        assert paced.model_dump() != SwarmSpec(optimizer=optimizer).model_dump()


@pytest.mark.parametrize(
    "bad",
    [
        {"noloco_outer": True},
        {"error_feedback": False},
        {"codec": "int8", "error_feedback": False},
        {"codec": "topk", "optimizer": "noloco", "error_feedback": False},
        {"codec": "topk", "optimizer": "sparseloco", "error_feedback": False},
        {"optimizer": "noloco", "pace": "swarm"},
        {"optimizer": "sparseloco", "pace": "swarm"},
        {"optimizer": "dp", "pace": "swarm"},
        {"pace": "fastest"},
    ],
)
def test_an_added_key_where_it_cannot_act_is_refused_in_one_line(bad):
    with pytest.raises(ConfigError) as e:
        parse_spec(bad)
    # (sparseloco reads no codec at all: that is said first)
    assert "\n" not in str(e.value) and any(
        k in str(e.value) for k in ("noloco_outer", "error_feedback", "codec", "pace")
    )


@pytest.mark.parametrize(
    "optimizer, key, value",
    [
        ("diloco", "fragments", 4),
        ("diloco", "sparse_k", 8),
        ("noloco", "eager", True),
        ("sparseloco", "outer_momentum", 0.5),
        ("sparseloco", "codec", "int8"),
        ("dp", "outer_lr", 0.5),
        ("dp", "alpha", 0.2),
        ("streaming", "error_decay", 0.5),
    ],
)
def test_a_key_the_optimizer_does_not_read_is_refused_when_written_and_kept_when_signed(optimizer, key, value):
    flat = {"optimizer": optimizer, key: value}
    with pytest.raises(ConfigError, match=f"{key} does nothing for optimizer {optimizer}") as e:
        parse_spec(flat, form="flat")
    assert "\n" not in str(e.value)
    # A spec signed before the rule keeps loading, as it was signed (its id depends on it), and
    # re-validating it (a follower rank, a reload) does not refuse it either.
    loaded = parse_spec(flat, form="flat", signed=True)
    assert getattr(loaded.outer, key) == value
    assert SwarmSpec.model_validate(loaded.model_dump()) == loaded
    with pytest.raises(ConfigError, match=f"{key} does nothing"):  # but it is not signed again
        SignedSpec.create(loaded, Identity.generate())


def test_every_outer_key_acts_on_the_optimizer_built_from_it_or_is_refused():
    """Walks the outer keys each built-in optimizer reads: changing one changes the optimizer
    the node builds from the spec (`build_outer`) — its attributes or its codec — so no key in
    `spec_keys` is silently ignored; the keys outside it are refused (above)."""
    from meshtrain.collective.local import LocalSwarm
    from meshtrain.node.spec.outer import build_outer
    from meshtrain.optim.spec_section import OPTIMIZER_KEYS

    changed = {
        "outer_lr": 0.3,
        "outer_momentum": 0.2,
        "codec": "int4",
        "fragments": 4,
        "delay": 2,
        "alpha": 0.25,
        "eager": True,
        "error_decay": 0.5,
        "sparse_k": 8,
        "sparse_chunk": 512,
    }
    assert set(changed) == set(OPTIMIZER_KEYS)

    def built(spec: SwarmSpec) -> dict:
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))  # 4 blocks: P up to 4
        inner = torch.optim.AdamW(model.parameters())
        outer = build_outer(spec, model, inner, LocalSwarm(1).add())
        seen = {k: repr(v) for k, v in vars(outer).items() if isinstance(v, int | float | str | bool | tuple | list)}
        # and settings held in dataclasses (the schedule's H, P, delay; SparseLoCo's chunk, k)
        seen |= {k: repr(v) for k, v in vars(outer).items() if dataclasses.is_dataclass(v)}
        for k, v in vars(outer).items():  # an outer torch optimizer holds lr and momentum
            if isinstance(v, torch.optim.Optimizer) and v is not inner:
                seen[k] = repr(v.defaults)
        return seen

    for optimizer in ("diloco", "streaming", "noloco", "sparseloco", "dp"):
        base = SwarmSpec(optimizer=optimizer, H=1 if optimizer == "dp" else 8)
        for key in sorted(base.outer.declared.spec_keys):
            flat = {**base.flat(), key: changed[key]}
            if optimizer == "noloco" and key == "codec":
                continue  # NoLoCo's codec moves φ, not Δ: checked by its own tests
            try:
                spec = parse_spec(flat, form="flat")
            except ConfigError as e:
                pytest.fail(f"{optimizer}: {key}={changed[key]!r} is refused: {e}")
            assert built(spec) != built(base), f"{optimizer} ignores {key}"


def test_a_topk_spec_signed_before_error_feedback_existed_runs_without_it_and_keeps_its_id(tmp_path):
    doc = older_document(tmp_path, ("error_feedback", "noloco_outer"), codec="topk")
    signed = SignedSpec.from_wire(doc)
    assert signed.swarm_id == swarm_id_of(doc["spec"], doc["owner"])
    assert (signed.spec.outer.error_feedback, signed.spec.outer.topk_error_feedback) == (False, None)
    assert parse_spec(signed.spec.model_dump()) == signed.spec  # as a node hands it to its local ranks
    assert SignedSpec.from_wire(signed.to_wire()) == signed and "error_feedback" not in signed.to_wire()["spec"]
    now = SignedSpec.from_wire(document(tmp_path, codec="topk"))  # written now: error feedback, signed
    assert now.spec.outer.topk_error_feedback == 0.95 and now.signed["outer"]["error_feedback"] is True


def test_a_noloco_spec_signed_before_noloco_outer_existed_runs_its_own_beta_and_mu(tmp_path):
    # Its creator's --outer-lr 0.5 was ignored then, and the spec carries DiLoCo's outer_momentum 0.9.
    old = {"optimizer": "noloco", "outer_lr": 0.5, "outer_momentum": 0.9}
    doc = older_document(tmp_path, ("error_feedback", "noloco_outer"), **old)
    signed = SignedSpec.from_wire(doc)
    assert signed.swarm_id == swarm_id_of(doc["spec"], doc["owner"])
    assert signed.spec.outer.noloco_outer is False
    assert parse_spec(signed.spec.model_dump()) == signed.spec  # the dump says so, for a reader that infers
    now = SignedSpec.from_wire(document(tmp_path, optimizer="noloco", outer_lr=0.5)).spec.outer  # written now
    assert (now.noloco_outer, now.outer_lr, now.outer_momentum) == (True, 0.5, 0.5)
