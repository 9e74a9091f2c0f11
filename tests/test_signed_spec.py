"""A signed swarm spec across meshtrain versions (node/spec/signed.py): the signature and the swarm
id cover the spec dict as its owner signed it, so a spec signed before a key existed still
verifies under a version that has the key (at its default), keeps its id, and is passed on
unchanged; anything changed after signing is refused."""

from __future__ import annotations

import json

import pytest

from meshtrain.node.spec.signed import FORMAT, SignedSpec, SpecError, swarm_id_of
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.transport.identity import Identity


def older_document(tmp_path, dropped: tuple[str, ...]) -> dict:
    """A spec document as a meshtrain without the `dropped` keys signed it."""
    owner = Identity.load_or_create(tmp_path / "owner")
    spec = SignedSpec.create(SwarmSpec(model="gpt-tiny", name="old"), owner).spec.model_dump()
    for key in dropped:
        del spec[key]
    signature = owner.sign(SignedSpec.signed_message(spec, owner.peer_id_str))
    doc = {"spec": spec, "owner": owner.peer_id_str, "signature": signature.hex()}
    return json.loads(json.dumps({"format": FORMAT, **doc}))  # as read from a file


def test_a_spec_signed_before_newer_keys_existed_verifies_keeps_its_id_and_is_passed_on_unchanged(tmp_path):
    dropped = ("stage_backup", "activation_codec", "spot_check_steps", "score_batches")
    doc = older_document(tmp_path, dropped)
    signed = SignedSpec.from_wire(doc)
    defaults = SwarmSpec()
    assert all(getattr(signed.spec, k) == getattr(defaults, k) for k in dropped)  # the keys it lacked
    assert signed.swarm_id == swarm_id_of(doc["spec"], doc["owner"])  # the id its owner's version gave it
    relayed = signed.to_wire()
    assert relayed["spec"] == doc["spec"] and not set(dropped) & set(relayed["spec"])
    assert SignedSpec.from_wire(relayed, expect_id=signed.swarm_id) == signed
    path = signed.save(tmp_path / "swarm.json")  # and a node's spec file keeps it so
    assert SignedSpec.from_wire(json.loads(path.read_text())).swarm_id == signed.swarm_id


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


def test_a_spec_from_a_newer_version_is_refused_in_one_line_that_says_to_upgrade(tmp_path):
    doc = older_document(tmp_path, ())
    doc["spec"]["a_key_from_the_future"] = 1
    with pytest.raises(SpecError, match="a newer meshtrain created it; upgrade") as e:
        SignedSpec.from_wire(doc)
    assert "'a_key_from_the_future'" in str(e.value) and "\n" not in str(e.value)
