"""Stage backups (node/stages/state.py, Backups): at every epoch end a peer of another stage keeps a
copy of each stage that has a single replica, so that the stage survives that replica's crash —
the refill resumes from the backup's step, not from the initial weights. The choice of backer is
a pure function of the epoch's placement (unit test); the swarm test runs real `Node`s on
loopback like tests/test_pipeline_swarm.py."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack

import pytest
import torch

from meshtrain.node.stages import handover as stage_handover
from meshtrain.node.stages.peer import PipelinePeer
from meshtrain.node.stages.state import StageStates, backers
from meshtrain.node.state.sync import CHUNK_RPC, MANIFEST_RPC
from meshtrain.pipeline.placement import stage_map
from meshtrain.transport.identity import Identity

from .conftest import start_peers
from .test_pipeline_swarm import pipeline_spec, refilled_stage_mover, stage_step, three_daemons, wait_for


def test_every_single_replica_stage_gets_one_backer_on_another_stage_the_same_on_every_peer():
    """`backers` names, for every stage with exactly one replica and only for those, a peer of
    another stage (the lowest id on the next stage), a different peer for each stage while there
    are enough, and does not depend on the order the placement is listed in."""
    rng = random.Random(7)
    for _ in range(300):
        S = rng.randint(1, 6)
        n = rng.randint(1, 10)
        placement = {f"p{i:02d}": rng.randrange(S) for i in range(n)}
        got = backers(placement, S)
        shuffled = list(placement.items())
        rng.shuffle(shuffled)
        assert backers(dict(shuffled), S) == got  # every peer computes the same
        stages = stage_map(placement, S)
        single = {s for s in range(S) if len(stages[s]) == 1}
        coverable = {s for s in single if len(placement) > 1}
        assert set(got) == coverable, (placement, got)
        for s, peer in got.items():
            assert placement[peer] != s, (placement, got)  # never the replica itself
        for s, peer in got.items():  # a peer backs two stages only when all it could pick back one
            earlier = {q for t, q in got.items() if t < s}
            if peer in earlier:
                assert {p for p in placement if placement[p] != s} <= earlier, (placement, got)
    # Fixed cases: the lowest id on the next stage; distinct backers when there are enough peers.
    assert backers({"a": 0, "b": 0, "c": 1}, 2) == {1: "a"}
    assert backers({"a": 0, "b": 1}, 2) == {0: "b", 1: "a"}
    assert backers({"a": 0, "b": 1, "c": 2}, 3) == {0: "b", 1: "c", 2: "a"}
    assert backers({"a": 0, "b": 1, "c": 1, "d": 2}, 3) == {0: "b", 2: "a"}
    assert backers({"a": 0, "b": 0, "c": 1, "d": 2}, 3) == {1: "d", 2: "a"}
    assert backers({"x": 1, "y": 2}, 3) == {1: "y", 2: "x"}  # stage 0 empty: nothing to back up
    assert backers({"a": 0}, 1) == {}  # nobody else


async def test_a_refill_falls_back_to_an_older_backup_when_the_newest_snapshots_holder_fails():
    """A last replica that dies as it leaves may still answer the manifest request with the newest
    snapshot and then fail every chunk (seen in the swarm test below under load). The refill must
    then take the older snapshot the backer holds, not start the stage from θ0. Real hosts on
    loopback; the dying donor's chunk handler fails every request."""
    async with AsyncExitStack() as stack:
        me, dying, backer = await start_peers(stack, 3, full_mesh=True)
        mover = StageStates(me.host, me.ts, "every-step")
        older = {"blocks.1.fc.weight": torch.randn(4, 4, generator=torch.Generator().manual_seed(1))}
        StageStates(dying.host, dying.ts, "every-step").publish(1, 9, {"weights": {**older}, "adam": {}})
        StageStates(backer.host, backer.ts, "every-step").publish(1, 5, {"weights": older, "adam": {}})

        async def dead(peer: str, request: object) -> None:
            raise ConnectionError("the donor is going away")

        dying.host.rpc.serve(CHUNK_RPC, dead)
        got = await mover.fetch(1, [], [dying.host.peer_id, backer.host.peer_id], backer_peers={backer.host.peer_id})
        assert got is not None and got.step == 5 and got.from_backup and not got.from_replicas, got
        assert got.donors == (backer.host.peer_id,)
        assert torch.equal(got.state["weights"]["blocks.1.fc.weight"], older["blocks.1.fc.weight"])


def crash_donor(node) -> None:
    """From now on `node` serves no state, as a crashed peer would: every manifest and chunk
    request fails (its stop is graceful and takes a moment, in which it would still serve)."""

    async def dead(peer: str, request: object) -> None:
        raise ConnectionError("crashed")

    for name in (MANIFEST_RPC, CHUNK_RPC):
        node.host.rpc.serve(name, dead)


@pytest.mark.slow
@pytest.mark.parametrize("backer_moves", [False, True])
async def test_a_crashed_single_replica_stage_is_refilled_from_its_backup_not_from_initial_weights(
    tmp_path, monkeypatch, backer_moves
):
    """Three daemons: two origins on stage 0, one peer on stage 1. An epoch end (an export's
    `request_epoch_end`) makes the lowest-id origin back stage 1 up; then the stage-1 peer leaves
    without handing its stage over (`HANDOVER_WAIT` 0, and its donor answers nothing from then
    on: as after a crash; a graceful stop that still served its newest snapshot, one the backer
    had not copied yet, once made the refill take that instead, on CI). Placement moves the
    faster origin to stage 1 — announced forward times make it the backer itself (which enters
    its own copy) or the other origin (which downloads the backup from the backer) — and it
    trains on from the backup's step; both survivors reach the last step."""
    monkeypatch.setattr(stage_handover, "HANDOVER_WAIT", 0.0)
    ids = sorted(Identity.load_or_create(tmp_path / name).peer_id_str for name in "abc")
    # forward seconds by id rank: the lower id of the two origins is the faster (it moves) or the slower
    fwd = {p: 0.01 * (r + 1 if backer_moves else 3 - r) for r, p in enumerate(ids)}
    monkeypatch.setattr(PipelinePeer, "_measure_forward", lambda self: fwd[self.me])
    async with three_daemons(tmp_path, pipeline_spec(steps=24)) as (nodes, results):
        await wait_for(lambda: all(stage_step(n)[1] >= 4 for n in nodes.values()))
        (gone,) = [name for name, n in nodes.items() if stage_step(n)[0] == 1]
        origins = sorted((n.pipeline.me, name) for name, n in nodes.items() if name != gone)
        backer = origins[0][1]  # the lowest id on stage 0, the next stage after 1
        nodes[backer].pipeline.request_epoch_end()
        await wait_for(lambda: nodes[backer].pipeline.status()["backup"] is not None)
        backup = nodes[backer].pipeline.status()["backup"]
        assert backup["stage"] == 1 and backup["step"] >= 4, backup
        assert nodes[origins[1][1]].pipeline.status()["backup"] is None  # one backer per stage
        crash_donor(nodes[gone])
        nodes[gone].stop()
    mover = refilled_stage_mover(tmp_path, nodes, results, gone, 24)
    joined = mover.pipeline.joined_from
    assert joined is not None and joined["stage"] == 1, joined
    assert not joined["from_replicas"] and joined["from_backup"], joined
    assert joined["step"] >= backup["step"] >= 4, (joined, backup)  # not step 0: not θ0
    assert (mover is nodes[backer]) == backer_moves, (backer, mover.pipeline.me)
    assert (joined["bytes"] == 0) == backer_moves, joined  # its own copy, or downloaded from the backer
