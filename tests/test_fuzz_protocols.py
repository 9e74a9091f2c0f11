"""The protocol fuzzer (`scripts/fuzz_protocols.py`), CI-sized: a few hundred hostile messages from
a fresh identity that is not a swarm member, on every protocol a live 2-node swarm serves, end in
no crash and no hang, and change no round, membership or state, and no member stores a record
the stranger owns — progress and metrics included (they are refused and counted). The
oracle is not blind: the same future-round join, sent by an identity that *is* made a member, is
flagged (positive control).
"""

from __future__ import annotations

import pytest

from scripts.fuzz_protocols import fuzz

CASES = 300


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_non_member_cannot_crash_hang_or_steer_a_live_swarm(tmp_path):
    out = await fuzz(cases=CASES, seed_value=14, nodes=2, control=True, data_dir=tmp_path)

    assert out["cases"] == CASES
    assert {
        "allreduce/join",
        "dataplane",
        "dataplane-tcp",
        "crdt/pull",
        "gossipsub",
        "dht/store",
        "state/chunk",
        "swarm/spec",
        "/meshtrain/tensors/1",
    } <= set(out["by_protocol"])
    assert out["crashes"] == 0, out["findings"]
    assert out["hangs"] == 0, out["findings"]
    # positive control: a member's join for a future round with expected = [itself] is flagged
    assert out["control"]["join_flagged"], out["control"]
    assert out["nonmember_effects"] == 0, out["findings"]  # any CRDT entry of the stranger's stored counts
    assert out["crdt_refused"].get("crdt-not-a-member", 0) > 0, out["crdt_refused"]  # its records did arrive
